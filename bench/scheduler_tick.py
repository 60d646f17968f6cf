"""How long one scheduling tick takes on synthetic fleets of 1k .. 1M accelerators.

    .venv/bin/python bench/scheduler_tick.py [--sizes 1000,10000,100000,1000000] [--trace PATH]
    .venv/bin/python bench/scheduler_tick.py --replay-days 2 [--replay-start 30]   # the simulator's calls

Each fleet has 8 accelerators per node, 4 nodes per rack, 32 racks per cluster, 8 clusters
per region, and two accelerator types (alternating by cluster). Per 100 accelerators it holds
15 running and 5 pending jobs (so 100k accelerators: 15k running, 5k pending), whose sizes
and durations are drawn from the Philly trace (env MERIDIAN_PHILLY_TRACE or --trace, default
../shared/traces/philly/philly_jobs.csv next to the repository). Running jobs are drawn with
probability proportional to duration (a job is running at a random instant in proportion to
how long it runs); pending ones in proportion to their count. If the file is absent, a
built-in histogram derived from it is used, and the output says so.

Rows: a "mixed" fleet as above (about half the devices busy: every pending job that fits
starts, elastic jobs grow: the most placement work), and a "contended" fleet (~98% busy:
pending Premium/Standard jobs shrink and preempt Basic ones: the victim-selection path).

Printed per row: accelerators, jobs running / pending, tick median ms over 5 ticks of the
same snapshot (wall clock, and CPU time of this process: on a shared machine the CPU time is
the steadier measure of "one core"), decisions per second, peak memory of one tick (tracemalloc), and at the end
the fitted exponent of tick time vs accelerators (1.0 = linear) for the mixed rows.
"""
from __future__ import annotations

import argparse
import csv
import os
import pathlib
import statistics
import sys
import time
import tracemalloc

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler import (  # noqa: E402
    BASIC,
    PREMIUM,
    RUNNING,
    STANDARD,
    Jobs,
    PolicySettings,
    Snapshot,
    Teams,
    schedule,
)
from scheduler.builders import synthetic_fleet  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "philly" / "philly_jobs.csv"

# Derived from philly_jobs.csv (82,247 jobs): per GPU count, how many jobs and the duration
# quantiles in seconds at 0, 10, 25, 50, 75, 90, 100 %. Used only when the file is absent.
BUILTIN_HISTOGRAM = {
    1: (76627, (1, 62, 122, 1117, 2716, 8512, 3256045)),
    2: (1818, (2, 11, 16, 21, 76, 72740, 2582803)),
    4: (1870, (3, 138, 773, 17410, 89394, 184435, 2750674)),
    8: (1643, (1, 216, 1876, 23683, 173248, 351982, 4628226)),
    12: (7, (289, 449, 561, 589, 1414, 2621, 4196)),
    16: (199, (2, 54, 384, 52548, 165483, 340974, 1710643)),
    24: (7, (265, 294, 320, 345, 554, 85732, 213302)),
    32: (67, (2, 816, 1182, 14262, 53209, 61700, 128924)),
    64: (6, (1, 2, 166, 1862, 3148, 15824, 28475)),
    128: (3, (4, 868, 2163, 4322, 5998, 7003, 7673)),
}
QUANTILES = (0.0, 0.10, 0.25, 0.50, 0.75, 0.90, 1.0)
TYPE_NAMES = ("H100-80GB", "A100-40GB")
NOW = 1_000_000_000.0


def load_trace(path: pathlib.Path | None):
    """Returns (sizes, durations, teams, source description)."""
    if path is not None and path.exists():
        sizes, durations, teams = [], [], []
        team_ids: dict[str, int] = {}
        with path.open() as f:
            for row in csv.DictReader(f):
                sizes.append(int(row["num_gpus"]))
                durations.append(max(float(row["duration"]), 1.0))
                teams.append(team_ids.setdefault(row["cluster"], len(team_ids)))
        return (np.asarray(sizes), np.asarray(durations), np.asarray(teams),
                f"Philly trace {path} ({len(sizes)} jobs)")
    rng = np.random.default_rng(0)
    sizes, durations = [], []
    for size, (count, quantiles) in BUILTIN_HISTOGRAM.items():
        u = rng.random(count)
        logd = np.interp(u, QUANTILES, np.log(np.maximum(quantiles, 1)))
        sizes.append(np.full(count, size))
        durations.append(np.exp(logd))
    sizes, durations = np.concatenate(sizes), np.concatenate(durations)
    teams = rng.integers(0, 15, sizes.size)
    return sizes, durations, teams, (f"BUILT-IN HISTOGRAM derived from the Philly trace "
                                     f"(file not found at {path})")


