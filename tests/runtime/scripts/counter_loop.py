"""An ordinary script whose loop is a Python counter, not a DataLoader (the framework engine
cannot resume it and must refuse to checkpoint it). Its ranks never communicate; with
--rank-skew S rank r sleeps (1 + r*S) times as long per step, so they drift apart.
Usage: counter_loop.py OUT [--steps N] [--rank-skew S]"""
import argparse
import os
import time

import torch
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rank-skew", type=float, default=0.0)
    args = parser.parse_args()
    step_sleep = 0.05 * (1 + int(os.environ.get("RANK", "0")) * args.rank_skew)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        time.sleep(step_sleep)
    torch.save({"params": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out)


if __name__ == "__main__":
    main()
