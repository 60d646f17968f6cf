"""What a simulation run measured, and the summary numbers derived from it.

Definitions (all times in seconds):
- JCT: finish - submit. Queueing delay: first start - submit. Both over finished jobs.
- makespan: last finish - first submit.
- utilization (allocated): device-seconds held by jobs / (devices x makespan).
- utilization (useful): device-seconds of ideal progress (rate x W integrated, i.e. what the
  job would have used alone at full size) / (devices x makespan); a spliced, time-sliced,
  restoring or spread job holds more than it uses.
- goodput: ideal device-seconds of finished jobs (duration x W) per second of makespan, in
  devices (divide by the fleet size for a fraction).
- preemptions / migrations / resizes per job: totals over all jobs / number of jobs.
- SLA attainment: a job's delivered fraction = duration / (finish - first start - its own
  start-up), the share of ideal device-time it got once admitted (queueing before the first
  start is reported separately; the start-up of its first allocation, fidelity.py, is the job's
  cost under every policy, not the scheduler's). Premium is met at >= 0.95, Standard at
  >= 0.70; Basic is best effort (met by finishing). Attainment = met jobs / finished jobs of the tier.
  The first start is when the job's first devices are its own (the control plane's started_at,
  set by the agent's first running report), so a wait for a previous holder's checkpoint before
  it is queueing. `sla_<tier>_from_placement` is the same attainment with the clock started at
  the first placement decision instead (a wait for a victim's checkpoint counted against the
  job), reported beside it so that the difference between the two clocks stays visible.
- time lost per tier: mean of JCT - duration - the job's start-up (queueing, pauses, slowdowns).
- rejected: jobs refused on arrival because they can never fit the fleet (engine.py);
  stranded: jobs still waiting when the replay ended on a whole, idle fleet (a policy that
  cannot place a job that fits). Neither counts as finished; every other metric is over the
  finished jobs.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .trace import BASIC, PREMIUM, STANDARD, TIER_NAMES

SLA_TARGETS = {PREMIUM: 0.95, STANDARD: 0.70, BASIC: 0.0}


@dataclasses.dataclass
class SimResult:
    policy: str
    trace: str
    fleet: str
    n_devices: int
    submit: np.ndarray
    duration: np.ndarray
    ranks: np.ndarray
    tier: np.ndarray
    first_start: np.ndarray
    finish: np.ndarray
    n_preempt: np.ndarray
    n_migrate: np.ndarray
    n_resize: np.ndarray
    n_fail: np.ndarray
    lost_work: np.ndarray
    alloc_integral: float
    useful_integral: float
    end_time: float
    samples: dict
    wall_s: float
    passes: int
    decisions: int
    policy_s: float
    failures: int
    cpu_s: float = float("nan")  # process CPU seconds of the run (wall_s counts waiting for a core)
    rejected: np.ndarray | None = None  # bool: refused on arrival (can never fit)
    stranded: np.ndarray | None = None  # bool: still waiting at the end on a whole, idle fleet
    startup_s: np.ndarray | None = None  # float64: start-up paid on the first allocation
    first_placed: np.ndarray | None = None  # float64: the first start decision (<= first_start)
    approvals: dict = dataclasses.field(default_factory=dict)  # requests / granted / denied / dropped
    rejections: list = dataclasses.field(default_factory=list)  # (job, reason) per rejected job
    load: float = 1.0  # the offered-load factor the trace was time-scaled by (set by the caller)

    @property
    def label(self):
        """Returns the policy's name, with the offered load when it is not 1 (report legends)."""
        return self.policy if self.load == 1.0 else f"{self.policy} @{self.load:g}x"

    @classmethod
    def from_engine(cls, e, wall_s):
        return cls(
            policy=e.policy.name, trace=e.trace.name, fleet=e.fleet.name, n_devices=e.n_devices,
            submit=e.submit, duration=e.work, ranks=e.W, tier=e.trace.tier,
            first_start=e.first_start, finish=e.finish,
            n_preempt=e.n_preempt, n_migrate=e.n_migrate, n_resize=e.n_resize, n_fail=e.n_fail,
            lost_work=e.lost_work, alloc_integral=e.alloc_integral,
            useful_integral=e.useful_integral, end_time=e.now,
            samples={k: np.frombuffer(v, dtype=np.float64) for k, v in e.samples.items()},
            wall_s=wall_s, passes=e.passes, decisions=e.decisions, policy_s=e.policy_seconds,
            failures=e.failures, rejected=e.rejected, stranded=e.stranded, startup_s=e.startup_s,
            first_placed=e.first_placed,
            approvals=dict(e.approval_counts), rejections=list(e.rejections),
        )

    def summary(self):
        """Returns a flat dict of the metrics in the module docstring."""
        done = ~np.isnan(self.finish)
        n = self.submit.shape[0]
        jct = (self.finish - self.submit)[done]
        queue = (self.first_start - self.submit)[done]
        start = float(self.submit.min()) if n else 0.0
        end = float(np.nanmax(self.finish)) if done.any() else self.end_time
        makespan = max(end - start, 1e-9)
        capacity = self.n_devices * makespan
        out = {
            "policy": self.policy,
            "jobs": int(n),
            "finished": int(done.sum()),
            "rejected": int(self.rejected.sum()) if self.rejected is not None else 0,
            "stranded": int(self.stranded.sum()) if self.stranded is not None else 0,
            "approvals_requested": int(self.approvals.get("requests", 0)),
            "approvals_granted": int(self.approvals.get("granted", 0)),
            "approvals_denied": int(self.approvals.get("denied", 0)),
            "avg_jct_s": _mean(jct),
            "median_jct_s": _pct(jct, 50),
            "p99_jct_s": _pct(jct, 99),
            "avg_queue_s": _mean(queue),
            "median_queue_s": _pct(queue, 50),
            "p99_queue_s": _pct(queue, 99),
            "makespan_s": makespan,
            "util_allocated": self.alloc_integral / capacity,
            "util_useful": self.useful_integral / capacity,
            "goodput_devices": float((self.duration * self.ranks)[done].sum()) / makespan,
            "preemptions_per_job": float(self.n_preempt.sum()) / max(n, 1),
            "migrations_per_job": float(self.n_migrate.sum()) / max(n, 1),
            "resizes_per_job": float(self.n_resize.sum()) / max(n, 1),
            "failure_restarts": int(self.n_fail.sum()),
            "lost_work_device_s": float((self.lost_work * self.ranks).sum()),
            "passes": self.passes,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "policy_s": self.policy_s,
        }
        delivered = self.delivered_fraction()
        from_placement = self.delivered_fraction(since=self.first_placed) if self.first_placed is not None else None
        # Time lost to scheduling: JCT - run time alone at W - the job's own start-up.
        lost = self.finish - self.submit - self.duration - (self.startup_s if self.startup_s is not None else 0.0)
        for tier, name in enumerate(TIER_NAMES):
            mask = done & (self.tier == tier)
            if not mask.any():
                out[f"sla_{name}"] = float("nan")
                out[f"sla_{name}_from_placement"] = float("nan")
                out[f"avg_jct_{name}_s"] = float("nan")
                out[f"avg_queue_{name}_s"] = float("nan")
                out[f"avg_lost_{name}_s"] = float("nan")
                continue
            out[f"sla_{name}"] = float((delivered[mask] >= SLA_TARGETS[tier] - 1e-9).mean())
            out[f"sla_{name}_from_placement"] = (
                float((from_placement[mask] >= SLA_TARGETS[tier] - 1e-9).mean()) if from_placement is not None
                else float("nan"))
            out[f"avg_jct_{name}_s"] = _mean((self.finish - self.submit)[mask])
            out[f"avg_queue_{name}_s"] = _mean((self.first_start - self.submit)[mask])
            out[f"avg_lost_{name}_s"] = _mean(lost[mask])
        return out

    def delivered_fraction(self, since=None):
        """Returns duration / (finish - first start - start-up) per job (NaN for unfinished
        jobs); `since` replaces the first start (e.g. first_placed)."""
        span = self.finish - (self.first_start if since is None else since)
        if self.startup_s is not None:
            span = span - self.startup_s
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(span > 0, np.minimum(1.0, self.duration / np.where(span > 0, span, 1.0)), 1.0) \
                * np.where(np.isnan(self.finish), np.nan, 1.0)


