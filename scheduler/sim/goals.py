"""Issue 16's goals, measured: replay workloads at several offered loads and seeds under all
four policies and say, per goal, workload and load, whether Meridian meets it.

`bench/sim_goals.py` is the command; this module holds the workloads and the rules so that a
test can run a small seeded grid. Rules (a goal holds for a workload and load only if it holds
in every seed; the values shown are means over the seeds):

  1 goodput    Meridian's goodput (GPUs of finished work per makespan second) >= every baseline's
  1 makespan   Meridian's makespan <= every baseline's
  2 avg JCT    Meridian's average JCT <= Tiresias'
  2 p99 JCT    Meridian's p99 JCT <= every baseline's
  3 Premium    Premium SLA met for >= 99% of Premium jobs, judged only where Premium demand
               alone fits the fleet (at no instant do the Premium jobs, each running at W from
               its submission for its duration, ask for more devices than the fleet has)
  3 Standard   Standard SLA met for >= 95% of Standard jobs
  3 tiers      no tier inversion: Premium <= Standard <= Basic in mean time lost to scheduling
               (JCT - run time alone - start-up: queueing, pauses, slowdowns), with one
               scheduling tick (60 s) of slack: differences below a tick are rounding.
               Mean JCT per tier (shown too) compares different job populations: with
               seeded random tiers and heavy-tailed durations a few long jobs decide it, so
               the order is judged on the time each job lost
  4 terminates every policy's replay ended with every job finished or rejected (none stranded)
  4 speed      the full Philly trace replays under Meridian in < 300 s of wall time (full mode)

"Best baseline" is the best of FIFO, Tiresias and Gandiva for that metric (Tiresias alone for
the average JCT). Every replay charges the start-up and answers approvals with the simulator's
default models (fidelity.py).
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from . import make_policy
from .engine import Engine
from .fidelity import ApprovalModel, StartupCosts
from .fleet import philly
from .trace import PREMIUM, load_philly, synthetic

BASELINES = ("fifo", "tiresias", "gandiva")
POLICIES = BASELINES + ("meridian",)
FULL_PHILLY_BUDGET_S = 300.0
TICK_S = 60.0
MIXES = ("heavy-tail", "multinode", "premium-heavy")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A trace recipe: `kind` 'philly' (a window: start day, days, max jobs; None days = the
    whole trace) or a synthetic mix name (n_jobs)."""

    name: str
    kind: str
    start_day: float = 0.0
    days: float | None = None
    max_jobs: int | None = None
    n_jobs: int = 0
    stride: int = 1  # Philly: keep every stride-th job of the window (Trace.every)

    def build(self, fleet, seed, philly_path=None, cache=None):
        """Returns the workload's trace for `seed` (at load 1)."""
        if self.kind == "philly":
            cache = {} if cache is None else cache
            key = (philly_path, seed)
            if key not in cache:
                cache[key] = load_philly(philly_path, seed=seed) if philly_path else load_philly(seed=seed)
            trace = cache[key]
            if self.days is not None or self.start_day:
                end = (self.start_day + self.days) * 86400.0 if self.days is not None else None
                trace = trace.window(self.start_day * 86400.0, end)
            trace = trace.every(self.stride)
            if self.max_jobs is not None and self.max_jobs < len(trace):
                trace = trace.subset(np.arange(self.max_jobs), f"{trace.name}[{self.max_jobs} jobs]")
            return trace
        # Synthetic mixes are generated as busy as Philly on the default fleet (0.67), then scaled.
        return synthetic(self.n_jobs, fleet.n_devices, load=0.67, seed=seed, mix=self.kind)


def quick_grid():
    """Returns (fleet, workloads, loads, seeds) of the --quick mode (3 minutes on an idle core):
    a fifth of Philly (12 8-GPU + 8 2-GPU servers, 112 GPUs) fed every 5th job of a Philly
    week (the same size/duration/burst mix at a fifth of the rate, so as contended as the full
    replay), and synthetic mixes generated for that fleet (sized to span a few days)."""
    fleet = philly(servers_8=12, servers_2=8, name="philly-fifth-12x8+8x2")
    workloads = [Workload("philly d20+7 every 5th", "philly", start_day=20.0, days=7.0, stride=5)]
    workloads += [Workload(f"{mix} {n} jobs", mix, n_jobs=n) for mix, n in zip(MIXES, (1000, 400, 1500))]
    # seeds 0 and 1 are the ones rounds 1-3 of the policy were measured on; 2 and 3 it never saw
    # until session 14 (2026-12-03), which found 84 rows holding on them where 0 and 1 gave 95
    return fleet, workloads, (0.5, 1.0, 1.5, 2.0), (0, 1, 2, 3)


