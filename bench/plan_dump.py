"""Dumps the core's plan for benchmark snapshots, to prove a change to the core plans the same.

    .venv/bin/python bench/plan_dump.py --out DIR [--sizes 10000,100000] [--rows mixed,placement,...]
    .venv/bin/python bench/plan_dump.py --compare DIR_BEFORE DIR_AFTER

Rows:
  mixed, contended   the snapshots of bench/scheduler_tick.py (seed 7; the trace of env
                     MERIDIAN_PHILLY_TRACE or its default);
  placement          the first placement tick of bench/placement_tick.py: the fleet and jobs of
                     bench/control_plane.py (8 H100 per node, 2 regions, ~95% of the fleet in pending
                     jobs of W in {1,2,4,8}, tiers 20/30/50% Premium/Standard/Basic), built here in
                     numpy as jobs.snapshot would read them from the database (no database needed);
  overfull           the same with jobs for 130% of the fleet (some wait: the reserve's reasons);
  <row>-fifo         a row planned with order.fifo instead of the default order: tiers interleave
                     in line, so the Premium reserve is opened and closed again and again.
Per row it writes DIR/<row>-<size>.plan (one line per decision and per waiting job: every field,
in order) and prints the plan's sha256, its length and the median wall and CPU seconds (this
process) of `--repeats` plans. --compare prints, per file, whether the two dumps are byte-identical and the first line
that differs. Dumps are large (100k accelerators: ~10 MB): keep them out of the repository.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scheduler import BASIC, PREMIUM, STANDARD, Jobs, Policy, PolicySettings, Snapshot, Teams, schedule  # noqa: E402
from scheduler.snapshot import Accelerators  # noqa: E402
from scheduler.state import forget_topology  # noqa: E402

NOW = 1_000_000_000.0


def placement_snapshot(n_acc: int, seed: int = 1, fill: float = 0.95) -> Snapshot:
    """Returns the snapshot of bench/placement_tick.py's first tick at n_acc accelerators: every
    device free, every job pending (as bench/control_plane.build_fleet_and_jobs makes them)."""
    rng = np.random.default_rng(seed)
    clusters = max(1, n_acc // 8 // 2 // 250)
    nodes_per_cluster = n_acc // 8 // 2 // clusters
    n_nodes = 2 * clusters * nodes_per_cluster
    node = np.repeat(np.arange(n_nodes), 8)
    node_cluster = np.arange(n_nodes) // nodes_per_cluster
    racks_per_cluster = -(-nodes_per_cluster // 32)  # fleet_generate: 32 nodes per rack
    node_rack = node_cluster * racks_per_cluster + (np.arange(n_nodes) % nodes_per_cluster) // 32
    acc = Accelerators(
        type_id=np.zeros(node.size, np.int64), node=node, rack=node_rack[node],
        cluster=node_cluster[node], region=node_cluster[node] // clusters,
        healthy=np.ones(node.size, np.bool_), holder=np.full(node.size, -1, np.int64),
        releasing_until=np.full(node.size, -np.inf))
    sizes = rng.choice([1, 2, 4, 8], p=[0.4, 0.2, 0.2, 0.2], size=n_acc)
    tiers = rng.choice([PREMIUM, STANDARD, BASIC], p=[0.2, 0.3, 0.5], size=n_acc)
    n_jobs = int(np.searchsorted(np.cumsum(sizes), int(n_acc * fill))) + 1
    world = sizes[:n_jobs].astype(np.int64)
    index = np.arange(n_jobs)
    n_teams = 3
    submit = NOW - 60.0 + index * 1e-6  # submitted in id order
    jobs = Jobs(ids=index + 1, team=index % n_teams, tier=tiers[:n_jobs].astype(np.int64),
                type_id=np.zeros(n_jobs, np.int64), world_size=world,
                min_devices=np.where(index % 2 == 1, 1, world), state=np.zeros(n_jobs, np.int8),
                submit_time=submit, attained_device_seconds=np.zeros(n_jobs),
                ideal_device_seconds=(NOW - submit) * world, last_checkpoint_time=np.full(n_jobs, -np.inf),
                last_checkpoint_step=np.zeros(n_jobs, np.int64), checkpoint_bytes=np.zeros(n_jobs, np.int64),
                last_start_time=np.full(n_jobs, -np.inf))
    teams = Teams(names=[f"team-{i}" for i in range(n_teams)], quota=np.full((n_teams, 1), 2 * n_acc, np.int64))
    return Snapshot(accelerators=acc, jobs=jobs, teams=teams, now=NOW, type_names=("H100-80GB",),
                    settings=PolicySettings())


def snapshot_of(row: str, n: int) -> Snapshot:
    row = row.removesuffix("-fifo")
    if row == "placement":
        return placement_snapshot(n)
    if row == "overfull":
        return placement_snapshot(n, fill=1.3)
    import scheduler_tick

    path = pathlib.Path(os.environ.get("MERIDIAN_PHILLY_TRACE", scheduler_tick.DEFAULT_TRACE))
    trace = scheduler_tick.load_trace(path)
    return scheduler_tick.build_snapshot(n, trace, seed=7, busy=None if row == "mixed" else 0.98)


def plan_text(plan) -> str:
    lines = [repr(d) for d in plan.decisions] + [repr(w) for w in plan.waiting]
    return "\n".join(lines) + "\n"


def dump(args) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'row':>13} {'accel':>8} {'jobs':>7} {'decisions':>9} {'waiting':>7} | {'plan s':>7} {'CPU s':>7} | sha256")
    for n in [int(s) for s in args.sizes.split(",")]:
        for row in args.rows.split(","):
            snapshot = snapshot_of(row, n)
            policy = Policy.from_names(order="order.fifo") if row.endswith("-fifo") else None
            walls, cpus, plan = [], [], None
            for _ in range(args.repeats):
                forget_topology()  # each plan as a first tick on this fleet
                began, cpu = time.perf_counter(), time.process_time()
                plan = schedule(snapshot, policy)
                walls.append(time.perf_counter() - began)
                cpus.append(time.process_time() - cpu)
            text = plan_text(plan)
            (out / f"{row}-{n}.plan").write_text(text)
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            print(f"{row:>13} {n:>8} {len(snapshot.jobs):>7} {len(plan.decisions):>9} {len(plan.waiting):>7} | "
                  f"{statistics.median(walls):>7.3f} {statistics.median(cpus):>7.3f} | {digest}", flush=True)


def compare(before: str, after: str) -> int:
    differ = 0
    for path in sorted(pathlib.Path(before).glob("*.plan")):
        other = pathlib.Path(after) / path.name
        if not other.exists():
            print(f"{path.name}: missing in {after}")
            differ += 1
            continue
        a, b = path.read_text(), other.read_text()
        if a == b:
            print(f"{path.name}: identical ({a.count(chr(10))} lines)")
            continue
        differ += 1
        for i, (la, lb) in enumerate(zip(a.splitlines(), b.splitlines())):
            if la != lb:
                print(f"{path.name}: differs at line {i + 1}:\n  before {la[:200]}\n  after  {lb[:200]}")
                break
        else:
            print(f"{path.name}: one is a prefix of the other")
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the dumps")
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--rows", default="mixed,contended,placement,overfull,overfull-fifo")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("--out or --compare is needed")
    dump(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
