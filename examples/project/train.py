"""A user's training project as `meridian submit` ships it (a code bundle): an ordinary PyTorch
script that reads its data and writes its results with relative paths, as on a laptop.

    python train.py [--epochs E] [--step-sleep S]

Reads data/points.csv (relative to the project folder, which is the job's workspace); writes
outputs/started.txt once, before training (a resumed copy finds it there, restored with the
workspace, and leaves it), after every epoch outputs/checkpoints/latest.pt (its own checkpoint), and
at the end outputs/model.pt and outputs/metrics.json. W ranks
from the torchrun-style environment (gloo); rank 0 writes. Nothing in it knows about Meridian:
it is preempted, moved and resized, and its outputs follow it (saved with every checkpoint).
"""
import argparse
import csv
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def load_points(path):
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    x = torch.tensor([[float(r[f"x{i}"]) for i in range(4)] for r in rows])
    y = torch.tensor([[float(r["label"])] for r in rows])
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    outputs = pathlib.Path("outputs")
    if rank == 0:
        outputs.mkdir(exist_ok=True)
        if not (outputs / "started.txt").exists():
            (outputs / "started.txt").write_text(f"first started by pid {os.getpid()} in {os.getcwd()}\n")
    data = load_points("data/points.csv")
    torch.manual_seed(1234 + rank)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    trained = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.Adam(trained.parameters(), lr=1e-2)
    sampler = DistributedSampler(data, shuffle=True, seed=7) if distributed else None
    loader = DataLoader(data, batch_size=32, sampler=sampler, shuffle=sampler is None)
    loss_fn = nn.BCEWithLogitsLoss()
    loss = torch.tensor(0.0)
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(trained(x), y)
            loss.backward()
            optimizer.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
        if rank == 0:  # the script's own checkpoint, as users write them: the newest epoch's state
            (outputs / "checkpoints").mkdir(exist_ok=True)
            torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       outputs / "checkpoints" / "latest.pt")
    if rank == 0:
        torch.save(model.state_dict(), outputs / "model.pt")
        (outputs / "metrics.json").write_text(json.dumps({"epochs": args.epochs, "final_loss": loss.item()}))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