def full_grid():
    """Returns (fleet, workloads, loads, seeds) of the full mode (hours on this machine): the
    560-GPU Philly fleet, three 3-week Philly windows, 5,000-job mixes, three seeds."""
    workloads = [Workload(f"philly d{d:g}+21", "philly", start_day=float(d), days=21.0) for d in (10, 40, 70)]
    workloads += [Workload(f"{mix} 5000 jobs", mix, n_jobs=5000) for mix in MIXES]
    return philly(), workloads, (0.5, 1.0, 1.5, 2.0), (0, 1, 2)


def premium_demand_fits(trace, n_devices):
    """Returns whether the Premium jobs alone, each at W from submission for its duration, never
    ask for more than n_devices at once."""
    mask = trace.tier == PREMIUM
    if not mask.any():
        return True
    start, end, w = trace.submit[mask], trace.submit[mask] + trace.duration[mask], trace.ranks[mask]
    times = np.concatenate([start, end])
    delta = np.concatenate([w, -w]).astype(np.int64)
    order = np.lexsort((delta, times))  # at a tie, ends (negative) first
    return bool(np.cumsum(delta[order]).max() <= n_devices)


def run_cell(trace, fleet, seed, policies=POLICIES, tick_s=TICK_S):
    """Returns {policy: summary} for one (workload, load, seed); each summary also carries
    'wall_s', 'cpu_s' and 'terminated' (every job finished or rejected)."""
    out = {}
    for name in policies:
        result = Engine(trace, fleet, make_policy(name), tick_s=tick_s, seed=seed,
                        startup=StartupCosts(), approvals=ApprovalModel()).run()
        s = result.summary()
        s["terminated"] = s["finished"] + s["rejected"] == s["jobs"] and s["stranded"] == 0
        out[name] = s
    return out


@dataclasses.dataclass
class Row:
    goal: str
    workload: str
    load: str
    meridian: str
    best_baseline: str
    holds: str


def _fmt_h(x):
    return f"{x / 3600:.2f} h"


def _judge(cells, meridian_value, baseline_value, better, fmt):
    """Returns (meridian text, best-baseline text, holds text) over the seeds' cells."""
    ok = []
    m_vals, b_vals = [], []
    for cell in cells:
        m, b = meridian_value(cell), baseline_value(cell)
        m_vals.append(m)
        b_vals.append(b)
        ok.append(better(m, b))
    holds = "yes" if all(ok) else f"no ({sum(ok)}/{len(ok)} seeds)"
    return fmt(float(np.mean(m_vals))), fmt(float(np.mean(b_vals))), holds


def goal_rows(workload, load, cells, premium_fits):
    """Returns the Rows of goals 1-4 for one workload and load; `cells` = one run_cell dict per
    seed; `premium_fits` = one bool per seed."""
    load_s = f"{load:g}x"
    rows = []

    def add(goal, judged):
        rows.append(Row(goal, workload, load_s, *judged))

    def best(key, pick):
        return lambda c: pick(c[b][key] for b in BASELINES if b in c)

    add("1 goodput >= every baseline", _judge(cells, lambda c: c["meridian"]["goodput_devices"],
                                              best("goodput_devices", max), lambda m, b: m >= b,
                                              lambda x: f"{x:.1f} GPUs"))
    add("1 makespan <= every baseline", _judge(cells, lambda c: c["meridian"]["makespan_s"],
                                               best("makespan_s", min), lambda m, b: m <= b,
                                               lambda x: f"{x / 86400:.2f} d"))
    add("2 avg JCT <= Tiresias", _judge(cells, lambda c: c["meridian"]["avg_jct_s"],
                                        lambda c: c["tiresias"]["avg_jct_s"], lambda m, b: m <= b, _fmt_h))
    add("2 p99 JCT <= every baseline", _judge(cells, lambda c: c["meridian"]["p99_jct_s"],
                                              best("p99_jct_s", min), lambda m, b: m <= b, _fmt_h))
    fitting = [c for c, fits in zip(cells, premium_fits) if fits]
    if fitting:
        add("3 Premium SLA >= 99%", _judge(fitting, lambda c: _nan0(c["meridian"]["sla_premium"]),
                                           best("sla_premium", _nanmax), lambda m, b: m >= 0.99,
                                           lambda x: f"{x:.1%}"))
        # The same attainment with the clock started at the placement decision (a wait for a
        # victim's checkpoint counted against the job): kept beside the goal's value, not judged.
        placed = [c["meridian"].get("sla_premium_from_placement") for c in fitting]
        if all(v is not None for v in placed):
            rows[-1].meridian += f" ({np.nanmean(np.array(placed, float)):.1%} from placement)"
        if len(fitting) < len(cells):
            rows[-1].holds += f" (judged on {len(fitting)}/{len(cells)} seeds)"
    else:
        rows.append(Row("3 Premium SLA >= 99%", workload, load_s, "-", "-",
                        "n/a: Premium demand alone exceeds the fleet"))
    add("3 Standard SLA >= 95%", _judge(cells, lambda c: _nan0(c["meridian"]["sla_standard"]),
                                        best("sla_standard", _nanmax), lambda m, b: m >= 0.95,
                                        lambda x: f"{x:.1%}"))

    def lost(c, p):
        s = c[p]
        return [s["avg_lost_premium_s"], s["avg_lost_standard_s"], s["avg_lost_basic_s"]]

    def ordered(values):
        p, s, b = values
        # NaN (a tier without finished jobs) never inverts; a tick of slack absorbs rounding.
        return not (p > s + TICK_S or s > b + TICK_S)

    ok = [ordered(lost(c, "meridian")) for c in cells]
    mean = np.nanmean(np.array([lost(c, "meridian") for c in cells]), axis=0) / 3600
    jct = np.nanmean(np.array([[c["meridian"][f"avg_jct_{t}_s"] for t in ("premium", "standard", "basic")]
                               for c in cells]), axis=0) / 3600
    holding = [b for b in BASELINES if b in cells[0] and all(ordered(lost(c, b)) for c in cells)]
    rows.append(Row("3 no tier inversion (P <= S <= B time lost)", workload, load_s,
                    f"lost {mean[0]:.2f}/{mean[1]:.2f}/{mean[2]:.2f} h (JCT {jct[0]:.2f}/{jct[1]:.2f}/{jct[2]:.2f})",
                    "holds for " + (",".join(holding) or "none"),
                    "yes" if all(ok) else f"no ({sum(ok)}/{len(ok)} seeds)"))
    ended = {p: all(c[p]["terminated"] for c in cells) for p in cells[0]}
    rows.append(Row("4 every replay terminates", workload, load_s,
                    "yes" if ended.get("meridian", True) else "no",
                    "yes" if all(v for p, v in ended.items() if p != "meridian") else "no",
                    "yes" if all(ended.values()) else "no"))
    return rows


