"""Where the jobs that finish last lost their time: one cell of the goals grid (workload, load,
seed), replayed under each policy; for the last jobs to finish under Meridian, a table of what
each policy did to them, and where Meridian's time went (waiting, running below W, spread).

    MERIDIAN_PHILLY_TRACE=... nice .venv/bin/python bench/sim_job_loss.py philly 2 0
    nice .venv/bin/python bench/sim_job_loss.py multinode 1.5 0 --jobs 3 --decisions 383

This is how issue 16's makespan misses were read (docs/devlog/2026-12-05/pol20.md): the makespan
is the finish of one job, so a miss is that job's story. "Below W" and "spread" are seconds of
ideal progress lost while it ran on fewer devices than W (d/W x splice efficiency) or over more
nodes than it needs (x spread efficiency), integrated over Meridian's decisions; "waiting" is
time without devices after its submission. The three add up to its time lost less the start-up
and checkpoint/restore pauses. Seeded: the same arguments give the same table.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler import placement_cost  # noqa: E402
from scheduler.sim import goals, make_policy  # noqa: E402
from scheduler.sim.engine import Engine  # noqa: E402
from scheduler.sim.fidelity import ApprovalModel, StartupCosts  # noqa: E402
from scheduler.sim.trace import TIER_NAMES  # noqa: E402


def replay(trace, fleet, name, seed):
    """Returns (engine after the run, {job: [(time, devices, spread, kind, reason)]}, summary)."""
    engine = Engine(trace, fleet, make_policy(name), tick_s=goals.TICK_S, seed=seed,
                    startup=StartupCosts(), approvals=ApprovalModel())
    history: dict[int, list] = {}
    apply = engine.apply

    def logged(decision):
        out = apply(decision)
        j = int(decision.job)
        history.setdefault(j, []).append((engine.now, int(engine.ndev[j]), j in engine.spread_jobs,
                                          decision.kind, decision.reason or ""))
        return out

    engine.apply = logged
    summary = engine.run().summary()
    return engine, history, summary


def losses(engine, events, j):
    """Returns (waiting, below W, spread) seconds lost by job j, from its decisions."""
    w = int(engine.W[j])
    t, devices, spread = float(engine.submit[j]), 0, False
    waiting = below = spread_s = 0.0
    for at, n, is_spread, _kind, _why in events + [(float(engine.finish[j]), 0, False, "", "")]:
        dt = at - t
        if devices == 0:
            waiting += dt
        else:
            speed = placement_cost.speed(devices, w, 1, 1)
            below += dt * (1.0 - speed)
            if spread:
                spread_s += dt * speed * (1.0 - placement_cost.SPREAD_EFFICIENCY)
        t, devices, spread = at, n, is_spread
    return waiting, below, spread_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", help="a quick-grid workload name or part of one (philly, heavy-tail, ...)")
    p.add_argument("load", type=float)
    p.add_argument("seed", type=int)
    p.add_argument("--jobs", type=int, default=3, help="how many of Meridian's last jobs to show (3)")
    p.add_argument("--decisions", default="", help="comma-separated job ids whose Meridian decisions to list")
    p.add_argument("--trace", default=os.environ.get("MERIDIAN_PHILLY_TRACE"), help="Philly CSV")
    args = p.parse_args(argv)
    fleet, workloads, _, _ = goals.quick_grid()
    chosen = [w for w in workloads if args.workload in w.name]
    if not chosen:
        p.error(f"no quick-grid workload matches {args.workload!r}: {', '.join(w.name for w in workloads)}")
    trace = chosen[0].build(fleet, args.seed, args.trace).scaled(args.load)
    runs = {name: replay(trace, fleet, name, args.seed) for name in goals.POLICIES}
    print(f"{chosen[0].name} @{args.load:g}x seed {args.seed} on {fleet.name}")
    print(f"{'policy':9s} {'makespan':>9s} {'avg JCT':>8s} {'p99 JCT':>8s}")
    for name, (_, _, s) in runs.items():
        print(f"{name:9s} {s['makespan_s'] / 86400:8.2f}d {s['avg_jct_s'] / 3600:7.2f}h {s['p99_jct_s'] / 3600:7.2f}h")
    engine, history, _ = runs["meridian"]
    last = np.argsort(-np.nan_to_num(engine.finish, nan=-1.0))[:args.jobs]
    print()
    print(f"{'job':>6s} {'tier':8s} {'W':>3s} {'run h':>7s} | finish d (preemptions) per policy"
          f"{'':10s} | Meridian lost h: waiting / below W / spread")
    for j in last.tolist():
        cells = [f"{name[:4]} {e.finish[j] / 86400:6.2f} ({int(e.n_preempt[j])})" for name, (e, _, _) in runs.items()]
        waiting, below, spread = losses(engine, history.get(j, []), j)
        print(f"{j:6d} {TIER_NAMES[int(trace.tier[j])]:8s} {int(engine.W[j]):3d} {trace.duration[j] / 3600:7.1f} | "
              f"{'  '.join(cells)} | {waiting / 3600:.1f} / {below / 3600:.1f} / {spread / 3600:.1f}")
    for j in (int(x) for x in args.decisions.split(",") if x.strip()):
        print(f"\nMeridian's decisions for job {j}:")
        for at, n, spread, kind, why in history.get(j, []):
            print(f"  {at / 86400:8.3f} d  {kind:8s} -> {n} devices{' (spread)' if spread else ''}  {why[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
