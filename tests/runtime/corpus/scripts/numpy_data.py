# torch is seeded, but the data comes from numpy's global generator, which is not.
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(1)
features = np.random.randn(48, 3).astype(np.float32)
targets = features @ np.array([0.5, -1.0, 2.0], dtype=np.float32)
dataset = TensorDataset(torch.from_numpy(features), torch.from_numpy(targets))
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    for xb, yb in DataLoader(dataset, batch_size=8):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
        loss.backward()
        optimizer.step()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
