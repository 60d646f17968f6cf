# Gradient accumulation over 2 batches, AdamW, a per-step cosine LR schedule.
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(11)
x = torch.randn(64, 5)
y = (x[:, 0] * x[:, 1] > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
model = nn.Sequential(nn.Linear(5, 12), nn.GELU(), nn.Linear(12, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
accum = 2
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2 * len(loader) // accum)
for epoch in range(2):
    for i, (xb, yb) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(xb), yb) / accum
        loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict()}, sys.argv[1] if len(sys.argv) > 1 else "final.pt")
