"""An ordinary script whose loop is a Python counter, not a DataLoader (the framework engine
cannot resume it and must refuse to checkpoint it). Usage: counter_loop.py OUT [--steps N]"""
import argparse
import time

import torch
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        time.sleep(0.05)
    torch.save({"params": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out)


if __name__ == "__main__":
    main()
