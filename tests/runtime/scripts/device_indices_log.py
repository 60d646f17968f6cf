"""A small DataLoader loop (checkpointable by the framework engine) whose ranks train on their own
(one all-reduce of the loss per step keeps them in step, so they can agree on a cut) and log
MERIDIAN_DEVICE_INDICES whenever the value they see changes, to OUT.rank<r>.indices.
Usage: device_indices_log.py OUT [--epochs N] [--step-sleep S]"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = None
    with open(f"{args.out}.rank{os.environ['RANK']}.indices", "a") as log:
        for _ in range(args.epochs):
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(inputs), targets)
                loss.backward()
                optimizer.step()
                dist.all_reduce(loss.detach().clone())
                indices = os.environ.get("MERIDIAN_DEVICE_INDICES", "unset")
                if indices != seen:
                    log.write(indices + "\n")
                    log.flush()
                    seen = indices
                time.sleep(args.step_sleep)
    dist.destroy_process_group()
    torch.save({"params": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out)


if __name__ == "__main__":
    main()
