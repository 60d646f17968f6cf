# A script whose data folder is empty (a wrong path, a failed download): its loop trains nothing
# and it exits at once, successfully.
import glob
import sys

import torch

model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for path in sorted(glob.glob("data/*.pt")):
    xb, yb = torch.load(path)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(xb), yb).backward()
    optimizer.step()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
