"""An ordinary torchrun-style DDP training script (no Meridian import): gloo, a
DistributedSampler that shuffles, random augmentation, dropout, Adam."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class Augmented(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.05 * torch.randn_like(x), y


g = torch.Generator().manual_seed(3)
dataset = Augmented(torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g))
sampler = DistributedSampler(dataset, shuffle=True, seed=5)
loader = DataLoader(dataset, batch_size=8, sampler=sampler)
model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.1),
                                              nn.Linear(12, 1)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
           f"{args.out}.rank{rank}")
dist.destroy_process_group()