def build_snapshot(n_acc: int, trace, seed: int, busy: float | None) -> Snapshot:
    """Returns a snapshot of n_acc accelerators with 15% / 5% of n_acc running / pending jobs.

    busy=None: running jobs as drawn (about half the fleet busy); busy=0.98: running jobs are
    drawn until 98% of every type is held.
    """
    sizes, durations, trace_teams, _ = trace
    rng = np.random.default_rng(seed)
    acc = synthetic_fleet(n_acc, devices_per_node=8, nodes_per_rack=4, racks_per_cluster=32,
                          clusters_per_region=8, n_types=len(TYPE_NAMES))
    n_regions = int(acc.region.max()) + 1
    n_running, n_pending = int(n_acc * 0.15), int(n_acc * 0.05)

    if busy is None:
        pick_run = rng.choice(sizes.size, n_running, p=durations / durations.sum())
    else:
        # draw duration-weighted jobs until `busy` of the fleet is covered
        mean = float((sizes * durations).sum() / durations.sum())
        draw = rng.choice(sizes.size, int(busy * n_acc / mean * 1.3) + 16, p=durations / durations.sum())
        keep = np.cumsum(sizes[draw]) <= busy * n_acc
        pick_run = draw[keep]
        n_running = pick_run.size
    pick_pend = rng.choice(sizes.size, n_pending)
    picks = np.concatenate([pick_run, pick_pend])
    n_jobs = picks.size
    world = sizes[picks].astype(np.int64)
    region_capacity = np.bincount(acc.region, minlength=n_regions)
    world = np.minimum(world, int(region_capacity.min() // len(TYPE_NAMES)))
    team = trace_teams[picks] % 15
    tier = rng.choice([PREMIUM, STANDARD, BASIC], n_jobs, p=[0.15, 0.35, 0.50])
    elastic = (world >= 2) & (rng.random(n_jobs) < 0.5)
    min_devices = np.where(elastic, np.maximum(world // 4, 1), world)
    type_id = rng.integers(0, len(TYPE_NAMES), n_jobs)
    state = np.zeros(n_jobs, np.int8)
    state[:n_running] = RUNNING

    # running jobs: elastic ones at W or W/2; packed into random regions of their type with
    # random gaps, never across a region
    current = world[:n_running].copy()
    halve = (
        (busy is None)
        & elastic[:n_running]
        & (rng.random(n_running) < 0.5)
        & (world[:n_running] // 2 >= min_devices[:n_running])
    )
    current[halve] //= 2
    holder = np.full(n_acc, -1, np.int32)
    acc_type = acc.type_id.astype(np.int64)
    acc_region = acc.region.astype(np.int64)
    for k in range(len(TYPE_NAMES)):
        devices_k = np.flatnonzero(acc_type == k)
        region_of = acc_region[devices_k]
        regions = np.unique(region_of)
        jobs_k = np.flatnonzero(type_id[:n_running] == k)
        cap = np.array([np.count_nonzero(region_of == r) for r in regions])
        target = rng.choice(regions.size, jobs_k.size, p=cap / cap.sum())
        for ri, r in enumerate(regions):
            mine = jobs_k[target == ri]
            devs_r = devices_k[region_of == r]
            size = current[mine]
            over = np.cumsum(size) > devs_r.size
            if over.any():  # the region is full: these jobs stay pending instead
                state[mine[over]] = 0
                mine, size = mine[~over], size[~over]
            spare = devs_r.size - int(size.sum())
            gaps = rng.multinomial(spare, np.full(mine.size + 1, 1.0 / (mine.size + 1))) if mine.size else []
            if mine.size == 0:
                continue
            starts = np.cumsum(gaps[:-1]) + np.cumsum(size) - size
            holder[devs_r[np.repeat(starts, size) + _ranges(size)]] = np.repeat(mine, size)
    run_devices = np.bincount(holder[holder >= 0], minlength=n_jobs)
    state[(state == RUNNING) & (run_devices == 0)] = 0

    duration = durations[picks]
    started = NOW - rng.random(n_jobs) * np.minimum(duration, 86400.0)
    submit = np.where(state == RUNNING, started - rng.random(n_jobs) * 600.0, NOW - rng.random(n_jobs) * 3600.0)
    ideal = (NOW - submit) * world
    attained = ideal * rng.uniform(0.5, 1.0, n_jobs)
    last_ckpt = np.where(state == RUNNING, NOW - rng.random(n_jobs) * 1800.0, -np.inf)
    jobs = Jobs(ids=np.arange(1, n_jobs + 1), team=team, tier=tier, type_id=type_id, world_size=world,
                min_devices=min_devices, state=state, submit_time=submit,
                attained_device_seconds=attained, ideal_device_seconds=ideal,
                last_checkpoint_time=last_ckpt, last_checkpoint_step=(NOW - submit).astype(np.int64) // 10,
                checkpoint_bytes=world * 2_000_000_000, last_start_time=np.where(state == RUNNING, started, -np.inf))
    acc = acc.replace(holder=holder)
    # quotas: each team gets its share of the fleet by job count, x1.2; some will borrow
    per_team = np.bincount(team, minlength=15).astype(np.float64)
    type_cap = np.bincount(acc.type_id, minlength=len(TYPE_NAMES))
    quota = np.outer(per_team / per_team.sum() * 1.2, type_cap).astype(np.int64)
    teams = Teams(names=[f"team-{i}" for i in range(15)], quota=quota)
    return Snapshot(accelerators=acc, jobs=jobs, teams=teams, now=NOW, type_names=TYPE_NAMES,
                    settings=PolicySettings())


def _ranges(size: np.ndarray) -> np.ndarray:
    """Returns concatenated aranges: [0..size0-1, 0..size1-1, ...]."""
    ends = np.cumsum(size)
    return np.arange(ends[-1]) - np.repeat(ends - size, size)


def measure(snapshot: Snapshot, repeats: int = 5):
    """Returns (median wall s, median CPU s, plan, peak traced bytes, median seconds per phase)."""
    walls, cpus, phases, plan = [], [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = schedule(snapshot, timer=time.perf_counter)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        phases.append(plan.phase_seconds)
    tracemalloc.start()
    schedule(snapshot)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    names = sorted({name for p in phases for name in p})
    phase_median = {name: statistics.median(p.get(name, 0.0) for p in phases) for name in names}
    return statistics.median(walls), statistics.median(cpus), plan, peak, phase_median


def replay(trace_path: pathlib.Path, start_day: float, days: float, max_calls: int = 4000) -> int:
    """Times the core on the snapshots of a Philly replay slice (the simulator's real calls).

    Runs the simulator's Meridian policy on the window, keeps every snapshot it hands to
    `scheduler.schedule`, then re-times `schedule` on each (3 rounds, the fastest per call, CPU
    time of this process) and prints calls, CPU ms per call (mean / median / p99) and the
    median of phase "1. snapshot" (building the working state). Every call after the first
    sees the same fleet, as in the simulator and in a control-loop worker.
    """
    import scheduler as core
    from scheduler.sim import fleet as sim_fleet
    from scheduler.sim.engine import Engine
    from scheduler.sim.meridian import Meridian
    from scheduler.sim.trace import load_philly

    trace = load_philly(trace_path).window(start_day * 86400.0, (start_day + days) * 86400.0)
    snapshots, real = [], core.schedule

    def recording(snapshot, policy=None, **kw):
        if len(snapshots) < max_calls:
            snapshots.append(snapshot)
        return real(snapshot, policy, **kw)

    core.schedule = recording
    try:
        Engine(trace, sim_fleet.philly(), Meridian(), tick_s=60.0).run()
    finally:
        core.schedule = real
    from scheduler import state as core_state

    forget = getattr(core_state, "forget_topology", lambda: None)  # absent before the memo
    policy = core.Policy.default()
    # variants, interleaved call by call: "warm" = the fleet layout remembered from the call
    # before (what the simulator and a control-loop worker see), "cold" = forgotten before
    # every call (the working state built from scratch, as before the memo)
    best = {"cold": np.full(len(snapshots), np.inf), "warm": np.full(len(snapshots), np.inf)}
    first_phase = {"cold": np.zeros(len(snapshots)), "warm": np.zeros(len(snapshots))}
    for _ in range(3):
        for i, snap in enumerate(snapshots):
            for variant in ("cold", "warm"):
                if variant == "cold":
                    forget()
                c0 = time.process_time()
                plan = real(snap, policy, timer=time.perf_counter)
                best[variant][i] = min(best[variant][i], time.process_time() - c0)
                first_phase[variant][i] = plan.phase_seconds.get("1. snapshot", 0.0)
    load = os.getloadavg()
    print(f"Philly replay days {start_day:g}-{start_day + days:g}: {len(trace)} jobs, {len(snapshots)} core calls; "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print(f"{'variant':<8} {'calls':>6} {'cpu s':>7} {'mean ms':>8} {'median ms':>10} {'p99 ms':>7} "
          f"{'1. snapshot ms':>15}")
    for variant in ("cold", "warm"):
        b = best[variant]
        print(f"{variant:<8} {len(snapshots):>6} {b.sum():>7.2f} {b.mean() * 1e3:>8.3f} {np.median(b) * 1e3:>10.3f} "
              f"{np.percentile(b, 99) * 1e3:>7.3f} {np.median(first_phase[variant]) * 1e3:>15.3f}")
    print(f"warm / cold CPU: {best['warm'].sum() / best['cold'].sum():.2f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000",
                        help="comma-separated accelerator counts")
    parser.add_argument("--trace", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("MERIDIAN_PHILLY_TRACE", DEFAULT_TRACE)))
    parser.add_argument("--no-contended", action="store_true", help="skip the ~98%%-busy rows")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--replay-days", type=float, default=0.0,
                        help="instead: time the core on the snapshots of a Philly replay of this many days")
    parser.add_argument("--replay-start", type=float, default=30.0, help="replay window start day (30)")
    args = parser.parse_args(argv)
    if args.replay_days > 0:
        return replay(args.trace, args.replay_start, args.replay_days)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    trace = load_trace(args.trace)
    print(f"job mix: {trace[3]}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, one core, median of 5 ticks\n")
    header = (f"{'fleet':<10} {'accelerators':>12} {'running':>8} {'pending':>8} {'tick ms':>9} {'cpu ms':>8} "
              f"{'busy':>5} {'decisions':>9} {'decisions/s':>11} {'peak MiB':>9}  plan")
    print(header)
    print("-" * len(header))
    fit_x, fit_y, fit_cpu, phase_rows = [], [], [], []
    for n in sizes:
        for label, busy in (("mixed", None), ("contended", 0.98)):
            if busy is not None and args.no_contended:
                continue
            snap = build_snapshot(n, trace, args.seed, busy)
            running = int((snap.jobs.state == RUNNING).sum())
            pending = len(snap.jobs) - running
            busy_pct = 100.0 * np.count_nonzero(snap.accelerators.holder >= 0) / n
            median, cpu, plan, peak, phase_median = measure(snap)
            summary = plan.summary()
            decisions = len(plan.decisions)
            print(f"{label:<10} {n:>12,} {running:>8,} {pending:>8,} {median * 1000:>9.1f} {cpu * 1000:>8.1f} "
                  f"{busy_pct:>4.0f}% {decisions:>9,} "
                  f"{decisions / median:>11,.0f} {peak / 2**20:>9.1f}  "
                  + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
            phase_rows.append((label, n, phase_median))
            if busy is None:
                fit_x.append(np.log(n))
                fit_y.append(np.log(median))
                fit_cpu.append(np.log(cpu))
    print("\nmedian ms per phase (Plan.phase_seconds; 4 and 6 run inline for the head of the line):")
    for label, n, phase_median in phase_rows:
        print(f"  {label:<10} {n:>10,}  " + "  ".join(f"{k} {v * 1000:.0f}" for k, v in phase_median.items()))
    if len(fit_x) >= 2:
        slope = np.polyfit(fit_x, fit_y, 1)[0]
        slope_cpu = np.polyfit(fit_x, fit_cpu, 1)[0]
        print(f"\nfitted exponent of tick time vs accelerators (mixed rows): wall {slope:.2f}, "
              f"cpu {slope_cpu:.2f} (1.0 = linear)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
