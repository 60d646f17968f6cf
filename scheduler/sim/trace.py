"""Job traces for the simulator: the real Philly job list, windows of it, offered-load
scaling (time-scaled arrivals), and seeded synthetic traces of several documented mixes.

A `Trace` is a set of numpy arrays, one entry per job, sorted by submit time
(ties keep the file's row order, so the order is deterministic).

SLA tiers are given by a documented, seeded rule (`assign_tiers`): each job
independently draws Premium / Standard / Basic with probabilities
`TIER_SHARES` from `numpy.random.default_rng(seed)`, in submit order. The same
seed always gives the same tiers. Synthetic mixes may use other shares.

Offered load (`Trace.scaled(load)`): every submit time is divided by `load`, so 2.0 offers
the same jobs twice as fast (twice the GPU-hours per day) and 0.5 half as fast; sizes,
durations, tiers and checkpoint sizes stay as they are. This is how the goals of issue 16
compare policies at 0.5x ... 2.0x.

Synthetic traces (`synthetic(n_jobs, devices, load, seed, mix)`), every draw from
`numpy.random.default_rng([seed, 7003])`:
- arrivals: a Poisson process whose rate offers `load` x `devices` busy accelerators on
  average: rate = load x devices / mean(duration x W) over the drawn jobs;
- sizes W and durations: per mix (`SYNTHETIC_MIXES`): `philly` resamples Philly's
  (W, duration) pairs with replacement; the others draw W from a categorical table and the
  duration independently from a log-normal (median, sigma), capped at `max_duration_s`:
    philly         Philly's own pairs                     tiers 0.2/0.3/0.5
    heavy-tail     Philly's W shares; median 1,144 s (Philly's), sigma 2.6 (Philly's
                   log-spread is ~1.8 in the body, ~2.3 at p99), cap 60 days
    multinode      W: 1 40%, 2 10%, 4 10%, 8 15%, 16 13%, 32 9%, 64 3% (Philly: 93% one
                   GPU, 0.3% over 8); median 1 h, sigma 1.8, cap 30 days
    premium-heavy  Philly's W shares; median 1,144 s, sigma 2.0, cap 30 days;
                   tiers 0.45/0.35/0.20
- teams: uniform over `n_teams`.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import os
import pathlib

import numpy as np

# The checkout's sibling ../shared (or $MERIDIAN_PHILLY_TRACE, for a checkout elsewhere).
PHILLY_CSV = pathlib.Path(os.environ.get("MERIDIAN_PHILLY_TRACE") or (
    pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "philly" / "philly_jobs.csv"))

PREMIUM, STANDARD, BASIC = 0, 1, 2
TIER_NAMES = ("premium", "standard", "basic")
# Shares of jobs per tier in the seeded rule: most work is best effort, a
# fifth is paid-for Premium (Singularity's split of guaranteed vs spot capacity).
TIER_SHARES = (0.2, 0.3, 0.5)
# Elastic floor: every job may be spliced down to W // ELASTIC_FLOOR_DIVISOR
# devices (at least 1); the allowed counts are the divisors of W in between.
ELASTIC_FLOOR_DIVISOR = 4
# Checkpoint size per rank (GB): a seeded log-uniform draw per job, covering
# small CNNs to large language-model shards of 2017-2024 jobs.
CHECKPOINT_GB_PER_RANK_RANGE = (0.5, 8.0)


class TraceError(ValueError):
    """The trace file or its arguments are unusable; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """Jobs sorted by submit time. Times are seconds from the trace start."""

    name: str
    submit: np.ndarray        # float64 seconds
    duration: np.ndarray      # float64 seconds when run alone at its requested size
    ranks: np.ndarray         # int32, world size W (= GPUs requested)
    team: np.ndarray          # int32 team index into team_names
    team_names: tuple
    tier: np.ndarray          # int8: PREMIUM, STANDARD or BASIC
    min_devices: np.ndarray   # int32, smallest allowed device count
    checkpoint_gb: np.ndarray  # float64, the job's whole checkpoint size
    type_id: np.ndarray | None = None  # int16, index into type_names: the accelerator it asks for
    type_names: tuple = ()  # () = every job asks for the fleet's first (or only) type

    def __post_init__(self):
        if self.type_id is None:
            object.__setattr__(self, "type_id", np.zeros(self.submit.shape[0], dtype=np.int16))

    def __len__(self):
        return int(self.submit.shape[0])

    @property
    def gpu_seconds(self):
        return float((self.duration * self.ranks).sum())

    def scaled(self, load):
        """Returns the trace with arrivals time-scaled to `load` times its offered load
        (submit times / load); load 1 returns the trace itself."""
        if not (load > 0) or not np.isfinite(load):
            raise TraceError(f"an offered load must be a positive number, got {load!r}")
        if load == 1.0:
            return self
        return dataclasses.replace(self, name=f"{self.name}@{load:g}x", submit=self.submit / load)

    def window(self, start_s=None, end_s=None, max_jobs=None):
        """Returns the jobs submitted in [start_s, end_s) (then the first max_jobs
        of them), with submit times shifted so the window starts at 0."""
        keep = np.ones(len(self), dtype=bool)
        if start_s is not None:
            keep &= self.submit >= start_s
        if end_s is not None:
            keep &= self.submit < end_s
        idx = np.flatnonzero(keep)
        if max_jobs is not None:
            idx = idx[:max_jobs]
        if idx.size == 0:
            raise TraceError(f"the window start={start_s} end={end_s} max_jobs={max_jobs} holds no job")
        return self.subset(idx, f"{self.name}[{idx.size} jobs]")

    def subset(self, idx, name):
        """Returns the jobs `idx` (ascending) as a trace named `name`, submit times shifted so
        the first starts at 0 (windows; `every`)."""
        shift = self.submit[idx[0]]
        return dataclasses.replace(
            self,
            name=name,
            submit=self.submit[idx] - shift,
            duration=self.duration[idx],
            ranks=self.ranks[idx],
            team=self.team[idx],
            tier=self.tier[idx],
            min_devices=self.min_devices[idx],
            checkpoint_gb=self.checkpoint_gb[idx],
            type_id=self.type_id[idx],
        )

    def every(self, stride):
        """Returns every `stride`-th job (1 in stride, in submit order): the same size, duration
        and burst mix at 1/stride of the arrival rate, for a fleet 1/stride the size."""
        if stride < 1:
            raise TraceError(f"a stride must be >= 1, got {stride!r}")
        if stride == 1:
            return self
        return self.subset(np.arange(0, len(self), int(stride)), f"{self.name}/{int(stride)}")

    def with_types(self, fleet, seed):
        """Returns the trace with each job asking for one of the fleet's accelerator types: a
        seeded draw (`default_rng([seed, 7005])`) weighted by each type's share of the fleet's
        devices, among the types one region of which can hold the job's smallest size (a job
        no type can hold keeps the largest type and is rejected by the engine)."""
        capacity = fleet.region_capacity()
        share = np.bincount(fleet.node_type, weights=fleet.node_devices, minlength=len(fleet.type_names))
        rng = np.random.default_rng([seed, 7005])
        ok = self.min_devices[:, None] <= capacity[None, :]
        weights = np.where(ok, share[None, :], 0.0)
        none = weights.sum(axis=1) == 0
        weights[none, int(np.argmax(capacity))] = 1.0
        cumulative = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
        draw = rng.random(len(self))[:, None]
        type_id = np.minimum((draw > cumulative).sum(axis=1), len(fleet.type_names) - 1).astype(np.int16)
        return dataclasses.replace(self, type_id=type_id, type_names=tuple(fleet.type_names))


