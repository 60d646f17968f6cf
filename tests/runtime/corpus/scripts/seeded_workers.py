# Random augmentation in the Dataset, a shuffling DataLoader with two worker processes, SGD with
# momentum, a tqdm progress bar (a hand-rolled \r bar where tqdm is not installed).
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

try:
    from tqdm import tqdm
except ImportError:
    def tqdm(iterable, desc=""):
        total = len(iterable)
        for i, item in enumerate(iterable):
            sys.stdout.write(f"\r{desc} [{'#' * (i + 1)}{'.' * (total - i - 1)}] {i + 1}/{total}")
            sys.stdout.flush()
            yield item
        sys.stdout.write("\n")


class Jittered(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(40, 5, generator=g)
        self.y = self.x @ torch.arange(1.0, 6.0)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(5), self.y[i]


if __name__ == "__main__":
    torch.manual_seed(0)
    loader = DataLoader(Jittered(), batch_size=8, shuffle=True, num_workers=2)
    model = nn.Linear(5, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for epoch in range(2):
        for xb, yb in tqdm(loader, desc=f"epoch {epoch}"):
            optimizer.zero_grad()
            loss = ((model(xb).squeeze(1) - yb) ** 2).mean()
            loss.backward()
            optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               sys.argv[1] if len(sys.argv) > 1 else "final.pt")
