"""What opening and closing the Premium reserve costs, per toggle, on fleets of 10k .. 1M accelerators.

    .venv/bin/python bench/pool_toggle.py [--sizes 10000,100000,1000000] [--toggles 200]

On the first placement tick's snapshot of bench/plan_dump.py (`placement`: every device free, the
reserve 1% of the fleet) and on bench/scheduler_tick.py's mixed fleet (the reserve spread over
nodes with few free devices, one heap push per node), it opens the reserve and closes it again
`--toggles` times and prints the median microseconds of one open + close, and the reserve's
size in devices and nodes. The core does this whenever a Premium job follows a job of another
tier in line (order.fifo, order.las) and per Premium job the backfill places.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import plan_dump  # noqa: E402

from scheduler.state import POOL_RESERVE, WorkingState  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--rows", default="placement,mixed")
    parser.add_argument("--toggles", type=int, default=200)
    args = parser.parse_args(argv)
    print(f"{'row':>10} {'accel':>8} {'reserve devices':>15} {'nodes':>6} | {'open+close us (median)':>22}")
    for n in [int(s) for s in args.sizes.split(",")]:
        for row in args.rows.split(","):
            state = WorkingState(plan_dump.snapshot_of(row, n))
            times = []
            for _ in range(args.toggles):
                began = time.perf_counter()
                state.open_pool(POOL_RESERVE)
                state.close_pools()
                times.append(time.perf_counter() - began)
            nodes = int(np.unique(state.node[state.reserve]).size)
            print(f"{row:>10} {n:>8} {state.reserve.size:>15} {nodes:>6} | {statistics.median(times) * 1e6:>22.0f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
