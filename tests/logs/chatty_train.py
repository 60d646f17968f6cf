"""A tiny training script that prints every step (the live-log tests and bench/log_latency.py).

    chatty_train.py [--steps N] [--step-sleep S] [--control DIR] [--fail-at STEP]

Each optimizer step prints "step <n> rank <r>" (n from the optimizer's own step count, so a
resumed run goes on counting). With --control DIR, a file DIR/burst-<bytes> makes rank 0 print
that many bytes of numbered lines once, then "burst <bytes> end" (the file is renamed *.done);
a file DIR/mark-<token> makes it print "mark <token> <time.time()>" once (latency probes).
--fail-at makes the last rank raise at that step.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def control(directory, rank):
    if not directory or rank != 0:
        return
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith("burst-") and name[6:].isdigit():
            total = int(name[6:])
            written, i = 0, 0
            while written < total:
                line = f"burst {total} line {i:08d} " + "x" * 40 + "\n"
                sys.stdout.write(line)
                written += len(line)
                i += 1
            print(f"burst {total} end lines={i}", flush=True)
            os.rename(path, path + ".done")
        elif name.startswith("mark-") and not name.endswith(".done"):
            print(f"mark {name[5:]} {time.time():.6f}", flush=True)
            os.rename(path, path + ".done")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--control", default=None)
    parser.add_argument("--fail-at", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=1, sampler=sampler)
    first = next(iter(model.parameters()))
    epochs = -(-args.steps // len(loader))
    done = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        if done >= args.steps:
            break
        for x, y in loader:
            if done >= args.steps:
                break
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            done = int(optimizer.state[first]["step"])  # restored with the optimizer on a resume
            print(f"step {done} rank {rank}", flush=True)
            if args.fail_at is not None and done >= args.fail_at and rank == world - 1:
                raise ValueError(f"rank {rank} gives up at step {done}")
            control(args.control, rank)
            time.sleep(args.step_sleep)
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
