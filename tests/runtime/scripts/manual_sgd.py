"""A regression script written without torch.optim: manual SGD (`p.data.add_(-lr * p.grad)`).

With WORLD_SIZE > 1 it averages the gradients itself with dist.all_reduce (no DDP). Prints
"iter <i>" every iteration (tests follow its log); rank 0 saves the parameters at the end.
After iteration 3 it waits while the file --hold-while names exists (a test keeps the job there
as long as it needs, on a machine of any load): ticks of 0.1 s, each with an all-reduce of "do all
ranks still see the file" when W > 1, so the ranks agree when to go on and keep running
collectives meanwhile. The wait changes nothing in the model. Each iteration sleeps S seconds.
Usage: manual_sgd.py OUT [--iters N] [--sleep S] [--hold-while PATH]
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--hold-while", default=None)
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(5)
    x = torch.randn(64, 3)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.3
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(100 + rank)
    lr = 0.05
    for i in range(args.iters):
        batch = torch.randint(0, 64, (16,), generator=generator)
        model.zero_grad()
        nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        with torch.no_grad():
            for p in model.parameters():
                if world_size > 1:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
                p.data.add_(-lr * p.grad)
        print(f"iter {i}", flush=True)
        time.sleep(args.sleep)
        while i == 3 and args.hold_while:
            holding = torch.tensor([1.0 if os.path.exists(args.hold_while) else 0.0])
            if world_size > 1:
                dist.all_reduce(holding)
            if holding.item() < world_size:
                break
            time.sleep(0.1)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
