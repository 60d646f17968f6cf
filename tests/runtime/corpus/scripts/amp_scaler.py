# Mixed precision on CPU the way GPU scripts do it: autocast(bfloat16) and a GradScaler. Its
# scale starts near float32's limit and grows every 5 steps, so the scaled gradients overflow
# now and then: those iterations skip optimizer.step() and back the scale off, as fp16 training
# on a GPU does (24 iterations, 4 skipped). With growth every 5 steps, a resume that restored the
# scaler as it was before the cut's update() (one growth step behind) skips a different
# iteration and ends with other parameters (checked by hand, session 25); at 2, 3, 4 and 7 the
# two runs' scales meet again at the next overflow and the error would go unseen.
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(13)
x = torch.randn(96, 6)
y = x.sum(1, keepdim=True)
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=5)
skipped = 0
for epoch in range(2):
    for xb, yb in DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True):
        optimizer.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
print(f"skipped {skipped} steps; scale {scaler.get_scale()}")
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict()}, sys.argv[1] if len(sys.argv) > 1 else "final.pt")
