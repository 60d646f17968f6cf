"""An ordinary DDP script that times its optimizer steps (used by bench/runtime_*.py).

Usage: timed_ddp.py OUT_JSON [--steps N] [--width W] [--batch B]
Rank 0 writes {"step_s": [wall seconds of each step], "cpu_s": [CPU seconds of the rank process,
all its threads, per step]} to OUT_JSON. Works under plain torch
(torchrun-style env) and under meridian-run; without WORLD_SIZE > 1 it runs single-process.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 1))
    wrapped = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 64)
    y = torch.randn(args.batch, 1)
    times, cpu = [], []
    for _ in range(args.steps):
        began, began_cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({"step_s": times, "cpu_s": cpu, "params": sum(p.numel() for p in model.parameters())}, handle)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
