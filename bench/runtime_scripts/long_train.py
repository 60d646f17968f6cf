"""An ordinary training script that runs until stopped (for the migration benchmark).

Usage: long_train.py OUT_PATH [--width W] [--epochs E]. DDP when WORLD_SIZE > 1.
A DataLoader over a fixed tensor set, an MLP of three WxW layers, Adam.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=100000)
    args = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 1))
    wrapped = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(torch.randn(512, 16), torch.randn(512, 1)), batch_size=32,
                        shuffle=True)
    for _ in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
