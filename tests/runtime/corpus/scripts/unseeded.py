# The common tutorial that seeds nothing: a synthetic dataset and the model both come from
# torch's default (per-process) random seed.
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

X = torch.randn(48, 4)
Y = X @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(48)
loader = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
for epoch in range(2):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb).squeeze(-1), yb)
        loss.backward()
        opt.step()
    print("epoch", epoch, "loss", loss.item())
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
