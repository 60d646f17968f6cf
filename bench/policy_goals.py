"""Issue 16's policy goals on Philly windows at several offered loads and seeds.

    python bench/policy_goals.py --start-days 20,60 --days 2 --loads 0.5,1,1.5,2 --seeds 0,1
    python bench/policy_goals.py --max-jobs 600 --loads 1.5 --policies tiresias,meridian

Each window's arrivals are time-scaled by the load: at 2.0 the jobs arrive twice as fast as in
the trace (submit times halved), at 0.5 half as fast; 1.0 is the trace as recorded. All four
policies replay the same jobs; the table gives,
per (window, load, seed) and policy: goodput (GPUs of finished work per makespan second),
makespan, average / p99 JCT, SLA met per tier, mean JCT per tier, and the wall time.
Run from another checkout (e.g. `cd /work/main && python /work/wt/policy/bench/policy_goals.py`)
to get that checkout's Meridian: the script imports `scheduler` from the current directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.getcwd())

from scheduler.sim import make_policy  # noqa: E402
from scheduler.sim.engine import Engine  # noqa: E402
from scheduler.sim.fleet import by_name, philly  # noqa: E402
from scheduler.sim.trace import PHILLY_CSV, load_philly  # noqa: E402

# the sim's default (../shared next to the checkout); set MERIDIAN_PHILLY_TRACE from a worktree
DEFAULT_TRACE = PHILLY_CSV


def scaled_window(trace, start_day, days, max_jobs, load):
    """Returns the window with its arrivals `load` times as fast as recorded."""
    w = trace.window(start_day * 86400.0, start_day * 86400.0 + days * 86400.0 if days else None, max_jobs)
    return dataclasses.replace(w, submit=w.submit / load, name=f"{w.name} @ {load:g}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=os.environ.get("MERIDIAN_PHILLY_TRACE", str(DEFAULT_TRACE)))
    p.add_argument("--fleet", default="philly", help="philly, philly-full, planet-N or philly-<A>x8+<B>x2")
    p.add_argument("--start-days", default="20")
    p.add_argument("--days", type=float, default=2.0)
    p.add_argument("--max-jobs", type=int, default=None)
    p.add_argument("--loads", default="0.5,1,1.5,2")
    p.add_argument("--seeds", default="0")
    p.add_argument("--policies", default="fifo,tiresias,gandiva,meridian")
    args = p.parse_args(argv)
    if args.fleet.startswith("philly-") and "x8+" in args.fleet:  # philly-30x8+20x2: a smaller Philly
        eights, twos = args.fleet[len("philly-"):].split("+")
        fleet = philly(servers_8=int(eights.split("x")[0]), servers_2=int(twos.split("x")[0]))
    else:
        fleet = by_name(args.fleet)
    policies = [s for s in args.policies.split(",") if s]
    head = ("window", "load", "seed", "policy", "goodput", "makespan_d", "avgJCT_h", "p99JCT_h",
            "SLA_p", "SLA_s", "SLA_b", "JCT_p_h", "JCT_s_h", "JCT_b_h", "resize/job", "wall_s")
    print(" | ".join(head))
    for seed in [int(s) for s in args.seeds.split(",")]:
        trace = load_philly(args.trace, seed=seed)
        for start in [float(s) for s in args.start_days.split(",")]:
            for load in [float(s) for s in args.loads.split(",")]:
                w = scaled_window(trace, start, args.days, args.max_jobs, load)
                for name in policies:
                    began = time.perf_counter()
                    r = Engine(w, fleet, make_policy(name), tick_s=60.0, seed=seed).run()
                    s = r.summary()
                    row = (f"d{start:g}+{args.days:g}", f"{load:g}", str(seed), name,
                           f"{s['goodput_devices']:.1f}", f"{s['makespan_s'] / 86400:.2f}",
                           f"{s['avg_jct_s'] / 3600:.2f}", f"{s['p99_jct_s'] / 3600:.1f}",
                           f"{s['sla_premium']:.1%}", f"{s['sla_standard']:.1%}", f"{s['sla_basic']:.1%}",
                           f"{s['avg_jct_premium_s'] / 3600:.2f}", f"{s['avg_jct_standard_s'] / 3600:.2f}",
                           f"{s['avg_jct_basic_s'] / 3600:.2f}", f"{s['resizes_per_job']:.2f}",
                           f"{time.perf_counter() - began:.1f}")
                    print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
