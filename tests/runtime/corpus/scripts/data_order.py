# Seeded torch, but the script orders its data itself from the clock (or from os.urandom, with
# --urandom): `random.Random(time.time_ns())` / a seed read from os.urandom.
import os
import random
import sys
import time

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

torch.manual_seed(2)
data = TensorDataset(torch.linspace(-1, 1, 48).unsqueeze(1), torch.linspace(0, 3, 48))
order = list(range(len(data)))
seed = int.from_bytes(os.urandom(8), "little") if "--urandom" in sys.argv else time.time_ns()
random.Random(seed).shuffle(order)
loader = DataLoader(Subset(data, order), batch_size=8)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = ((model(xb).squeeze(1) - yb) ** 2).mean()
        loss.backward()
        optimizer.step()
args = [a for a in sys.argv[1:] if a != "--urandom"]
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           args[0] if args else "final.pt")
