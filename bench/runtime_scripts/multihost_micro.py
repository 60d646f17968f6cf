"""One rank of bench/runtime_multihost.py --micro: where a step's collectives spend their time.

Times, interleaved in the same processes (so machine load hits all alike), one step's worth of
all-reduces (DDP's two buckets of the 3x512 MLP: 263,169 and 295,936 float32) these ways:
gloo's own all-reduce (plain DDP's); the flat rank-order path's parts (all-to-all, the rank-order
combine, all-gather) and the whole of it through the virtual group, without and with the cut's
flags (one more small all-reduce); that flags all-reduce alone; and the chain across hosts
(runtime/hostchain.py) with the flags in its messages, when the ranks' hosts allow it. Each
variant starts after an untimed barrier. Rank 0 writes {variant: [median wall s, median CPU s]}.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (rank 0 hosts the store there),
MERIDIAN_NODE_ADDR (gloo binds there). Usage: multihost_micro.py OUT_JSON [--iters K]
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from runtime import vpg  # noqa: E402

BUCKETS = (263_169, 295_936)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    server = dist.TCPStore(addr, port, world, is_master=True, wait_for_workers=False) if rank == 0 else None

    def connect():
        return vpg.InnerGroup(rank=rank, world_size=world, master_addr=addr, master_port=port,
                              key_prefix="micro", bind_addr=os.environ["MERIDIAN_NODE_ADDR"],
                              timeout=datetime.timedelta(seconds=120))
    group = vpg.VirtualProcessGroup(rank, world, connect, vpg.CollectiveHooks())
    vpg._state["group"] = group
    inner = group.ensure_inner()
    chain = inner.host_chain
    buckets = [torch.randn(n) for n in BUCKETS]

    def gloo_allreduce():
        for bucket in buckets:
            inner.pg.allreduce([bucket.clone()]).wait()

    parts = {"flat: all-to-all": 0.0, "flat: rank-order combine": 0.0, "flat: all-gather + copy": 0.0}

    def flat_in_parts():
        for bucket in buckets:
            reduction = vpg._RankOrderAllreduce(bucket.clone(), dist.ReduceOp.SUM, world, rank)
            began = time.perf_counter()
            reduction.scatter(inner.pg).wait()
            scattered = time.perf_counter()
            mine = vpg._reduce_in_rank_order(list(reduction.received.view(world, reduction.mine_size)),
                                             dist.ReduceOp.SUM)
            combined = time.perf_counter()
            reduction.gather(inner.pg).wait()  # combines again inside: subtracted below
            reduction.finish()
            gathered = time.perf_counter()
            del mine
            parts["flat: all-to-all"] += scattered - began
            parts["flat: rank-order combine"] += combined - scattered
            parts["flat: all-gather + copy"] += gathered - combined - (combined - scattered)

    def flat_vpg(flags):
        inner.host_chain = None  # the flat gloo path, whatever the hosts
        try:
            for index, bucket in enumerate(buckets):
                if flags and index == 0:
                    vpg.send_flags_with_next_allreduce([0, 0])
                group.allreduce([bucket.clone()]).wait()
            if flags:
                vpg.take_carried_flags()
        finally:
            inner.host_chain = chain

    def flags_alone():
        summed = torch.zeros(2, dtype=torch.int64)
        inner.pg.allreduce([summed]).wait()

    def chained():
        for index, bucket in enumerate(buckets):
            if index == 0:
                vpg.send_flags_with_next_allreduce([0, 0])
            group.allreduce([bucket.clone()]).wait()
        vpg.take_carried_flags()

    variants = {
        "gloo allreduce (plain DDP's)": gloo_allreduce,
        "flat path, in parts": flat_in_parts,
        "flat path via vpg, no flags": lambda: flat_vpg(False),
        "flat path via vpg + flags all-reduce": lambda: flat_vpg(True),
        "flags all-reduce alone (2 x int64)": flags_alone,
    }
    if chain is not None:
        variants["chain across hosts + flags in it"] = chained
    timings = {name: [] for name in variants}
    part_timings = {name: [] for name in parts}
    for iteration in range(args.iters + 10):
        for name, run in variants.items():
            inner.pg.barrier().wait()
            for part in parts:
                parts[part] = 0.0
            began, began_cpu = time.perf_counter(), time.process_time()
            run()
            wall, cpu = time.perf_counter() - began, time.process_time() - began_cpu
            if iteration >= 10:
                timings[name].append((wall, cpu))
                if name == "flat path, in parts":
                    for part, seconds in parts.items():
                        part_timings[part].append((seconds, 0.0))
    timings.update(part_timings)
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({name: [statistics.median(t[0] for t in values), statistics.median(t[1] for t in values)]
                       for name, values in timings.items()} | {"chain": chain is not None}, handle)
    inner.pg.barrier().wait()
    group.close_inner()
    del server


if __name__ == "__main__":
    main()