def _mean(x):
    return float(x.mean()) if x.size else float("nan")


def _pct(x, q):
    return float(np.percentile(x, q)) if x.size else float("nan")


COLUMNS = [
    ("policy", "policy", "{}"),
    ("finished", "done", "{:d}"),
    ("rejected", "rejected", "{:d}"),
    ("avg_jct_s", "avg JCT h", "h"),
    ("median_jct_s", "med JCT h", "h"),
    ("p99_jct_s", "p99 JCT h", "h"),
    ("avg_queue_s", "avg queue h", "h"),
    ("makespan_s", "makespan d", "d"),
    ("util_allocated", "util alloc", "{:.1%}"),
    ("util_useful", "util useful", "{:.1%}"),
    ("goodput_devices", "goodput GPUs", "{:.1f}"),
    ("preemptions_per_job", "preempt/job", "{:.3f}"),
    ("migrations_per_job", "migr/job", "{:.3f}"),
    ("resizes_per_job", "resize/job", "{:.3f}"),
    ("sla_premium", "SLA prem", "{:.1%}"),
    ("sla_standard", "SLA std", "{:.1%}"),
    ("sla_basic", "SLA basic", "{:.1%}"),
    ("avg_queue_premium_s", "prem queue h", "h"),
    ("wall_s", "wall s", "{:.1f}"),
    ("cpu_s", "cpu s", "{:.1f}"),
]


def format_table(summaries, markdown=False):
    """Returns the summaries as a fixed-width (or Markdown) table, one row per policy."""
    def cell(summary, key, fmt):
        value = summary.get(key)
        if value is None or (isinstance(value, float) and np.isnan(value)):
            return "-"
        if fmt == "h":
            return f"{value / 3600:.2f}"
        if fmt == "d":
            return f"{value / 86400:.1f}"
        return fmt.format(value)

    columns = COLUMNS
    if any(s.get("load", 1.0) != 1.0 for s in summaries):
        columns = [("load", "load", "{:g}")] + COLUMNS
    header = [title for _, title, _ in columns]
    rows = [[cell(s, key, fmt) for key, _, fmt in columns] for s in summaries]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt_row = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt_row(header), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in rows])
