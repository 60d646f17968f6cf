"""Command line: replay a trace under several policies, print a table, write an HTML report.

    python -m scheduler.sim                                   # full Philly, all four policies
    python -m scheduler.sim --days 7 --start-day 20 --policies fifo,meridian --report r.html
    python -m scheduler.sim --synthetic 1000000 --fleet planet-100000 --policies fifo
    python -m scheduler.sim --days 7 --load 0.5,1.0,1.5,2.0          # offered loads: arrivals time-scaled
    python -m scheduler.sim --synthetic 5000 --mix multinode --load 1,2 --seed 3

`--load` scales arrival times (submit / load) of whatever trace is replayed, after the window is
cut: 2.0 offers the window's jobs twice as fast. A synthetic trace is first generated at
`--synthetic-load` (a fraction of the fleet; 0.67 by default, Philly's own average on the
default fleet, so 1.0x means as busy as Philly) and then scaled the same way.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

from . import POLICY_NAMES, make_policy
from .costs import CostModel
from .engine import Engine
from .fidelity import ApprovalModel, FidelityError, StartupCosts
from .fleet import FleetError, by_name
from .metrics import format_table
from .trace import PHILLY_CSV, SYNTHETIC_MIXES, TraceError, load_philly, synthetic


def build_parser():
    p = argparse.ArgumentParser(prog="python -m scheduler.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=os.environ.get("MERIDIAN_PHILLY_TRACE", str(PHILLY_CSV)),
                   help="Philly-format CSV (default: ../shared/traces/philly/philly_jobs.csv "
                        "or $MERIDIAN_PHILLY_TRACE)")
    p.add_argument("--synthetic", type=int, metavar="JOBS",
                   help="replay a seeded synthetic trace of JOBS jobs (see --mix)")
    p.add_argument("--mix", default="philly", choices=sorted(SYNTHETIC_MIXES),
                   help="the synthetic trace's size/duration/tier mix (philly: resampled Philly jobs); "
                        "distributions in scheduler/sim/trace.py")
    p.add_argument("--synthetic-load", type=float, default=SYNTHETIC_BASE_LOAD,
                   help="the synthetic trace's offered load before --load, as a fraction of the fleet "
                        f"({SYNTHETIC_BASE_LOAD:g}, Philly's average on the default fleet)")
    p.add_argument("--load", type=parse_loads, default=(1.0,), metavar="L[,L...]",
                   help="offered loads: arrivals time-scaled by each (e.g. 0.5,1.0,1.5,2.0); "
                        "every policy runs at every load (1.0)")
    p.add_argument("--fleet", default="philly",
                   help="philly (default), philly-hetero (three accelerator types; jobs draw a type), "
                        "philly-full, planet-<devices>")
    p.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help=f"comma-separated, from {','.join(POLICY_NAMES)}")
    p.add_argument("--start-day", type=float, default=None, help="window start, days from the trace start")
    p.add_argument("--days", type=float, default=None, help="window length in days")
    p.add_argument("--max-jobs", type=int, default=None, help="keep only the first N jobs of the window")
    p.add_argument("--tick", type=float, default=60.0, help="scheduling interval in seconds (60)")
    p.add_argument("--seed", type=int, default=0, help="seeds tiers, checkpoint sizes, failures (0)")
    p.add_argument("--failures-mtbf-days", type=float, default=None,
                   help="enable node failures: mean days between failures per node")
    p.add_argument("--repair-hours", type=float, default=1.0, help="node repair time (1 h)")
    p.add_argument("--splice-efficiency", type=float, default=None)
    p.add_argument("--spread-efficiency", type=float, default=None)
    p.add_argument("--premium-reserve", type=int, default=0, metavar="DEVICES",
                   help="Meridian: PolicySettings.premium_reserve_devices, idle devices per region "
                        "that only Premium jobs may take (0)")
    p.add_argument("--startup", default="default", metavar="SPEC",
                   help="start-up of a job's first allocation per job class: default (single=75,node=105,"
                        "multinode=165 s), none, or single=S,node=S,multinode=S (scheduler/sim/fidelity.py)")
    p.add_argument("--approvals", default="exp:900", metavar="DELAY",
                   help="how capacity managers answer approval requests: never, fixed:S, exp:MEAN or "
                        "lognormal:MEDIAN,SIGMA seconds (exp:900)")
    p.add_argument("--approval-denial-rate", type=float, default=0.1,
                   help="share of approval requests denied (0.1)")
    p.add_argument("--report", metavar="HTML", help="write the Plotly report here")
    p.add_argument("--json", metavar="PATH", help="write the summaries as JSON here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--jobs-csv", metavar="PATH", help="write one row per job and policy here")
    p.add_argument("--progress", type=float, default=None, metavar="SECONDS",
                   help="print a progress line to stderr every SECONDS of wall time")
    return p


# Philly's 82,247 jobs keep 374 GPUs busy on average; the default fleet has 560 (fleet.py).
SYNTHETIC_BASE_LOAD = 0.67


def parse_loads(text):
    """Returns the offered loads of a comma-separated list (each > 0); argparse reports the error."""
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--load takes numbers separated by commas, got {text!r}") from None
    if not loads or any(not (0 < x < float("inf")) for x in loads):
        raise argparse.ArgumentTypeError(f"every offered load must be a positive number, got {text!r}")
    return loads


def write_jobs_csv(results, path):
    """Writes policy, job, tier, ranks, submit, first_start, finish, duration and the counts
    of preemptions, migrations, resizes and failure restarts, one row per job and policy."""
    import csv

    with open(path, "w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["load", "policy", "job", "tier", "ranks", "submit", "first_start", "finish", "duration",
                      "preemptions", "migrations", "resizes", "failures"])
        for r in results:
            for j in range(r.submit.shape[0]):
                out.writerow([f"{r.load:g}", r.policy, j, int(r.tier[j]), int(r.ranks[j]), f"{r.submit[j]:.1f}",
                              f"{r.first_start[j]:.1f}", f"{r.finish[j]:.1f}", f"{r.duration[j]:.1f}",
                              int(r.n_preempt[j]), int(r.n_migrate[j]), int(r.n_resize[j]), int(r.n_fail[j])])


def run_policy(trace, fleet, name, costs, args):
    """Runs one policy on the trace; prints its one-line account; returns (SimResult, summary)."""
    options = {}
    if name == "meridian" and args.premium_reserve:
        from scheduler.snapshot import PolicySettings

        options["settings"] = PolicySettings(premium_reserve_devices=args.premium_reserve)
    policy = make_policy(name, **options)
    progress = None
    if args.progress:
        progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = Engine(trace, fleet, policy, costs=costs, tick_s=args.tick, seed=args.seed,
                    progress=progress, progress_every_s=args.progress or 60.0,
                    startup=args.startup_costs, approvals=args.approval_model).run()
    summary = result.summary()
    extra = ""
    if name == "meridian":
        summary["core_calls"] = policy.plans
        summary["core_s"] = policy.core_seconds
        summary["approval_requests"] = policy.approval_requests
        a = result.approvals
        extra = (f", core called {policy.plans} times ({policy.core_seconds:.1f} s), "
                 f"{a['requests']} approval requests ({a['granted']} granted, {a['denied']} denied, "
                 f"{a['dropped']} answered after the run ended)")
    print(f"  {name}: {result.wall_s:.1f} s wall, {result.cpu_s:.1f} s CPU, {result.passes} passes, "
          f"{result.decisions} decisions, {result.failures} node failures{extra}", flush=True)
    for j, reason in result.rejections[:5]:
        print(f"    rejected job {j}: {reason}", flush=True)
    if len(result.rejections) > 5:
        print(f"    ... {len(result.rejections) - 5} more jobs rejected: they can never fit the fleet", flush=True)
    if result.stranded.any():
        print(f"    {int(result.stranded.sum())} jobs stranded: the fleet was whole and idle and the policy "
              f"started none of them (first: job {int(result.stranded.argmax())})", flush=True)
    return result, summary


def main(argv=None):
    args = build_parser().parse_args(argv)
    command = "python -m scheduler.sim " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    try:
        fleet = by_name(args.fleet)
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        for n in names:
            if n not in POLICY_NAMES:
                raise ValueError(f"unknown policy {n!r}; choose from {', '.join(POLICY_NAMES)}")
        started = time.perf_counter()
        if args.synthetic:
            trace = synthetic(args.synthetic, fleet.n_devices, load=args.synthetic_load, seed=args.seed,
                              mix=args.mix)
        else:
            trace = load_philly(args.trace, seed=args.seed)
        if args.start_day is not None or args.days is not None or args.max_jobs is not None:
            start = (args.start_day or 0.0) * 86400.0
            end = start + args.days * 86400.0 if args.days is not None else None
            trace = trace.window(start, end, args.max_jobs)
        load_s = time.perf_counter() - started
        changes = {}
        if args.failures_mtbf_days:
            changes["node_mtbf_s"] = args.failures_mtbf_days * 86400.0
        changes["node_repair_s"] = args.repair_hours * 3600.0
        if args.splice_efficiency is not None:
            changes["splice_efficiency"] = args.splice_efficiency
        if args.spread_efficiency is not None:
            changes["spread_efficiency"] = args.spread_efficiency
        costs = dataclasses.replace(CostModel(), **changes)
        args.startup_costs = StartupCosts.parse(args.startup)
        args.approval_model = ApprovalModel(delay=args.approvals, denial_rate=args.approval_denial_rate)
        if len(fleet.type_names) > 1 and not trace.type_names:
            trace = trace.with_types(fleet, args.seed)
        if args.premium_reserve < 0:
            raise ValueError("--premium-reserve must be >= 0")
    except (TraceError, FleetError, FidelityError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    print(f"trace {trace.name}: {len(trace)} jobs, {trace.gpu_seconds / 3600:.0f} GPU-hours, "
          f"loaded in {load_s:.1f} s; fleet {fleet.name}: {fleet.n_devices} devices on "
          f"{fleet.n_nodes} nodes; tick {args.tick:g} s; seed {args.seed}", flush=True)
    results, summaries = [], []
    for load in args.load:
        scaled = trace.scaled(load)
        if len(args.load) > 1 or load != 1.0:
            print(f"offered load {load:g}x: {scaled.name}", flush=True)
        for name in names:
            result, summary = run_policy(scaled, fleet, name, costs, args)
            result.load = load
            summary["load"] = load
            results.append(result)
            summaries.append(summary)
    print()
    print(format_table(summaries, markdown=args.markdown))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": command, "trace": trace.name, "fleet": fleet.name,
                       "devices": fleet.n_devices, "loads": list(args.load), "summaries": summaries}, handle, indent=1)
    if args.jobs_csv:
        write_jobs_csv(results, args.jobs_csv)
    if args.report:
        from .report import write_report

        path = write_report(results, args.report, title=f"Meridian simulator: {trace.name} on {fleet.name}",
                            command=command)
        print(f"\nreport written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
