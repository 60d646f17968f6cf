# torch.compile on CPU (inductor), seeded, Adam.
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(19)
x = torch.randn(48, 4)
y = x.pow(2).sum(1, keepdim=True)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
compiled = torch.compile(model)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for epoch in range(2):
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True):
        optimizer.zero_grad()
        nn.functional.mse_loss(compiled(xb), yb).backward()
        optimizer.step()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
