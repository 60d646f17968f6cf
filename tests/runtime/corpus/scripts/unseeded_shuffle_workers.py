# Nothing is seeded, yet everything random is drawn from torch's global RNG *after* the start:
# a constant-initialised model, fixed data, a shuffling DataLoader with two workers and Dropout.
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    x = torch.linspace(-2, 2, 40).reshape(20, 2)
    y = x[:, 0] * 2 - x[:, 1]
    model = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.25), nn.Linear(4, 1))
    for p in model.parameters():
        nn.init.constant_(p, 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, num_workers=2)
    for epoch in range(2):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(xb).squeeze(1), yb).backward()
            opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               sys.argv[1] if len(sys.argv) > 1 else "final.pt")