def _nan0(x):
    return 0.0 if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _nanmax(values):
    values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return max(values) if values else float("nan")


def measure(fleet, workloads, loads, seeds, philly_path=None, progress=None, policies=POLICIES, stored=None):
    """Runs the grid; returns (rows, runs) where runs lists (workload, load, seed, {policy: summary},
    premium demand fits). `stored` maps (workload, load, seed) to an earlier cell: its baselines are
    reused and only Meridian is replayed (baselines do not change when only the core does); a cell
    missing from it is a clear error rather than a silently partial row."""
    rows, runs, cache = [], [], {}
    for workload in workloads:
        base = {seed: workload.build(fleet, seed, philly_path, cache) for seed in seeds}
        for load in loads:
            cells, fits = [], []
            for seed in seeds:
                trace = base[seed].scaled(load)
                began = time.perf_counter()
                if stored is None:
                    cell = run_cell(trace, fleet, seed, policies)
                else:
                    if (workload.name, load, seed) not in stored:
                        raise ValueError(f"no stored baselines for {workload.name} @{load:g}x seed {seed}")
                    cell = {k: v for k, v in stored[(workload.name, load, seed)].items() if k != "meridian"}
                    cell.update(run_cell(trace, fleet, seed, ("meridian",)))
                cells.append(cell)
                fits.append(premium_demand_fits(trace, fleet.n_devices))
                runs.append((workload.name, load, seed, cell, fits[-1]))
                if progress:
                    progress(f"{workload.name} @{load:g}x seed {seed}: {len(trace)} jobs, "
                             f"{time.perf_counter() - began:.0f} s wall")
            rows += goal_rows(workload.name, load, cells, fits)
    return rows, runs


def rows_from_runs(runs):
    """Returns the goal rows of saved runs ((workload, load, seed, cell, fits) in grid order),
    so that a saved grid can be judged again without replaying it."""
    rows, groups = [], {}
    for workload, load, _seed, cell, fits in runs:
        groups.setdefault((workload, load), []).append((cell, fits))
    for (workload, load), items in groups.items():
        rows += goal_rows(workload, load, [c for c, _ in items], [f for _, f in items])
    return rows


def speed_row(fleet, philly_path=None, seed=0):
    """Returns the goal-4 speed Row: the full Philly trace under Meridian (minutes)."""
    trace = load_philly(philly_path, seed=seed) if philly_path else load_philly(seed=seed)
    began, cpu = time.perf_counter(), time.process_time()
    result = Engine(trace, fleet, make_policy("meridian"), tick_s=60.0, seed=seed,
                    startup=StartupCosts(), approvals=ApprovalModel()).run()
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    s = result.summary()
    ended = s["finished"] + s["rejected"] == s["jobs"] and s["stranded"] == 0
    return Row("4 full Philly under Meridian < 300 s wall", "philly (82,247 jobs)", "1x",
               f"{wall:.0f} s wall, {cpu:.0f} s CPU", "-",
               ("yes" if wall < FULL_PHILLY_BUDGET_S and ended else "no"))


def format_rows(rows, markdown=False):
    """Returns the goal rows as a fixed-width (or Markdown) table."""
    header = ["goal", "workload", "load", "Meridian", "best baseline", "holds"]
    table = [[r.goal, r.workload, r.load, r.meridian, r.best_baseline, r.holds] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table])
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(header)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in table])
