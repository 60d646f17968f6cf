"""An ordinary DDP training script: nothing in it knows about Meridian.

Usage: ddp_mlp.py OUT_PATH [--epochs E] [--step-sleep S] [--backend gloo|nccl] [--frozen-mb M]
                  [--hold-until FILE] [--gpu-by-local-rank]
W ranks from the torchrun-style environment; a small MLP with dropout, Adam, a shuffling
DataLoader (DistributedSampler) with random augmentation. Rank 0 writes the final parameters
and optimizer state to OUT_PATH. --backend nccl: the model and batches on the rank's CUDA
device (cuda:0 of what it sees; with --gpu-by-local-rank cuda:LOCAL_RANK, set as the current device
before init_process_group, as a torchrun GPU script picks its GPU; each rank prints its LOCAL_RANK,
LOCAL_WORLD_SIZE and device), as a GPU script would have them. --hold-until: after training,
every rank waits until FILE exists (at most 20 minutes, then exits 1): a test's gate, so the job
keeps its devices until the test has seen what that job was for.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class NoisyPoints(Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(dim=1, keepdim=True) > 0).float()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]  # random augmentation


def hold(path, limit_s=1200):
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"ddp_mlp.py: {path} did not appear within {limit_s} s (--hold-until)")
        time.sleep(0.2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--frozen-mb", type=float, default=0.0)
    parser.add_argument("--hold-until", default=None)
    parser.add_argument("--gpu-by-local-rank", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if args.gpu_by_local_rank else 0
    device = torch.device("cuda", local_rank) if args.backend == "nccl" else torch.device("cpu")
    if args.gpu_by_local_rank and device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    if args.gpu_by_local_rank:
        print(f"rank {rank}: LOCAL_RANK {local_rank} of LOCAL_WORLD_SIZE {os.environ.get('LOCAL_WORLD_SIZE')}, "
              f"device {device}", flush=True)
    torch.manual_seed(1234 + rank)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    if args.frozen_mb:  # its own generator: the other random streams are those of a run without it
        table = torch.randn(int(args.frozen_mb * 2**20) // 4, generator=torch.Generator().manual_seed(99))
        model.register_parameter("frozen", nn.Parameter(table, requires_grad=False))
    model = model.to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    sampler = DistributedSampler(NoisyPoints(), shuffle=True, seed=7)
    loader = DataLoader(NoisyPoints(), batch_size=16, sampler=sampler)
    loss_fn = nn.BCEWithLogitsLoss()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    if args.hold_until:
        hold(args.hold_until)
    if rank == 0:
        torch.save({"params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                    "optimizer": optimizer.state_dict()}, args.out)
    print(f"rank {rank} done after {args.epochs} epochs", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
