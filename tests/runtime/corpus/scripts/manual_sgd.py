# Linear regression with hand-written SGD: no torch.optim optimizer at all.
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(5)
x = torch.randn(48, 3)
y = x @ torch.tensor([2.0, -1.0, 0.5]) + 1.0
w = torch.zeros(3, requires_grad=True)
b = torch.zeros(1, requires_grad=True)
lr = 0.05
for epoch in range(2):
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True):
        loss = ((xb @ w + b - yb) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in (w, b):
                p.add_(p.grad, alpha=-lr)
                p.grad.zero_()
torch.save({"model": {"w": w.detach(), "b": b.detach()}, "optimizer": None},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
