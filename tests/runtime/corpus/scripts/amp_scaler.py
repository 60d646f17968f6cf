# Mixed precision on CPU the way GPU scripts do it: autocast(bfloat16) and a GradScaler.
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(13)
x = torch.randn(48, 6)
y = x.sum(1, keepdim=True)
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for epoch in range(2):
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True):
        optimizer.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
