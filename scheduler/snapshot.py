"""The frozen input of one scheduling tick: the fleet, the jobs, the teams, `now`, the settings.

Everything is a struct of numpy arrays, one array per field, so a tick over a million
accelerators never walks Python objects per device. Each constructor accepts plain Python
lists (the control loop builds them from ORM rows) or numpy arrays (the simulator and the
bench); arrays of the right dtype are taken as read-only views without a copy.

Indices, not ids, link the tables: `Accelerators.holder[i]` is an index into `Jobs`,
`Jobs.team[j]` an index into `Teams`, `type_id` an index into `Snapshot.type_names`,
`node` an index into `Snapshot.node_status`, `region` an index into `Snapshot.region_names`.
The caller's own job ids travel in `Jobs.ids` and come back in every decision.

A job's current devices are not stored twice: they are the accelerators whose `holder` is
the job's index. Which rank runs on which of those devices is the runtime's business
(see `scheduler.plan.rank_layout`).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, TypeAlias

import numpy as np

from protocol.layout import device_counts_allowed

# --- SLA tiers: a lower number is served first -------------------------------------------
PREMIUM = 0  # >= 95% of ideal device-time; never preempted or shrunk without an approval
STANDARD = 1  # >= 70%; may be shrunk or preempted while its attained fraction stays >= floor
BASIC = 2  # best effort; preempted or shrunk freely
TIER_NAMES = ("Premium", "Standard", "Basic")

# --- job states ----------------------------------------------------------------------------
PENDING = 0  # holds no device; waits in line
RUNNING = 1  # holds a number of devices that is one of its allowed counts
JOB_STATE_NAMES = ("pending", "running")

# --- node states (Snapshot.node_status) ----------------------------------------------------
NODE_READY = 0  # schedulable
NODE_DRAINING = 1  # running jobs are moved off when there is room elsewhere; nothing new lands
NODE_LOST = 2  # heartbeats missed: its jobs are dead and restart from their last checkpoint
NODE_STATUS_NAMES = ("ready", "draining", "lost")

# --- how far a job's devices may spread (Jobs.max_spread) ---------------------------------
SPREAD_NODE = 0  # all devices on one node (e.g. tensor parallel over NVLink)
SPREAD_RACK = 1  # within one rack / NVLink domain
SPREAD_CLUSTER = 2  # within one cluster
SPREAD_REGION = 3  # within one region: the default, and the loosest allowed (never across)
SPREAD_NAMES = ("node", "rack", "cluster", "region")

NO_JOB = -1  # Accelerators.holder of a free device
UNLIMITED = np.iinfo(np.int64).max // 4  # a quota that never binds


class SnapshotError(ValueError):
    """The snapshot is inconsistent; the message names the first offending field and row."""


# A column of Accelerators / Jobs / Teams / Snapshot: the constructor takes any array-like (a list,
# an array; None where the field has a default) and __post_init__ stores a read-only np.ndarray of
# the dtype its comment names. A dataclass field has one type for both sides, and neither
# np.ndarray (a list is not one) nor ArrayLike | None (what is stored is never None) is true of
# both, so a column is typed Any; `_column` and `_filled` are where its real type is made.
Column: TypeAlias = Any


def _column(value, dtype, length: int | None, name: str) -> np.ndarray:
    """Returns `value` as a read-only 1-D array of `dtype`; copies only when it must."""
    array = np.asarray(value, dtype=dtype)
    if array.ndim != 1:
        raise SnapshotError(f"{name} must be one-dimensional, got shape {array.shape}")
    if length is not None and array.shape[0] != length:
        raise SnapshotError(f"{name} has {array.shape[0]} rows, expected {length}")
    view = array.view()
    view.flags.writeable = False
    return view


def _filled(value, fill, dtype, length: int, name: str) -> np.ndarray:
    if value is None:
        value = np.full(length, fill, dtype=dtype)
    return _column(value, dtype, length, name)


@dataclass(frozen=True, eq=False)
class Accelerators:
    """One row per accelerator (device). All arrays have the same length N.

    Topology is given per device so that aggregating free capacity per node, rack, cluster
    and region is one `np.bincount` each; every device of a node must carry the node's
    rack, cluster and region (checked by `Snapshot.validate`).
    """

    type_id: Column  # int16[N]: index into Snapshot.type_names ("H100-80GB", ...)
    node: Column  # int32[N]: node index, 0..n_nodes-1 (index into Snapshot.node_status)
    rack: Column  # int32[N]: rack / NVLink domain index, global (not per cluster)
    cluster: Column  # int32[N]: cluster index, global
    region: Column  # int32[N]: region index, index into Snapshot.region_names
    healthy: Column = None  # bool[N]: False = the device may not be given to anyone
    holder: Column = None  # int32[N]: index of the job holding the device; NO_JOB if free
    releasing_until: Column = None  # float64[N]: s; a free device whose last holder is still
    # stopping (checkpoint at a consistent cut) is only usable from this time on; a job placed on
    # it starts after that. <= Snapshot.now (default -inf) = free now. Ignored for held devices.

    def __post_init__(self):
        n = np.asarray(self.type_id).shape[0]
        object.__setattr__(self, "type_id", _column(self.type_id, np.int16, n, "type_id"))
        for name in ("node", "rack", "cluster", "region"):
            object.__setattr__(self, name, _column(getattr(self, name), np.int32, n, name))
        object.__setattr__(self, "healthy", _filled(self.healthy, True, np.bool_, n, "healthy"))
        object.__setattr__(self, "holder", _filled(self.holder, NO_JOB, np.int32, n, "holder"))
        object.__setattr__(self, "releasing_until",
                           _filled(self.releasing_until, -np.inf, np.float64, n, "releasing_until"))

    @classmethod
    def from_rows(cls, rows: Iterable["AcceleratorRow"]) -> "Accelerators":
        """Returns the columnar Accelerators for a list of AcceleratorRow (one pass per field)."""
        rows = list(rows)
        column = lambda name: [getattr(r, name) for r in rows]  # noqa: E731
        return cls(type_id=column("type_id"), node=column("node"), rack=column("rack"),
                   cluster=column("cluster"), region=column("region"), healthy=column("healthy"),
                   holder=column("holder"), releasing_until=column("releasing_until"))

    def __len__(self) -> int:
        return int(self.type_id.shape[0])

    def replace(self, **changes) -> "Accelerators":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class AcceleratorRow:
    """One accelerator as plain Python values (`Accelerators.from_rows([...])`)."""

    type_id: int  # index into Snapshot.type_names
    node: int  # node index (into Snapshot.node_status)
    rack: int  # rack / NVLink domain index
    cluster: int  # cluster index
    region: int  # region index (into Snapshot.region_names)
    healthy: bool = True  # False = never given to a job
    holder: int = NO_JOB  # index of the job holding it (its row in Jobs), NO_JOB if free
    releasing_until: float = float("-inf")  # s; free but still being released until then


@dataclass(frozen=True)
class JobRow:
    """One job as plain Python values: what a selector builds from an ORM row.

    `Jobs.from_rows([JobRow(...), ...])` turns a list of these into the columnar `Jobs`.
    Times are seconds on the same clock as `Snapshot.now` (the caller's epoch seconds).
    """

    id: int  # the caller's job id (database primary key, trace row, ...)
    team: int  # index into Teams
    tier: int  # PREMIUM / STANDARD / BASIC
    type_id: int  # accelerator type index the job runs on
    world_size: int  # W: logical ranks; never changes (resizing maps W ranks to d devices)
    min_devices: int = 0  # smallest device count allowed; 0 = W (not elastic)
    state: int = PENDING
    submit_time: float = 0.0  # s
    attained_device_seconds: float = 0.0  # device-seconds received so far
    ideal_device_seconds: float = 0.0  # device-seconds it would have had running at W since submit
    last_checkpoint_time: float = float("-inf")  # s; -inf = never checkpointed
    last_checkpoint_step: int = 0  # training step of the last checkpoint (restart point)
    checkpoint_bytes: int = 0  # size of the last checkpoint in bytes (cost of moving it)
    last_start_time: float = float("-inf")  # s; when it last (re)started on devices
    last_resize_time: float = float("-inf")  # s; when its device count last changed (grow or shrink)
    preemption_approved: bool = False  # a capacity manager approved preempting/shrinking it
    preemption_denied: bool = False  # a capacity manager denied it (and the denial still holds)
    max_spread: int = SPREAD_REGION  # loosest topology level its devices may span
    name: str | None = None  # for reasons only ("job a"); defaults to the id


@dataclass(frozen=True, eq=False)
class Jobs:
    """One row per job known to the tick (pending or running). All arrays have length J.

    Allowed device counts of a job are the divisors of `world_size` that are
    >= `min_devices` (see `allowed_counts`); a job with min_devices == world_size is rigid.
    """

    ids: Column  # int64[J]: the caller's job ids, echoed in every decision
    team: Column  # int32[J]: index into Teams
    tier: Column  # int8[J]: PREMIUM / STANDARD / BASIC
    type_id: Column  # int16[J]: accelerator type it needs
    world_size: Column  # int32[J]: W logical ranks (>= 1)
    min_devices: Column = None  # int32[J]: smallest allowed device count; default W (rigid)
    state: Column = None  # int8[J]: PENDING / RUNNING; default PENDING
    submit_time: Column = None  # float64[J]: s, submission time; default 0
    attained_device_seconds: Column = None  # float64[J]: device-s received; default 0
    ideal_device_seconds: Column = None  # float64[J]: device-s it would have had at W; default 0
    last_checkpoint_time: Column = None  # float64[J]: s, -inf = never
    last_checkpoint_step: Column = None  # int64[J]: step of the last checkpoint
    checkpoint_bytes: Column = None  # int64[J]: bytes of the last checkpoint
    last_start_time: Column = None  # float64[J]: s, last (re)start; -inf = never
    last_resize_time: Column = None  # float64[J]: s, last grow or shrink; -inf = never
    preemption_approved: Column = None  # bool[J]: an approval to preempt/shrink it was granted
    preemption_denied: Column = None  # bool[J]: a denial holds: never a victim, never asked about
    max_spread: Column = None  # int8[J]: SPREAD_NODE .. SPREAD_REGION; default SPREAD_REGION
    names: Sequence[str] | None = None  # optional display names, for reasons only (stored as a tuple)

    def __post_init__(self):
        n = np.asarray(self.ids).shape[0]
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("ids", _column(self.ids, np.int64, n, "ids"))
        set_("team", _column(self.team, np.int32, n, "team"))
        set_("tier", _column(self.tier, np.int8, n, "tier"))
        set_("type_id", _column(self.type_id, np.int16, n, "type_id"))
        set_("world_size", _column(self.world_size, np.int32, n, "world_size"))
        set_("min_devices", _column(self.world_size if self.min_devices is None else self.min_devices,
                                    np.int32, n, "min_devices"))
        set_("state", _filled(self.state, PENDING, np.int8, n, "state"))
        for name, fill in (("submit_time", 0.0), ("attained_device_seconds", 0.0),
                           ("ideal_device_seconds", 0.0), ("last_checkpoint_time", -np.inf),
                           ("last_start_time", -np.inf), ("last_resize_time", -np.inf)):
            set_(name, _filled(getattr(self, name), fill, np.float64, n, name))
        set_("last_checkpoint_step", _filled(self.last_checkpoint_step, 0, np.int64, n,
                                             "last_checkpoint_step"))
        set_("checkpoint_bytes", _filled(self.checkpoint_bytes, 0, np.int64, n, "checkpoint_bytes"))
        set_("preemption_approved", _filled(self.preemption_approved, False, np.bool_, n,
                                            "preemption_approved"))
        set_("preemption_denied", _filled(self.preemption_denied, False, np.bool_, n,
                                          "preemption_denied"))
        set_("max_spread", _filled(self.max_spread, SPREAD_REGION, np.int8, n, "max_spread"))
        if self.names is not None:
            names = tuple(str(x) for x in self.names)
            if len(names) != n:
                raise SnapshotError(f"names has {len(names)} rows, expected {n}")
            set_("names", names)

    @classmethod
    def from_rows(cls, rows: Iterable[JobRow]) -> "Jobs":
        """Returns the columnar Jobs for a list of JobRow (one pass per field)."""
        rows = list(rows)
        column = lambda name: [getattr(r, name) for r in rows]  # noqa: E731
        min_devices = [r.min_devices or r.world_size for r in rows]
        names = [r.name if r.name is not None else str(r.id) for r in rows]
        return cls(
            ids=column("id"), team=column("team"), tier=column("tier"), type_id=column("type_id"),
            world_size=column("world_size"), min_devices=min_devices, state=column("state"),
            submit_time=column("submit_time"),
            attained_device_seconds=column("attained_device_seconds"),
            ideal_device_seconds=column("ideal_device_seconds"),
            last_checkpoint_time=column("last_checkpoint_time"),
            last_checkpoint_step=column("last_checkpoint_step"),
            checkpoint_bytes=column("checkpoint_bytes"), last_start_time=column("last_start_time"),
            last_resize_time=column("last_resize_time"),
            preemption_approved=column("preemption_approved"),
            preemption_denied=column("preemption_denied"), max_spread=column("max_spread"),
            names=names,
        )

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def name(self, j: int) -> str:
        """Returns the display name of job index j ("a", or its id as text)."""
        return self.names[j] if self.names is not None else str(int(self.ids[j]))

    def allowed_counts(self, j: int) -> tuple[int, ...]:
        """Returns job j's allowed device counts, largest first: divisors of W >= min_devices."""
        return allowed_counts(int(self.world_size[j]), int(self.min_devices[j]))

    def replace(self, **changes) -> "Jobs":
        return dataclasses.replace(self, **changes)


def las_queue(attained_device_seconds, settings: "PolicySettings") -> np.ndarray:
    """Returns int64[J]: each job's attained-service queue (0 = least served; see
    PolicySettings.las_thresholds_device_seconds)."""
    thresholds = np.asarray(settings.las_thresholds_device_seconds, np.float64)
    return np.searchsorted(thresholds, np.asarray(attained_device_seconds, np.float64), side="right").astype(np.int64)


@functools.lru_cache(maxsize=4096)
def allowed_counts(world_size: int, min_devices: int) -> tuple[int, ...]:
    """Returns the divisors of world_size that are >= min_devices, largest first.

    W ranks on d devices need d | W so every device runs the same number of ranks (the rule
    lives in protocol.layout). min_devices <= 0 means rigid (only W).
    """
    if min_devices <= 0:
        min_devices = world_size
    return device_counts_allowed(world_size, at_least=min_devices)[::-1]


@dataclass(frozen=True, eq=False)
class Teams:
    """One row per team. Quotas and usage are per accelerator type: arrays of shape [T, K]."""

    names: Sequence[str]  # T display names (stored as a tuple)
    quota: Column = None  # int64[T, K]: devices of each type the team may hold; UNLIMITED default
    decayed_usage: Column = None  # float64[T, K]: past device-seconds, exponentially decayed
    # by the caller with half-life PolicySettings.fair_share_half_life_seconds; default 0
    weight: Column = None  # float64[T]: fair-share weight (2 = entitled to twice the share); default 1

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(str(x) for x in self.names))

    def shaped(self, n_types: int) -> "Teams":
        """Returns these teams with quota/decayed_usage/weight filled and checked for K types."""
        t = len(self.names)
        quota = np.full((t, n_types), UNLIMITED, np.int64) if self.quota is None else self.quota
        usage = np.zeros((t, n_types), np.float64) if self.decayed_usage is None else self.decayed_usage
        weight = np.ones(t, np.float64) if self.weight is None else self.weight
        quota = np.asarray(quota, np.int64)
        usage = np.asarray(usage, np.float64)
        weight = np.asarray(weight, np.float64)
        for name, array, shape in (("quota", quota, (t, n_types)),
                                   ("decayed_usage", usage, (t, n_types)), ("weight", weight, (t,))):
            if array.shape != shape:
                raise SnapshotError(f"Teams.{name} has shape {array.shape}, expected {shape}")
        if np.any(weight <= 0):
            raise SnapshotError("Teams.weight must be > 0")
        views = []
        for array in (quota, usage, weight):
            view = array.view()
            view.flags.writeable = False
            views.append(view)
        return Teams(names=self.names, quota=views[0], decayed_usage=views[1], weight=views[2])

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class PolicySettings:
    """The knobs of the policy, carried in the snapshot so a tick is a pure function of it."""

    standard_sla_floor: float = 0.70  # Standard may be preempted/shrunk while attained/ideal >= this
    min_run_seconds: float = 600.0  # s; a job (re)started less than this ago is not preempted again
    fair_share_half_life_seconds: float = 7 * 86400.0  # s; half-life of Teams.decayed_usage
    past_usage_weight: float = 0.5  # 0..1: weight of decayed past usage vs current in the share
    allow_borrowing: bool = True  # a team may exceed its quota on idle devices (first reclaimed)
    max_preemptions_per_tick: int = 256  # victims (preempted + shrunk) at most per tick
    max_defrag_migrations_per_tick: int = 16  # jobs moved to defragment, at most per tick
    # Tier policy. Jobs of these tiers start (and restart) only at their full world size W,
    # never shrunk: Premium's SLA is >= 95% of the ideal device-time at W, which a job started
    # on W/2 devices misses from its first second. Other tiers start at the largest allowed
    # count that fits and grow later.
    full_size_tiers: tuple = (PREMIUM,)
    # Jobs of these tiers start only as packed as the fleet allows: on one node if a node has
    # W devices of their type, else one rack, one cluster (never looser than max_spread): a
    # gang spread over more nodes than it needs runs slower, which misses 95% by itself.
    packed_tiers: tuple = (PREMIUM,)
    # A packed-tier job that finds no packed place, even by preempting or moving others, waits for
    # one (False) or starts spread out (True). Spread, it runs at ~0.9 of its speed
    # (scheduler.placement_cost) and has missed a 95% SLA from its first second; waiting, its SLA
    # clock has not started (the control plane's started_at is its first running report) and the
    # place comes as soon as a packed one frees. Measured on the quick goals grid
    # (bench/sim_goals.py, 2026-12-05): waiting kept Premium >= 99% on the multinode mix at 1-2x
    # load (98.7-99.7% spread) at the same Premium time lost (docs/results.md, issue 16 round 6).
    packed_tiers_may_spread: bool = False
    # Jobs of these tiers start, restart and are shrunk only to device counts whose speed
    # (scheduler.placement_cost: d/W x splice efficiency) is at least standard_sla_floor: a
    # Standard job started (or shrunk) to W/4 runs at 24% of its ideal and misses its 70% from
    # that second, however briefly it waits. Other tiers may run at any allowed count.
    floor_speed_tiers: tuple = (STANDARD,)
    # A preemptor of these tiers takes the room whose devices are free soonest (its victims'
    # checkpoints, scheduler.placement_cost.checkpoint_seconds, and devices still releasing),
    # then the fewest victims, then the least lost work: a Premium job placed on a victim's
    # devices waits for that checkpoint before its first step, which a short job feels as a
    # large share of its JCT. Other tiers shrink before they preempt (no work lost), whatever
    # they wait.
    soonest_room_tiers: tuple = (PREMIUM, STANDARD)
    premium_reserve_devices: int = 0  # free devices per region and type that only Premium jobs
    # may take (pending jobs of other tiers and growth leave them idle), so a short Premium job
    # starts at once instead of after a victim's checkpoint; 0 = fully work-conserving
    premium_reserve_fraction: float = 0.01  # the same, as a fraction of the usable devices per
    # region and type (rounded down: a region of under 100 devices keeps none); the larger of the
    # two applies. A Premium job that lands on a victim's devices waits for its checkpoint, which
    # can double a short job's JCT (and is lost device-time if it is restored: a restart's wait
    # counts against its SLA); 1% idle buys that wait back.
    min_resize_interval_seconds: float = 600.0  # s; a job is not grown again sooner than this
    # after its last resize (grow or shrink), so grow/shrink does not flap tick after tick
    # Attained-service queues within a tier (Tiresias' discretized 2D-LAS): a job whose attained
    # device-seconds passed the i-th threshold is in queue i+1; within a tier, a lower queue is
    # served first, and a Basic job may preempt a Basic job of a higher queue, so short jobs do
    # not wait behind long large ones. () = one queue (order by fair share and age only).
    las_thresholds_device_seconds: tuple = (3600.0, 36000.0)
    # The running non-Premium jobs with the most work done (attained device-seconds / W), holding
    # up to this share of a type's usable devices, are neither shrunk nor preempted for a Basic or
    # Standard job (Premium still may; borrowed devices are still reclaimed): with heavy-tailed
    # durations the most progressed job is the likeliest to run longest, so it sets the makespan
    # and the p99 JCT, and 2D-LAS alone makes it every arrival's first victim. 0 = off.
    protected_progress_share: float = 0.25

    def __post_init__(self):
        if not 0.0 <= self.standard_sla_floor <= 1.0:
            raise SnapshotError("standard_sla_floor must be within 0..1")
        if self.min_run_seconds < 0 or self.fair_share_half_life_seconds <= 0:
            raise SnapshotError("min_run_seconds must be >= 0 and the half-life > 0")
        if not 0.0 <= self.past_usage_weight <= 1.0:
            raise SnapshotError("past_usage_weight must be within 0..1")
        if not 0.0 <= self.protected_progress_share <= 1.0:
            raise SnapshotError("protected_progress_share must be within 0..1")
        if not 0.0 <= self.premium_reserve_fraction < 1.0:
            raise SnapshotError("premium_reserve_fraction must be within 0..1 (exclusive)")
        if self.min_resize_interval_seconds < 0 or self.premium_reserve_devices < 0:
            raise SnapshotError("min_resize_interval_seconds and premium_reserve_devices must be >= 0")
        thresholds = tuple(float(t) for t in self.las_thresholds_device_seconds)
        if any(not t > 0 for t in thresholds) or list(thresholds) != sorted(thresholds):
            raise SnapshotError("las_thresholds_device_seconds must be positive and increasing")
        object.__setattr__(self, "las_thresholds_device_seconds", thresholds)
        for name in ("full_size_tiers", "packed_tiers", "floor_speed_tiers", "soonest_room_tiers"):
            tiers = tuple(int(t) for t in getattr(self, name))
            if any(t not in (PREMIUM, STANDARD, BASIC) for t in tiers):
                raise SnapshotError(f"{name} holds an unknown tier: {tiers}")
            object.__setattr__(self, name, tiers)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Everything one tick may look at. Immutable; `scheduler.apply_plan` returns a new one."""

    accelerators: Accelerators
    jobs: Jobs
    teams: Teams
    now: float  # s, the caller's clock (the core never reads a clock)
    type_names: Sequence[str]  # K accelerator type names, indexed by type_id ("H100-80GB", ...)
    region_names: Sequence[str] | None = None  # R region names (stored as a tuple); default "region-<i>"
    node_status: Column = None  # int8[n_nodes]: NODE_READY / NODE_DRAINING / NODE_LOST
    region_drained: Column = None  # bool[R]: True = move everything out, place nothing new
    settings: PolicySettings = field(default_factory=PolicySettings)
    node_names: Sequence[str] | None = None  # optional node names, for reasons only

    def __post_init__(self):
        acc = self.accelerators
        object.__setattr__(self, "type_names", tuple(str(x) for x in self.type_names))
        n_nodes = int(acc.node.max()) + 1 if len(acc) else 0
        n_regions = int(acc.region.max()) + 1 if len(acc) else 0
        if self.region_names is None:
            object.__setattr__(self, "region_names", tuple(f"region-{i}" for i in range(n_regions)))
        else:
            object.__setattr__(self, "region_names", tuple(str(x) for x in self.region_names))
            n_regions = max(n_regions, len(self.region_names))
        if self.node_status is not None:
            n_nodes = max(n_nodes, np.asarray(self.node_status).shape[0])
        object.__setattr__(self, "node_status",
                           _filled(self.node_status, NODE_READY, np.int8, n_nodes, "node_status"))
        object.__setattr__(self, "region_drained",
                           _filled(self.region_drained, False, np.bool_, n_regions, "region_drained"))
        if len(self.region_names) < n_regions:
            raise SnapshotError(f"region_names has {len(self.region_names)} names for {n_regions} regions")
        object.__setattr__(self, "teams", self.teams.shaped(len(self.type_names)))
        object.__setattr__(self, "now", float(self.now))

    # --- small derivations ---------------------------------------------------------------
    @property
    def n_types(self) -> int:
        return len(self.type_names)

    def allocation_counts(self) -> np.ndarray:
        """Returns int64[J]: how many devices each job holds now."""
        holder = self.accelerators.holder
        return np.bincount(holder[holder >= 0], minlength=len(self.jobs)).astype(np.int64)

    def job_devices(self, j: int) -> np.ndarray:
        """Returns the device indices job j holds, ascending (O(N); for tests and callers)."""
        return np.flatnonzero(self.accelerators.holder == j)

    def team_usage(self) -> np.ndarray:
        """Returns int64[T, K]: devices each team holds now, per type."""
        holder = self.accelerators.holder
        held = holder >= 0
        teams = self.jobs.team[holder[held]].astype(np.int64)
        types = self.accelerators.type_id[held].astype(np.int64)
        k = self.n_types
        return np.bincount(teams * k + types, minlength=len(self.teams) * k).reshape(len(self.teams), k)

    def replace(self, **changes) -> "Snapshot":
        return dataclasses.replace(self, **changes)

    def without_jobs(self, finished) -> "Snapshot":
        """Returns this snapshot with the jobs at indices `finished` removed and their devices freed.

        Job indices after the removed ones shift down (holders are renumbered); ids are kept.
        For callers whose jobs finish between ticks (the simulator, tests).
        """
        jobs = self.jobs
        keep = np.ones(len(jobs), np.bool_)
        keep[np.asarray(finished, np.int64)] = False
        new_index = np.cumsum(keep) - 1
        holder = self.accelerators.holder
        held = holder >= 0
        new_holder = np.full(holder.shape, NO_JOB, np.int32)
        kept_device = held.copy()
        kept_device[held] = keep[holder[held]]
        new_holder[kept_device] = new_index[holder[kept_device]]
        columns = {}
        for f in dataclasses.fields(Jobs):
            value = getattr(jobs, f.name)
            if f.name == "names":
                columns[f.name] = None if value is None else tuple(v for v, k in zip(value, keep) if k)
            else:
                columns[f.name] = value[keep]
        return self.replace(accelerators=self.accelerators.replace(holder=new_holder), jobs=Jobs(**columns))

    # --- validity ------------------------------------------------------------------------
    def validate(self) -> "Snapshot":
        """Returns self if the snapshot is consistent, else raises SnapshotError naming the fault.

        Checks: index ranges; every node's devices share one rack, cluster and region; every
        running job holds a number of devices among its allowed counts, all of its type and in
        one region; pending jobs hold nothing; tiers, states and spreads are known values.
        """
        acc, jobs = self.accelerators, self.jobs
        n_jobs, k = len(jobs), self.n_types
        if len(acc):
            if acc.type_id.min() < 0 or acc.type_id.max() >= k:
                raise SnapshotError(f"Accelerators.type_id outside 0..{k - 1}")
            for name in ("node", "rack", "cluster", "region"):
                if getattr(acc, name).min() < 0:
                    raise SnapshotError(f"Accelerators.{name} has a negative index")
            if acc.holder.min() < NO_JOB or acc.holder.max() >= n_jobs:
                raise SnapshotError("Accelerators.holder points outside the job table")
            n_nodes = self.node_status.shape[0]
            for name in ("rack", "cluster", "region"):
                column = getattr(acc, name)
                first = np.full(n_nodes, -1, np.int64)
                first[acc.node[::-1]] = column[::-1]  # the value of each node's first device
                bad = np.flatnonzero(first[acc.node] != column)
                if bad.size:
                    raise SnapshotError(f"accelerator {bad[0]} has a different {name} than the "
                                        f"other devices of node {acc.node[bad[0]]}")
        if n_jobs:
            if jobs.team.min() < 0 or jobs.team.max() >= len(self.teams):
                raise SnapshotError("Jobs.team points outside the team table")
            if jobs.type_id.min() < 0 or jobs.type_id.max() >= k:
                raise SnapshotError(f"Jobs.type_id outside 0..{k - 1}")
            if jobs.world_size.min() < 1:
                raise SnapshotError(f"job {jobs.name(int(np.argmin(jobs.world_size)))} has world size < 1")
            bad = np.flatnonzero((jobs.min_devices < 1) | (jobs.min_devices > jobs.world_size))
            if bad.size:
                raise SnapshotError(f"job {jobs.name(int(bad[0]))}: min_devices must be within 1..W")
            if not np.isin(jobs.tier, (PREMIUM, STANDARD, BASIC)).all():
                raise SnapshotError("Jobs.tier holds an unknown tier")
            if not np.isin(jobs.state, (PENDING, RUNNING)).all():
                raise SnapshotError("Jobs.state holds an unknown state")
            if jobs.max_spread.min() < SPREAD_NODE or jobs.max_spread.max() > SPREAD_REGION:
                raise SnapshotError("Jobs.max_spread outside SPREAD_NODE..SPREAD_REGION")
        counts = self.allocation_counts()
        held = acc.holder >= 0
        holders = acc.holder[held]
        wrong_type = np.flatnonzero(acc.type_id[held] != jobs.type_id[holders])
        if wrong_type.size:
            j = int(holders[wrong_type[0]])
            raise SnapshotError(f"job {jobs.name(j)} holds a device of another type")
        if n_jobs:
            region_min = np.full(n_jobs, np.iinfo(np.int32).max, np.int64)
            region_max = np.full(n_jobs, -1, np.int64)
            np.minimum.at(region_min, holders, acc.region[held])
            np.maximum.at(region_max, holders, acc.region[held])
            spans = np.flatnonzero((counts > 0) & (region_min != region_max))
            if spans.size:
                raise SnapshotError(f"job {jobs.name(int(spans[0]))} spans regions")
        pending_holding = np.flatnonzero((jobs.state == PENDING) & (counts > 0))
        if pending_holding.size:
            raise SnapshotError(f"pending job {jobs.name(int(pending_holding[0]))} holds devices")
        running = np.flatnonzero(jobs.state == RUNNING)
        w, c = jobs.world_size[running], counts[running]
        bad = running[(c == 0) | (c < jobs.min_devices[running]) | (w % np.maximum(c, 1) != 0)]
        if bad.size:
            j = int(bad[0])
            raise SnapshotError(f"running job {jobs.name(j)} holds {counts[j]} devices, not one of "
                                f"its allowed counts {jobs.allowed_counts(j)}")
        return self
