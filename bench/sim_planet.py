"""Planet-scale simulator run: a synthetic trace drawn from the Philly size/duration
distribution on a synthetic fleet; prints progress lines and a table with the wall time.

    nice .venv/bin/python bench/sim_planet.py --jobs 1000000 --devices 100000 --policies fifo,meridian

Speed is measured here, not in tests. Wall times depend on what else the machine runs: run
it alone for clean numbers (the table also reports the process CPU time).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler.sim import fleet as fleet_module  # noqa: E402
from scheduler.sim import make_policy  # noqa: E402
from scheduler.sim.engine import Engine  # noqa: E402
from scheduler.sim.metrics import format_table  # noqa: E402
from scheduler.sim.trace import synthetic  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=1_000_000)
    p.add_argument("--devices", type=int, default=100_000)
    p.add_argument("--load", type=float, default=0.8, help="offered load, a fraction of the fleet (0.8)")
    p.add_argument("--mix", default="philly", help="synthetic mix (scheduler/sim/trace.py SYNTHETIC_MIXES)")
    p.add_argument("--policies", default="fifo,meridian")
    p.add_argument("--tick", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    fleet = fleet_module.planet(args.devices)
    t0 = time.perf_counter()
    trace = synthetic(args.jobs, fleet.n_devices, load=args.load, seed=args.seed, mix=args.mix)
    print(f"trace {trace.name}: {len(trace)} jobs over {trace.submit[-1] / 86400:.1f} days, built in "
          f"{time.perf_counter() - t0:.1f} s; fleet {fleet.name}: {fleet.n_devices} devices, "
          f"{fleet.n_nodes} nodes; tick {args.tick:g} s", flush=True)
    rows = []
    for name in args.policies.split(","):
        policy = make_policy(name)
        cpu0 = time.process_time()
        engine = Engine(trace, fleet, policy, tick_s=args.tick, seed=args.seed,
                        progress=lambda line: print(line, flush=True), progress_every_s=60.0)
        result = engine.run()
        s = result.summary()
        s["cpu_s"] = time.process_time() - cpu0
        if name == "meridian":
            s["core_calls"], s["core_s"] = policy.plans, policy.core_seconds
        print(f"{name}: wall {result.wall_s:.0f} s, cpu {s['cpu_s']:.0f} s, passes {result.passes}, "
              f"finished {s['finished']}/{s['jobs']}" +
              (f", core calls {policy.plans} ({policy.core_seconds:.0f} s)" if name == "meridian" else ""),
              flush=True)
        rows.append(s)
    print(format_table(rows))


if __name__ == "__main__":
    main()
