# LBFGS, which calls a closure several times per step.
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(7)
x = torch.randn(48, 4)
y = torch.sin(x.sum(1))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
for epoch in range(2):
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True):
        def closure():
            optimizer.zero_grad()
            loss = ((model(xb).squeeze(1) - yb) ** 2).mean()
            loss.backward()
            return loss
        loss = optimizer.step(closure)
        print(f"loss {loss.item():.5f}")
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
