"""One scheduling tick, in numbered phases (kueue `schedule()`, kube-scheduler framework):

  1. snapshot    derive the working state: free devices per node/rack/cluster/region and
                 type, per-job allocations, team usage, borrowers
  2. order       put pending jobs in line (tier, fair share, age)
  3. place       move jobs off lost/draining nodes and drained regions, then for each job in
                 line find all its devices at once (gang, topology-packed)
  4. preempt     a job that does not fit may shrink, then preempt, cheaper lower-tier jobs
  5. resize      grow elastic jobs into the devices still idle (work conservation)
  6. defragment  a gang that fails only because free devices are scattered gets a node or
                 rack freed by migrating small jobs
  7. plan        order the decisions (releases before starts) and give every pending job a
                 wait reason and its place in line

Phases 4 and 6 run inline for the job at the head of the line (as kueue does), so that a
preemption is decided while the capacity it frees is still there; their time is added to
their own phase. The core reads no clock: pass `timer` (e.g. time.perf_counter) to get
`Plan.phase_seconds`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from scheduler.plan import Plan, Start, WaitReason
from scheduler.plugins import REGISTRY
from scheduler.plugins import placement as placement_plugin
from scheduler.plugins import quota as quota_plugin
from scheduler.snapshot import PENDING, Snapshot
from scheduler.state import WorkingState

PHASES = ("1. snapshot", "2. order", "3. place", "4. preempt", "5. resize", "6. defragment", "7. plan")


@dataclass(frozen=True)
class Policy:
    """Which plugin does each step; None switches a step off (baselines do that)."""

    order: object
    quota: object
    place: object
    preempt: object = None
    resize: object = None
    defrag: object = None
    drain: object = None

    @classmethod
    def from_names(cls, **names) -> "Policy":
        """Returns a Policy from registry names, e.g. Policy.from_names(order="order.fifo", ...).

        Steps not named get the default plugin; a step named None is switched off.
        Raises KeyError naming the unknown plugin and the known ones.
        """
        chosen = dict(DEFAULT_PLUGIN_NAMES)
        chosen.update(names)
        plugins = {}
        for step, name in chosen.items():
            if step not in DEFAULT_PLUGIN_NAMES:
                raise KeyError(f"unknown policy step {step!r}; steps are {sorted(DEFAULT_PLUGIN_NAMES)}")
            if name is None:
                plugins[step] = None
                continue
            if name not in REGISTRY:
                raise KeyError(f"unknown plugin {name!r}; known plugins: {sorted(REGISTRY)}")
            plugins[step] = REGISTRY[name]()
        return cls(**plugins)

    @classmethod
    def default(cls) -> "Policy":
        return cls.from_names()


DEFAULT_PLUGIN_NAMES = {
    "order": "order.tier_fair_share",
    "quota": "quota.team_borrowing",
    "place": "place.gang_topology",
    "preempt": None,
    "resize": None,
    "defrag": None,
    "drain": None,
}


class Tick:
    """The working context of one tick: snapshot, working state, running totals, decisions."""

    def __init__(self, snapshot: Snapshot, policy: Policy):
        self.snapshot = snapshot
        self.policy = policy
        self.state = WorkingState(snapshot)
        jobs = snapshot.jobs
        k = snapshot.n_types
        usable_types = self.state.type_id[self.state.usable]
        self.type_capacity = np.bincount(usable_types, minlength=k).astype(np.int64)  # [K]
        self.team_usage = snapshot.team_usage().astype(np.int64)  # [T, K], kept current
        self.borrower = quota_plugin.borrowing_jobs(snapshot, self.state.alloc, self.team_usage)
        self.touched = np.zeros(len(jobs), np.bool_)  # started/moved/resized/preempted this tick
        self.releases: list = []  # Preempt / shrinking Resize / Migrate off dead nodes
        self.starts: list = []  # Start / Migrate / growing Resize
        self.waiting: dict[int, tuple[str, str]] = {}  # job -> (code, reason)
        self.line: np.ndarray = np.empty(0, np.int64)  # pending jobs in order

    # --- bookkeeping used by every plugin ------------------------------------------------
    def give(self, j: int, devices: np.ndarray) -> None:
        """Allocates devices to job j and charges its team."""
        self.state.allocate(j, devices)
        jobs = self.snapshot.jobs
        self.team_usage[int(jobs.team[j]), int(jobs.type_id[j])] += len(devices)
        self.touched[j] = True

    def take(self, j: int, devices: np.ndarray) -> None:
        """Releases devices from job j and credits its team."""
        self.state.release(j, devices)
        jobs = self.snapshot.jobs
        self.team_usage[int(jobs.team[j]), int(jobs.type_id[j])] -= len(devices)
        self.touched[j] = True

    def borrowed_by(self, j: int, d: int) -> int:
        """Returns how many of d more devices for job j would be over its team's quota."""
        jobs = self.snapshot.jobs
        t, k = int(jobs.team[j]), int(jobs.type_id[j])
        room = int(self.snapshot.teams.quota[t, k] - self.team_usage[t, k])
        return max(0, d - max(room, 0))


