"""An ordinary single-process training script (no Meridian import): MLP with BatchNorm and
Dropout, AdamW, an LR scheduler, a shuffling DataLoader with random augmentation drawn from
torch, numpy and python RNGs. Options exist only so the tests can vary it."""
import argparse
import copy
import random

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--n", type=int, default=96)
parser.add_argument("--hidden", type=int, default=16)
parser.add_argument("--sched", choices=["epoch", "step"], default="epoch")
parser.add_argument("--two-optimizers", action="store_true")
parser.add_argument("--swap-optimizers", action="store_true")
parser.add_argument("--rng-after-step", action="store_true")
parser.add_argument("--eval-after-step", action="store_true")
parser.add_argument("--loader-generator", action="store_true")
parser.add_argument("--ema", choices=["none", "before-step", "after-step"], default="none")
args = parser.parse_args()

torch.manual_seed(0)
random.seed(0)
np.random.seed(0)


class Noisy(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.1 * torch.randn(8)                      # torch RNG
        x = x * float(np.random.uniform(0.9, 1.1))                # numpy RNG
        if random.random() < 0.5:                                 # python RNG
            x = x.flip(0)
        return x, self.y[i]


model = nn.Sequential(nn.Linear(8, args.hidden), nn.BatchNorm1d(args.hidden), nn.ReLU(),
                      nn.Dropout(0.2), nn.Linear(args.hidden, 3))
if args.two_optimizers:
    def build_first():
        return torch.optim.AdamW(model[0].parameters(), lr=1e-2)

    def build_second():
        return torch.optim.SGD(list(model[1].parameters()) + list(model[4].parameters()),
                               lr=0.1, momentum=0.9)
    if args.swap_optimizers:  # same optimizers, built in the other order
        second = build_second()
        first = build_first()
    else:
        first = build_first()
        second = build_second()
    optimizers = [first, second]
else:
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)]
scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1 if args.sched == "epoch"
                                            else 5, gamma=0.7)
loader = DataLoader(Noisy(args.n), batch_size=16, shuffle=True, num_workers=args.workers,
                    generator=torch.Generator().manual_seed(2) if args.loader_generator else None)
loss_fn = nn.CrossEntropyLoss()
ema = copy.deepcopy(model) if args.ema != "none" else None


def ema_update():
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)

for _epoch in range(args.epochs):
    model.train()
    for x, y in loader:
        if args.ema == "before-step":
            ema_update()
        for opt in optimizers:
            opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        for opt in optimizers:
            opt.step()
        if args.sched == "step":
            scheduler.step()
        if args.ema == "after-step":
            ema_update()
        if args.rng_after_step:
            torch.rand(1)
        if args.eval_after_step:  # evaluation inside the loop: its loader draws a base seed
            with torch.no_grad():
                for x_eval, _ in DataLoader(Noisy(16), batch_size=8):
                    model(x_eval)
    if args.sched == "epoch":
        scheduler.step()
    model.eval()
    with torch.no_grad():
        model(torch.ones(4, 8))

torch.save({"model": model.state_dict(), "ema": ema.state_dict() if ema else None,
            "optimizers": [o.state_dict() for o in optimizers],
            "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}, args.out)
