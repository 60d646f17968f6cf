"""Issue 16's goals table: Philly windows and synthetic mixes at 0.5x-2.0x offered load, several
seeds, all four policies; one row per goal, workload and load (Meridian's value, the best
baseline's, whether the goal holds in every seed). Rules: scheduler/sim/goals.py.

    nice .venv/bin/python bench/sim_goals.py --quick              # minutes: a fifth of Philly, 4 seeds
    nice .venv/bin/python bench/sim_goals.py                      # hours: 3 three-week windows + 3 mixes, 3 seeds
    nice .venv/bin/python bench/sim_goals.py --quick --full-trace # also goal 4's full-Philly wall time
    nice .venv/bin/python bench/sim_goals.py --quick --markdown --json goals.json

Seeded and re-runnable: the same command gives the same table (wall times aside). Wall times
depend on what else the machine runs; the speed row also reports CPU time.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler.sim import goals  # noqa: E402
from scheduler.sim.fleet import by_name  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small grid (a few minutes)")
    p.add_argument("--full-trace", action="store_true", help="also replay full Philly under Meridian (goal 4)")
    p.add_argument("--fleet", default=None, help="replace the grid's fleet (quick: a fifth of Philly; full: philly)")
    p.add_argument("--trace", default=os.environ.get("MERIDIAN_PHILLY_TRACE"), help="Philly CSV")
    p.add_argument("--loads", default=None, help="override the grid's loads, e.g. 1,2")
    p.add_argument("--seeds", default=None, help="override the grid's seeds, e.g. 0")
    p.add_argument("--workloads", default=None,
                   help="keep only the grid's workloads whose name contains one of these (comma-separated)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--rows-from", metavar="JSON", help="judge the runs saved by an earlier --json again (no replay)")
    p.add_argument("--baselines-from", metavar="JSON",
                   help="reuse the baselines of an earlier --json run; replay only Meridian (core changes)")
    p.add_argument("--json", metavar="PATH", help="write the rows and every run's summary here")
    args = p.parse_args(argv)
    fleet, workloads, loads, seeds = goals.quick_grid() if args.quick else goals.full_grid()
    if args.fleet:
        fleet = by_name(args.fleet)
    if args.loads:
        loads = tuple(float(x) for x in args.loads.split(","))
    if args.seeds:
        seeds = tuple(int(x) for x in args.seeds.split(","))
    if args.workloads:
        keep = [w.strip() for w in args.workloads.split(",")]
        workloads = [w for w in workloads if any(k in w.name for k in keep)]
    began = time.perf_counter()
    if args.rows_from:
        with open(args.rows_from) as handle:
            saved = json.load(handle)
        runs = [(r["workload"], r["load"], r["seed"], r["summaries"], r["premium_fits"]) for r in saved["runs"]]
        print(f"runs of: {saved['command']}")
        print(goals.format_rows(goals.rows_from_runs(runs), markdown=args.markdown))
        return 0
    print(f"fleet {fleet.name} ({fleet.n_devices} devices); loads {', '.join(f'{x:g}' for x in loads)}; "
          f"seeds {', '.join(map(str, seeds))}; workloads: {'; '.join(w.name for w in workloads)}", flush=True)
    stored = None
    if args.baselines_from:
        with open(args.baselines_from) as handle:
            stored = {(r["workload"], float(r["load"]), int(r["seed"])): r["summaries"]
                      for r in json.load(handle)["runs"]}
    rows, runs = goals.measure(fleet, workloads, loads, seeds, philly_path=args.trace, stored=stored,
                               progress=lambda line: print("  " + line, file=sys.stderr, flush=True))
    if args.full_trace:
        rows.append(goals.speed_row(by_name("philly"), philly_path=args.trace))
    else:
        rows.append(goals.Row("4 full Philly under Meridian < 300 s wall", "philly (82,247 jobs)", "1x",
                              "not run (add --full-trace)", "-", "not measured"))
    print()
    print(goals.format_rows(rows, markdown=args.markdown))
    held = sum(r.holds == "yes" for r in rows)
    print(f"\n{held} of {len(rows)} rows hold; {time.perf_counter() - began:.0f} s wall in all")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": " ".join(["bench/sim_goals.py"] + (argv if argv is not None else sys.argv[1:])),
                       "rows": [r.__dict__ for r in rows],
                       "runs": [{"workload": w, "load": load, "seed": seed, "summaries": cell, "premium_fits": fits}
                                for w, load, seed, cell, fits in runs]}, handle, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