def _timed(timer, seconds, phase):
    class _Span:
        def __enter__(self):
            self.t0 = timer() if timer else 0.0

        def __exit__(self, *exc):
            if timer:
                seconds[phase] = seconds.get(phase, 0.0) + timer() - self.t0
    return _Span()


def schedule(snapshot: Snapshot, policy: Policy | None = None,
             timer: Callable[[], float] | None = None) -> Plan:
    """Returns the Plan for `snapshot`. Pure and deterministic: same snapshot, same plan."""
    policy = policy or Policy.default()
    seconds: dict[str, float] = {}

    with _timed(timer, seconds, PHASES[0]):
        tick = Tick(snapshot, policy)

    with _timed(timer, seconds, PHASES[2]):
        if policy.drain is not None:
            policy.drain.run(tick)

    with _timed(timer, seconds, PHASES[1]):
        jobs = snapshot.jobs
        pending = np.flatnonzero((jobs.state == PENDING) & ~tick.touched)
        tick.line = policy.order.order(tick, pending)

    for j in tick.line.tolist():
        with _timed(timer, seconds, PHASES[2]):
            placed = _admit(tick, j)
        if placed:
            continue
        if policy.preempt is not None:
            with _timed(timer, seconds, PHASES[3]):
                if policy.preempt.run(tick, j):
                    continue
        if policy.defrag is not None:
            with _timed(timer, seconds, PHASES[5]):
                if policy.defrag.run(tick, j):
                    continue

    if policy.resize is not None:
        with _timed(timer, seconds, PHASES[4]):
            policy.resize.run(tick)

    with _timed(timer, seconds, PHASES[6]):
        plan = _plan(tick)
    if timer:
        plan = Plan(decisions=plan.decisions, waiting=plan.waiting, phase_seconds=seconds)
    return plan


def _admit(tick: Tick, j: int) -> bool:
    """Places job j into idle devices if it fits (within quota, or borrowing); else records why."""
    policy, jobs = tick.policy, tick.snapshot.jobs
    counts = jobs.allowed_counts(j)
    within, borrowing = policy.quota.counts_allowed(tick, j, counts)
    candidates = tuple(sorted(within + borrowing, reverse=True))
    if not candidates:
        tick.waiting[j] = (quota_plugin.REASON_OVER_QUOTA, policy.quota.over_quota_reason(tick, j, counts))
        return False
    found = policy.place.place(tick, j, candidates)
    if found is None:
        tick.waiting[j] = (placement_plugin.REASON_NO_ROOM, policy.place.no_room_reason(tick, j, counts))
        return False
    borrowed = tick.borrowed_by(j, len(found))
    tick.give(j, found.devices)
    reason = policy.place.start_reason(tick, j, found)
    code = placement_plugin.REASON_PLACED
    if borrowed:
        code = quota_plugin.REASON_BORROWING
        reason += f"; {borrowed} of them borrowed over the team's quota (reclaimed first)"
    tick.starts.append(Start(job=j, job_id=int(jobs.ids[j]), devices=tuple(found.devices.tolist()),
                             code=code, reason=reason, borrowed=borrowed))
    tick.waiting.pop(j, None)
    return True


def _plan(tick: Tick) -> Plan:
    """Returns the Plan: releases first, then starts; wait reasons in line order."""
    jobs = tick.snapshot.jobs
    decisions = tuple(tick.releases) + tuple(tick.starts)
    waiting = []
    place = 0
    for j in tick.line.tolist():
        if tick.state.alloc[j] > 0:
            continue
        place += 1
        code, reason = tick.waiting.get(j, ("unknown", "not considered this tick"))
        waiting.append(WaitReason(job=j, job_id=int(jobs.ids[j]), place=place, code=code, reason=reason))
    return Plan(decisions=decisions, waiting=tuple(waiting))
