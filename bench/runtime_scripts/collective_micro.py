"""Times one collective three ways inside the same processes (interleaved, so machine load hits
all alike): gloo's ring all-reduce straight on the inner group, the same through the virtual group, and the cut's
meta-allreduce of two int64 flags. Run W copies with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
pointing at a TCPStore server. Usage: collective_micro.py OUT_JSON [--floats N] [--iters K]"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from runtime import vpg  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--floats", type=int, default=560_000)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    def connect():
        return vpg.InnerGroup(rank=rank, world_size=world, master_addr=addr, master_port=port,
                              key_prefix="micro", timeout=datetime.timedelta(seconds=60))
    group = vpg.VirtualProcessGroup(rank, world, connect, vpg.CollectiveHooks())
    vpg._state["group"] = group
    inner = group.ensure_inner()
    bucket = torch.randn(args.floats)
    timings = {"gloo ring allreduce": [], "virtual group allreduce": [],
               "cut meta-allreduce (2 x int64)": []}
    for i in range(args.iters + 10):
        began = time.perf_counter()
        inner.pg.allreduce([bucket.clone()]).wait()
        t_gloo = time.perf_counter() - began
        began = time.perf_counter()
        group.allreduce([bucket.clone()]).wait()
        t_virtual = time.perf_counter() - began
        began = time.perf_counter()
        vpg.meta_allreduce([0, 0])
        t_meta = time.perf_counter() - began
        if i >= 10:
            timings["gloo ring allreduce"].append(t_gloo)
            timings["virtual group allreduce"].append(t_virtual)
            timings["cut meta-allreduce (2 x int64)"].append(t_meta)
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({k: statistics.median(v) for k, v in timings.items()}, handle)
    group.close_inner()


if __name__ == "__main__":
    main()
