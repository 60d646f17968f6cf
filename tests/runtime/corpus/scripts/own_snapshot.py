# A script with its own fault tolerance: it saves a snapshot after every epoch and, at start,
# loads it if it exists and skips the epochs it thinks done. The snapshot path is relative
# ("snapshot.pt") unless SNAPSHOT names an absolute one.
import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(17)
snapshot = os.environ.get("SNAPSHOT", "snapshot.pt")
x = torch.randn(48, 4)
y = (x[:, 0] > x[:, 1]).long()
loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
start_epoch = 0
if os.path.exists(snapshot):
    saved = torch.load(snapshot)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    start_epoch = saved["epoch"] + 1
    print(f"resuming from my own snapshot at epoch {start_epoch}")
for epoch in range(start_epoch, 3):
    for xb, yb in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
               snapshot)
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