def assign_tiers(n, seed, shares=TIER_SHARES):
    """Returns int8 tiers for n jobs: the seeded rule described in the module docstring."""
    rng = np.random.default_rng([seed, 7001])
    return rng.choice(3, size=n, p=shares).astype(np.int8)


def elastic_floor(ranks):
    """Returns the smallest allowed device count per job: W // 4 rounded down to a divisor of W."""
    ranks = np.asarray(ranks, dtype=np.int64)
    floor = np.maximum(1, ranks // ELASTIC_FLOOR_DIVISOR)
    out = floor.copy()
    # Round up to the nearest divisor of W (W // 4 is a divisor for the powers of two in Philly;
    # the loop only runs for odd sizes such as 12 or 24 ranks).
    bad = ranks % out != 0
    while bad.any():
        out[bad] += 1
        bad = ranks % out != 0
    return out.astype(np.int32)


def draw_checkpoint_gb(ranks, seed):
    lo, hi = CHECKPOINT_GB_PER_RANK_RANGE
    rng = np.random.default_rng([seed, 7002])
    per_rank = np.exp(rng.uniform(np.log(lo), np.log(hi), size=len(ranks)))
    return per_rank * np.asarray(ranks)


def make_trace(name, submit, duration, ranks, team, team_names, seed, tier=None, tier_shares=TIER_SHARES):
    """Returns a Trace from raw arrays (sorted stably by submit), adding the seeded tiers
    (drawn with `tier_shares`), elastic floors and checkpoint sizes. `tier` overrides the
    seeded tiers (tests)."""
    submit = np.asarray(submit, dtype=np.float64)
    duration = np.asarray(duration, dtype=np.float64)
    ranks = np.asarray(ranks, dtype=np.int32)
    team = np.asarray(team, dtype=np.int32)
    n = submit.shape[0]
    if not (duration.shape[0] == ranks.shape[0] == team.shape[0] == n):
        raise TraceError("submit, duration, ranks and team must have one entry per job")
    if n == 0:
        raise TraceError("a trace needs at least one job")
    if (duration <= 0).any() or not np.isfinite(duration).all():
        raise TraceError("every job needs a positive, finite duration")
    if (ranks < 1).any():
        raise TraceError("every job needs at least one rank")
    order = np.argsort(submit, kind="stable")
    tiers = assign_tiers(n, seed, tier_shares) if tier is None else np.asarray(tier, dtype=np.int8)[order]
    ranks_sorted = ranks[order]
    return Trace(
        name=name,
        submit=submit[order] - submit[order][0],
        duration=duration[order],
        ranks=ranks_sorted,
        team=team[order],
        team_names=tuple(team_names),
        tier=tiers,
        min_devices=elastic_floor(ranks_sorted),
        checkpoint_gb=draw_checkpoint_gb(ranks_sorted, seed),
    )


def load_philly(path=PHILLY_CSV, seed=0):
    """Returns the Philly trace (82,247 jobs) from its CSV; raises TraceError if the file is
    missing or a row is malformed (the error names the row)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise TraceError(f"Philly trace not found at {path}; pass --trace PATH to the CSV "
                         "(columns timestamp,duration,num_gpus,gpu_time,cluster)")
    submit, duration, ranks, team = [], [], [], []
    team_index = {}
    epoch = _dt.datetime(1970, 1, 1)
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"timestamp", "duration", "num_gpus", "cluster"} - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{path} lacks columns {sorted(missing)}")
        for lineno, row in enumerate(reader, start=2):
            try:
                stamp = _dt.datetime.strptime(row["timestamp"], "%Y-%m-%d %H:%M:%S")
                submit.append((stamp - epoch).total_seconds())
                duration.append(float(row["duration"]))
                ranks.append(int(row["num_gpus"]))
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: bad row {row!r}: {exc}") from None
            team.append(team_index.setdefault(row["cluster"], len(team_index)))
    names = sorted(team_index, key=team_index.get)
    return make_trace("philly", submit, duration, ranks, team, names, seed)


@dataclasses.dataclass(frozen=True)
class Mix:
    """A synthetic workload mix (see the module docstring). `sizes` = ((W, share), ...);
    None resamples Philly's (W, duration) pairs."""

    sizes: tuple | None
    duration_median_s: float = 1144.0
    duration_sigma: float = 2.0
    max_duration_s: float = 30 * 86400.0
    tier_shares: tuple = TIER_SHARES


# Philly's job-size shares (82,247 jobs; 12-, 24- and 128-GPU jobs are < 0.01% and dropped).
PHILLY_SIZES = ((1, 0.9317), (2, 0.0221), (4, 0.0227), (8, 0.0200), (16, 0.0024), (32, 0.0008), (64, 0.0001))

SYNTHETIC_MIXES = {
    "philly": Mix(sizes=None),
    "heavy-tail": Mix(sizes=PHILLY_SIZES, duration_sigma=2.6, max_duration_s=60 * 86400.0),
    "multinode": Mix(sizes=((1, 0.40), (2, 0.10), (4, 0.10), (8, 0.15), (16, 0.13), (32, 0.09), (64, 0.03)),
                     duration_median_s=3600.0, duration_sigma=1.8),
    "premium-heavy": Mix(sizes=PHILLY_SIZES, tier_shares=(0.45, 0.35, 0.20)),
}


def synthetic(n_jobs, devices, load=0.8, seed=0, source=None, n_teams=100, mix="philly"):
    """Returns a seeded synthetic trace of n_jobs of the named `mix` (SYNTHETIC_MIXES, see the
    module docstring) whose Poisson arrivals offer `load` times the capacity of `devices`
    accelerators on average. `source` replaces Philly for the `philly` mix (tests)."""
    if n_jobs < 1 or devices < 1 or not (0 < load):
        raise TraceError("synthetic traces need n_jobs >= 1, devices >= 1 and load > 0")
    if mix not in SYNTHETIC_MIXES:
        raise TraceError(f"unknown synthetic mix {mix!r}; choose from {', '.join(SYNTHETIC_MIXES)}")
    spec = SYNTHETIC_MIXES[mix]
    rng = np.random.default_rng([seed, 7003])
    if spec.sizes is None:
        source = source or load_philly(seed=seed)
        pick = rng.integers(0, len(source), size=n_jobs)
        duration = source.duration[pick]
        ranks = source.ranks[pick]
    else:
        sizes = np.array([w for w, _ in spec.sizes])
        shares = np.array([p for _, p in spec.sizes], dtype=np.float64)
        ranks = rng.choice(sizes, size=n_jobs, p=shares / shares.sum())
        duration = np.minimum(spec.max_duration_s,
                              np.maximum(1.0, rng.lognormal(np.log(spec.duration_median_s),
                                                            spec.duration_sigma, size=n_jobs)))
    mean_gpu_seconds = float((duration * ranks).mean())
    rate = load * devices / mean_gpu_seconds  # jobs per second
    submit = np.cumsum(rng.exponential(1.0 / rate, size=n_jobs))
    team = rng.integers(0, n_teams, size=n_jobs)
    name = f"synthetic-{n_jobs}" if mix == "philly" else f"synthetic-{mix}-{n_jobs}"
    return make_trace(name, submit, duration, ranks, team,
                      [f"team-{i}" for i in range(n_teams)], seed, tier_shares=spec.tier_shares)
