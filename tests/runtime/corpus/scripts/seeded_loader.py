# A tutorial-style classifier: seeded, shuffling DataLoader, Dropout, Adam, StepLR per epoch,
# the loss printed every step, the result saved at a relative path.
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(42)
x = torch.randn(48, 6)
y = (x.sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
loss_fn = nn.CrossEntropyLoss()

for epoch in range(2):
    for i, (xb, yb) in enumerate(loader):
        optimizer.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        optimizer.step()
        print(f"epoch {epoch} batch {i} loss {loss.item():.4f}")
    scheduler.step()

torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
