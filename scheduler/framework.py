"""One scheduling tick, in numbered phases (kueue `schedule()`, kube-scheduler framework):

  1. snapshot    derive the working state: free devices per node/rack/cluster/region and
                 type, per-job allocations, team usage, borrowers
  2. order       put pending jobs in line (tier, fair share, age)
  3. place       move jobs off lost/draining nodes and drained regions, then for each job in
                 line find all its devices at once (gang, topology-packed)
  4. preempt     a job that does not fit may shrink, then preempt, cheaper lower-tier jobs
  5. resize      grow elastic jobs into the devices still idle (work conservation); a job
                 below W that comes before pending jobs in line grows before them, at its
                 place in line (its missing devices are demand like theirs)
  6. defragment  a gang that fails only because free devices are scattered gets a node or
                 rack freed by migrating small jobs
  7. plan        list the decisions in the order made (a release always precedes the start
                 that uses its devices) and give every pending job a
                 wait reason and its place in line

Phases 4 and 6 run inline for the job at the head of the line (as kueue does), so that a
preemption is decided while the capacity it frees is still there; their time is added to
their own phase. The core reads no clock: pass `timer` (e.g. time.perf_counter) to get
`Plan.phase_seconds`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from scheduler import placement_cost
from scheduler.plan import Plan, Preempt, Start, WaitReason
from scheduler.plugins import REGISTRY
from scheduler.plugins import placement as placement_plugin
from scheduler.plugins import quota as quota_plugin
from scheduler.snapshot import PREMIUM, TIER_NAMES, UNLIMITED, Snapshot, allowed_counts, las_queue
from scheduler.state import POOL_RELEASING, POOL_RESERVE, Placement, WorkingState

PHASES = ("1. snapshot", "2. order", "3. place", "4. preempt", "5. resize", "6. defragment", "7. plan")


# The plugin interfaces, one small one per step (kube-scheduler's FilterPlugin, ScorePlugin):
# what `schedule` and the other plugins call on each. The plugins in scheduler/plugins satisfy
# them by shape; nothing needs to inherit from them.
class OrderPlugin(Protocol):
    def order(self, tick: Tick, jobs: np.ndarray) -> np.ndarray:
        """Returns the job indices `jobs` in the order they are served (2. order; resize reuses it)."""
        ...


class QuotaPlugin(Protocol):
    def counts_allowed(self, tick: Tick, j: int, counts: Sequence[int]) -> tuple[tuple, tuple]:
        """Returns (counts within quota, counts only by borrowing) of `counts` for job j."""
        ...

    def over_quota_reason(self, tick: Tick, j: int, counts: Sequence[int]) -> str:
        """Returns why none of `counts` is allowed (the wait reason of a job over quota)."""
        ...


class PlacePlugin(Protocol):
    def place(self, tick: Tick, j: int, counts: Sequence[int], region: int | None = None,
              blocked_nodes: np.ndarray | None = None) -> Placement | None:
        """Returns where job j fits with one of `counts` devices (largest first), or None; changes nothing."""
        ...

    def replace(self, tick: Tick, j: int, keep: np.ndarray) -> Placement | None:
        """Returns job j's devices `keep` plus new ones for the rest it holds (3. place: drain, a
        partial move off a leaving node), or None when that does not fit; changes nothing."""
        ...

    def start_reason(self, tick: Tick, j: int, placement: Placement) -> str:
        """Returns the reason of the Start that places job j at `placement`."""
        ...

    def no_room_reason(self, tick: Tick, j: int, counts: Sequence[int]) -> str:
        """Returns why job j fits nowhere with any of `counts` (its wait reason)."""
        ...


class JobStepPlugin(Protocol):
    def run(self, tick: Tick, j: int) -> bool:
        """Makes room for job j, the head of the line, that did not fit (4. preempt, 6. defragment);
        returns True when it placed j."""
        ...


class TickStepPlugin(Protocol):
    def run(self, tick: Tick) -> None:
        """Acts once per tick on every job it concerns (3. place: drain; 5. resize)."""
        ...


@dataclass(frozen=True)
class Policy:
    """Which plugin does each step; None switches a step off (baselines do that)."""

    order: OrderPlugin
    quota: QuotaPlugin
    place: PlacePlugin
    preempt: JobStepPlugin | None = None
    resize: TickStepPlugin | None = None
    defrag: JobStepPlugin | None = None
    drain: TickStepPlugin | None = None

    @classmethod
    def from_names(cls, **names) -> "Policy":
        """Returns a Policy from registry names, e.g. Policy.from_names(order="order.fifo", ...).

        Steps not named get the default plugin; a step named None is switched off.
        Raises KeyError naming the unknown plugin and the known ones.
        """
        chosen = dict(DEFAULT_PLUGIN_NAMES)
        chosen.update(names)
        # which interface a plugin serves follows from the step it is named for, not from a type
        # mypy can see in REGISTRY (a dict of mixed factories); Policy's fields state each one
        plugins: dict[str, Any] = {}
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
    "preempt": "preempt.sla_cost_aware",
    "resize": "resize.grow_into_idle",
    "defrag": "defrag.free_a_domain",
    "drain": "drain.move_jobs",
}


class Tick:
    """The working context of one tick: snapshot, working state, running totals, decisions.

    Decisions are recorded in the order the tick makes them; applying them in that order
    replays exactly the state changes the tick planned on, so a device is never given twice.
    """

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
        self.decisions: list = []  # Start / Preempt / Migrate / Resize, in the order made
        self.waiting: dict[int, tuple[str, str]] = {}  # pending job -> (code, reason)
        self.requeued: dict[int, tuple[str, str]] = {}  # job sent back to line -> (code, reason)
        self.line: np.ndarray = np.empty(0, np.int64)  # pending jobs in order
        self.victims_used = 0  # jobs preempted or shrunk so far (PolicySettings budget)
        self.migrations_used = 0  # defragmentation moves so far (PolicySettings budget)
        self.spread_ok: set[int] = set()  # packed-tier jobs allowed a spread placement (no packed one)
        self.approval_asked: set[int] = set()  # jobs already named in a needs_approval Preempt
        self.approval_waiters: dict[int, set] = {}  # victim -> jobs waiting for its approval
        self.releases = 0  # devices released so far (a failed search stays failed until this moves)
        self.failed: dict[tuple, tuple[int, int, str]] = {}  # search key -> (size, releases, why)
        held = self.state.holder >= 0
        usable_held = self.state.holder[held & self.state.usable]
        # devices each job holds that are usable (what preempting it would give back)
        self.usable_alloc = np.bincount(usable_held, minlength=len(jobs)).astype(np.int64)
        self._search_team: np.ndarray | None = None  # Tick.search_team, for every job
        self._min_count: np.ndarray | None = None
        self._floor_count: np.ndarray | None = None
        self._packed_level: dict = {}  # (W, type, max_spread) -> level, for Tick.spread

    # --- bookkeeping used by every plugin ------------------------------------------------
    def give(self, j: int, devices: np.ndarray) -> None:
        """Allocates devices to job j and charges its team."""
        self.state.allocate(j, devices)
        jobs = self.snapshot.jobs
        self.team_usage[int(jobs.team[j]), int(jobs.type_id[j])] += len(devices)
        self.touched[j] = True

    def take(self, j: int, devices: np.ndarray) -> None:
        """Releases devices from job j and credits its team."""
        self.releases += 1
        self.state.release(j, devices)
        jobs = self.snapshot.jobs
        self.team_usage[int(jobs.team[j]), int(jobs.type_id[j])] -= len(devices)
        self.touched[j] = True

    def search_team(self, jobs_idx: np.ndarray) -> np.ndarray:
        """Returns per job what its team means to a search for room: the team, or -1 where no job
        of the tick borrows and the team's quota of the job's type never binds (reclaiming needs
        a borrower and every count is within quota, so any such team searches alike)."""
        if self._search_team is None:
            jobs = self.snapshot.jobs
            team = jobs.team.astype(np.int64)
            if not self.borrower.any():
                unbound = self.snapshot.teams.quota[team, jobs.type_id] >= UNLIMITED // 2
                team = np.where(unbound, -1, team)
            self._search_team = team
        return self._search_team[jobs_idx]

    def borrowed_by(self, j: int, d: int) -> int:
        """Returns how many of d more devices for job j would be over its team's quota."""
        jobs = self.snapshot.jobs
        t, k = int(jobs.team[j]), int(jobs.type_id[j])
        room = int(self.snapshot.teams.quota[t, k] - self.team_usage[t, k])
        return max(0, d - max(room, 0))

    def mark(self):
        """Returns a point to roll a tentative step back to (preemption, defragmentation)."""
        return (self.state.mark(), len(self.decisions), self.team_usage.copy(), self.touched.copy(),
                self.victims_used, self.migrations_used, dict(self.requeued))

    def rollback(self, mark) -> None:
        state_mark, n_decisions, usage, touched, victims, migrations, requeued = mark
        self.state.rollback(state_mark)
        del self.decisions[n_decisions:]
        self.team_usage, self.touched = usage, touched
        self.victims_used, self.migrations_used, self.requeued = victims, migrations, requeued

    def known_failure(self, key: tuple, size: int) -> str | None:
        """Returns why a search for `size` under `key` must fail, if an earlier one proved it.

        Within a tick, free devices only shrink and victims only get fewer until something is
        released, so a search that failed for size d fails for any size >= d until then.
        """
        failed = self.failed.get(key)
        if failed is not None and size >= failed[0] and failed[1] == self.releases:
            return failed[2]
        return None

    def remember_failure(self, key: tuple, size: int, why: str) -> None:
        failed = self.failed.get(key)
        if failed is None or failed[1] != self.releases or size < failed[0]:
            self.failed[key] = (size, self.releases, why)

    # --- small derivations -----------------------------------------------------------------
    @property
    def min_count(self) -> np.ndarray:
        """Returns int64[J]: each job's smallest allowed device count (computed once)."""
        if self._min_count is None:
            jobs = self.snapshot.jobs
            pairs = jobs.world_size.astype(np.int64) * (1 << 32) + jobs.min_devices
            unique, inverse = np.unique(pairs, return_inverse=True)
            smallest = np.array([min(allowed_counts(int(p >> 32), int(p & 0xFFFFFFFF))) for p in unique],
                                np.int64)
            self._min_count = smallest[inverse] if unique.size else np.zeros(0, np.int64)
        return self._min_count

    @property
    def floor_count(self) -> np.ndarray:
        """Returns int64[J]: the fewest devices each job may run on (start, restart, or be shrunk
        to): min_count, raised for a tier in PolicySettings.floor_speed_tiers to the smallest
        count that keeps the tier's SLA floor speed (computed once)."""
        if self._floor_count is None:
            jobs, settings = self.snapshot.jobs, self.snapshot.settings
            out = self.min_count.copy()
            floor = np.flatnonzero(np.isin(jobs.tier, settings.floor_speed_tiers))
            if floor.size:
                # run_counts reads only W, min_devices and the type: once per distinct triple
                triple = ((jobs.world_size[floor].astype(np.int64) << 40)
                          | (jobs.min_devices[floor].astype(np.int64) << 16) | jobs.type_id[floor].astype(np.int64))
                _, first, inverse = np.unique(triple, return_index=True, return_inverse=True)
                smallest = np.array([min(self.run_counts(int(floor[i]))) for i in first.tolist()], np.int64)
                out[floor] = smallest[inverse]
            self._floor_count = out
        return self._floor_count

    def run_counts(self, j: int) -> tuple[int, ...]:
        """Returns the device counts job j may run on, largest first: its allowed counts, less
        those too slow for its SLA floor if its tier is in PolicySettings.floor_speed_tiers
        (unless no region holds that many devices of its type: then all its allowed counts)."""
        jobs, settings = self.snapshot.jobs, self.snapshot.settings
        counts = jobs.allowed_counts(j)
        if int(jobs.tier[j]) in settings.floor_speed_tiers:
            fast = placement_cost.counts_at_speed(int(jobs.world_size[j]), counts, settings.standard_sla_floor)
            # a job whose floor-speed counts no region can hold runs below its floor rather than never
            if min(fast) <= int(self.state.capacity[3][:, int(jobs.type_id[j])].max(initial=0)):
                return fast
        return counts

    def start_counts(self, j: int) -> tuple[int, ...]:
        """Returns the device counts pending job j may start on, largest first: `run_counts`,
        or only W if its tier is in PolicySettings.full_size_tiers."""
        jobs = self.snapshot.jobs
        if int(jobs.tier[j]) in self.snapshot.settings.full_size_tiers:
            return (int(jobs.world_size[j]),)
        return self.run_counts(j)

    def spread(self, j: int) -> int:
        """Returns the loosest level job j's devices may span when it is placed: its max_spread,
        or, if its tier is in PolicySettings.packed_tiers, the tightest level where some entity
        has W usable devices of its type (one node if a node is that big), if that is tighter.
        A spread-out gang runs slower (its collectives cross nodes), which alone breaks a
        95%-of-ideal SLA, so such a job waits for (or preempts for) a packed place instead."""
        jobs = self.snapshot.jobs
        spread = int(jobs.max_spread[j])
        if int(jobs.tier[j]) not in self.snapshot.settings.packed_tiers:
            return spread
        key = (int(jobs.world_size[j]), int(jobs.type_id[j]), spread)
        level = self._packed_level.get(key)
        if level is None:
            w, k = key[0], key[1]
            level = next((lv for lv in range(spread) if self.state.capacity[lv][:, k].max(initial=0) >= w), spread)
            self._packed_level[key] = level
        return level

    def releasing_note(self, devices: np.ndarray) -> tuple[float, str]:
        """Returns (starts_at, reason suffix) for a job given `devices`: the time the last of
        them stops being released (Snapshot.now if all are free now) and, if that is later
        than now, "; starting after the previous holder's checkpoint, in N s"."""
        now = self.snapshot.now
        if self.state.releasing.size == 0 or len(devices) == 0:
            return now, ""
        until = float(self.snapshot.accelerators.releasing_until[devices].max())
        if until <= now:
            return now, ""
        return until, f"; starting after the previous holder's checkpoint, in {until - now:.0f} s"

    def job_label(self, j: int) -> str:
        """Returns "job a (Premium)" for reasons."""
        jobs = self.snapshot.jobs
        return f"job {jobs.name(j)} ({TIER_NAMES[int(jobs.tier[j])]})"

    def type_name(self, j: int) -> str:
        return self.snapshot.type_names[int(self.snapshot.jobs.type_id[j])]

    def region_of_job(self, j: int) -> int:
        """Returns the region of the devices job j holds now (-1 if none)."""
        devices = self.state.job_devices(j)
        return int(self.snapshot.accelerators.region[devices[0]]) if devices.size else -1

    def lost_work_seconds(self, jobs_idx: np.ndarray) -> np.ndarray:
        """Returns device-seconds of progress since the last checkpoint (or start) per job."""
        jobs = self.snapshot.jobs
        since = np.maximum(jobs.last_checkpoint_time[jobs_idx], jobs.last_start_time[jobs_idx])
        age = np.where(np.isfinite(since), np.maximum(self.snapshot.now - since, 0.0), 1e12)
        return age * self.state.alloc[jobs_idx]


class _PhaseTimer:
    """Adds the time spent inside `with timer.phase(name):` to seconds[name]; free if no timer."""

    def __init__(self, timer):
        self.timer, self.seconds, self.name, self.t0 = timer, {}, None, 0.0

    def phase(self, name):
        self.name = name
        return self

    def __enter__(self):
        if self.timer:
            self.t0 = self.timer()

    def __exit__(self, *exc):
        if self.timer:
            self.seconds[self.name] = self.seconds.get(self.name, 0.0) + self.timer() - self.t0


def schedule(snapshot: Snapshot, policy: Policy | None = None,
             timer: Callable[[], float] | None = None) -> Plan:
    """Returns the Plan for `snapshot`. Pure and deterministic: same snapshot, same plan."""
    policy = policy or Policy.default()
    clock = _PhaseTimer(timer)

    with clock.phase(PHASES[0]):
        tick = Tick(snapshot, policy)

    with clock.phase(PHASES[2]):
        if policy.drain is not None:
            policy.drain.run(tick)

    with clock.phase(PHASES[1]):
        # pending jobs, plus running jobs the drain step sent back to line (lost nodes)
        pending = np.flatnonzero(tick.state.alloc == 0)
        tick.line = policy.order.order(tick, pending)
        # running jobs below W that come before some pending job grow at their place in line
        growers = _growers_in_line(tick)

    # A job that fails to start leaves the tick as it found it (`_stamp`: no device given or
    # taken, no decision, no budget spent, no approval waited for); the next job alike in
    # everything the search reads fails the same way with the same reason, so it is told that
    # reason without searching again. Alike jobs are runs of one key id (`_failure_keys`); a
    # key that failed under the current stamp is dead until the stamp moves, and a stretch of
    # the line holding only dead keys is told its reasons at once (`_fail_alike`).
    line = tick.line.tolist()
    key_of = _failure_keys(tick, tick.line)
    dead = np.zeros(int(key_of.max(initial=-1)) + 1, np.bool_)  # key id -> failed under dead_stamp
    dead_reason: dict[int, tuple[str, str]] = {}
    dead_stamp = None
    n, pos = len(line), 0
    while pos < n:
        if growers:
            with clock.phase(PHASES[4]):
                _grow_ahead_of(tick, growers, pos)
        stamp = _stamp(tick)
        if dead_reason:
            if stamp != dead_stamp:
                dead[list(dead_reason)] = False
                dead_reason.clear()
            elif dead[key_of[pos]]:
                live = np.flatnonzero(~dead[key_of[pos:]])
                end = pos + int(live[0]) if live.size else n
                with clock.phase(PHASES[2]):
                    _fail_alike(tick, line[pos:end], key_of[pos:end].tolist(), dead_reason)
                pos = end
                continue  # the releasing pool is closed: every job's steps end by closing it
        j = line[pos]
        with clock.phase(PHASES[2]):
            placed = _admit(tick, j)
        if not placed and policy.preempt is not None:
            with clock.phase(PHASES[3]):
                placed = policy.preempt.run(tick, j)
        if not placed and policy.defrag is not None:
            with clock.phase(PHASES[5]):
                placed = policy.defrag.run(tick, j)
        if not placed and int(snapshot.jobs.tier[j]) in snapshot.settings.packed_tiers:
            if snapshot.settings.packed_tiers_may_spread:
                # no packed place, even by preempting or moving others: spread out rather than wait
                with clock.phase(PHASES[2]):
                    tick.spread_ok.add(j)
                    before = tick.waiting.get(j)
                    if not _admit(tick, j) and before is not None:
                        tick.waiting[j] = before
            elif j in tick.waiting:
                code, reason = tick.waiting[j]
                tick.waiting[j] = (code, reason + _WAITS_PACKED)
        if not placed and j in tick.waiting and stamp == _stamp(tick):
            key = int(key_of[pos])
            dead[key] = True
            dead_reason[key] = tick.waiting[j]
            dead_stamp = stamp
        # The next job tries devices free now first again. The Premium reserve stays open for a
        # next Premium job (its _admit closes it for any other): opening it counts every reserve
        # device in, and closing it out, which per Premium admission dominated the first
        # placement of a large fleet; the counts a job sees are the same either way.
        tick.state.close_pools(names=(POOL_RELEASING,))
        pos += 1
    tick.state.close_pools()

    if tick.decisions and tick.waiting:
        with clock.phase(PHASES[2]):
            _backfill(tick)

    if policy.resize is not None:
        with clock.phase(PHASES[4]):
            policy.resize.run(tick)

    with clock.phase(PHASES[6]):
        plan = _plan(tick)
    if timer:
        plan = Plan(decisions=plan.decisions, waiting=plan.waiting, phase_seconds=clock.seconds)
    return plan


def _growers_in_line(tick: Tick) -> list[tuple[int, int]]:
    """Returns the running jobs below W that may grow now into devices free at the start of the
    line, each with how many pending jobs of the line come before it in the order plugin's order
    (tier, attained-service queue, fair share, age), last first (a stack for `_grow_ahead_of`).

    A job shrunk for another, or started below W, used to grow only into the devices still idle
    after every pending job was placed: on a busy fleet a long job shrunk to W/4 for an arrival
    stayed there for days while younger jobs of its own tier and queue took every device that
    freed (issue 16: the Philly makespan job ran 1.35 d on one of its four devices). Its missing
    devices are demand at its place in line, as a pending job's are."""
    # a resize plugin that offers a per-job step (resize.grow_into_idle's growers and grow_one)
    growers_of = getattr(tick.policy.resize, "growers", None)
    if growers_of is None or getattr(tick.policy.resize, "grow_one", None) is None or tick.line.size == 0:
        return []
    free_by_type = tick.state.free_count[3].sum(axis=0)
    if not free_by_type.any():
        return []
    growers = growers_of(tick)
    growers = growers[free_by_type[tick.snapshot.jobs.type_id[growers]] > 0]
    if growers.size == 0:
        return []
    ordered = tick.policy.order.order(tick, np.concatenate([tick.line, growers]))
    is_grower = np.zeros(tick.state.n_jobs, np.bool_)
    is_grower[growers] = True
    grows = is_grower[ordered]
    pending = (~grows).astype(np.int64)
    ahead = np.cumsum(pending) - pending  # pending jobs before each position
    out = list(zip(ahead[grows].tolist(), ordered[grows].tolist()))
    # a grower after the whole line grows in the resize phase, as before
    return [(a, g) for a, g in out if a < tick.line.size][::-1]


def _grow_ahead_of(tick: Tick, growers: list[tuple[int, int]], pos: int) -> None:
    """Grows, in order, the jobs of `growers` (a stack, `_growers_in_line`) that come before the
    pos-th pending job of the line, into devices free now (never the Premium reserve or devices
    still being released: pools are closed first)."""
    grow_one = getattr(tick.policy.resize, "grow_one", None)
    if grow_one is None:
        return
    while growers and growers[-1][0] <= pos:
        _, g = growers.pop()
        if tick.touched[g] or tick.state.alloc[g] == 0:
            continue  # shrunk or preempted for a job placed earlier in this tick
        tick.state.close_pools()
        grow_one(tick, g, why=REASON_GREW_IN_LINE)


def _stamp(tick: Tick) -> tuple:
    """Returns what changes whenever a job's steps leave a trace in the tick: the holdings'
    version, the decisions and budgets used, the jobs waiting on an approval (a job waiting on a
    victim already asked about adds itself there and nothing else)."""
    waiters = sum(len(w) for w in tick.approval_waiters.values()) if tick.approval_waiters else 0
    return (tick.state.version, len(tick.decisions), tick.victims_used, tick.migrations_used, waiters)


def _failure_keys(tick: Tick, line: np.ndarray) -> np.ndarray:
    """Returns int64[len(line)]: per job of `line`, a key id that two jobs share exactly when
    their searches for room read the same of the job itself: tier, type, team (quota,
    borrowing), world size and floor (its counts, its packed spread), max_spread and
    attained-service queue (whom it may preempt)."""
    if line.size == 0:
        return np.zeros(0, np.int64)
    jobs, settings = tick.snapshot.jobs, tick.snapshot.settings
    queue = las_queue(jobs.attained_device_seconds[line], settings)
    columns = (jobs.tier[line], jobs.type_id[line], tick.search_team(line), jobs.world_size[line],
               jobs.min_devices[line], jobs.max_spread[line], queue)
    index: dict[tuple, int] = {}
    return np.array([index.setdefault(key, len(index)) for key in zip(*(c.tolist() for c in columns))], np.int64)


def _fail_alike(tick: Tick, js: list[int], keys: list[int], reasons: dict[int, tuple[str, str]]) -> None:
    """Records for jobs `js` (a stretch of the line) the failures of the jobs alike that met them
    in the same state (`schedule`; reasons by key id): each one's wait reason, and what that job's
    steps left behind: a packed-tier job allowed to spread, and the Premium reserve opened (a
    Premium job) or closed (any other, as `_admit` does); the last job's choice is what stays."""
    tick.waiting.update(zip(js, [reasons[k] for k in keys]))
    tiers = tick.snapshot.jobs.tier
    packed = tick.snapshot.settings.packed_tiers
    if packed and tick.snapshot.settings.packed_tiers_may_spread:
        tick.spread_ok.update(j for j in js if int(tiers[j]) in packed)
    if int(tiers[js[-1]]) == PREMIUM:
        tick.state.open_pool(POOL_RESERVE)
    else:
        tick.state.close_pools(names=(POOL_RESERVE,))


def _admit(tick: Tick, j: int) -> bool:
    """Places job j into idle devices if it fits (within quota, or borrowing); else records why.

    Devices free now are tried first; only if the job does not fit in them are the devices
    still being released counted too (the state keeps them counted until the caller closes
    them again, so a preemption for j does not take more victims than needed). The devices
    kept for Premium arrivals (PolicySettings.premium_reserve_devices) count for Premium jobs
    only.
    """
    policy, jobs = tick.policy, tick.snapshot.jobs
    counts = tick.start_counts(j)
    within, borrowing = policy.quota.counts_allowed(tick, j, counts)
    candidates = tuple(sorted(within + borrowing, reverse=True))
    if not candidates:
        tick.waiting[j] = (quota_plugin.REASON_OVER_QUOTA, policy.quota.over_quota_reason(tick, j, counts))
        return False
    state = tick.state
    premium = int(jobs.tier[j]) == PREMIUM
    if premium:
        state.open_pool(POOL_RESERVE)  # already open after a Premium job: nothing to do
    else:
        state.close_pools(names=(POOL_RESERVE,))
    found = policy.place.place(tick, j, candidates)
    if found is None and state.open_pool(POOL_RELEASING):
        found = policy.place.place(tick, j, candidates)
    if found is None:
        reason = policy.place.no_room_reason(tick, j, counts)
        if not premium and state.reserve.size:
            reason += (f"; {state.reserve.size} idle devices are kept for Premium arrivals "
                       f"(premium_reserve_devices)")
        tick.waiting[j] = (placement_plugin.REASON_NO_ROOM, reason)
        return False
    borrowed = tick.borrowed_by(j, len(found))
    tick.give(j, found.devices)
    reason = policy.place.start_reason(tick, j, found)
    code = placement_plugin.REASON_PLACED
    if borrowed:
        code = quota_plugin.REASON_BORROWING
        reason += f"; {borrowed} of them borrowed over the team's quota (reclaimed first)"
    starts_at, note = tick.releasing_note(found.devices)
    tick.decisions.append(Start(job=j, job_id=int(jobs.ids[j]), devices=tuple(found.devices.tolist()),
                             code=code, reason=reason + note, borrowed=borrowed, starts_at=starts_at))
    tick.waiting.pop(j, None)
    return True


REASON_GREW_IN_LINE = "its place in line comes before the pending jobs that could take them"

_WAITS_PACKED = ("; it waits for a packed place rather than miss its SLA spread out "
                 "(MERIDIAN_PACKED_TIERS_MAY_SPREAD=1 lets it spread)")


def _backfill(tick: Tick) -> None:
    """Offers devices that preemptions and moves left over to the jobs still waiting, in line order.

    A victim larger than what its preemptor needed leaves devices idle that a job earlier in
    line could use; without this pass they would idle until the next tick. A job placed here
    no longer needs the approvals it asked for, so its needs_approval requests are withdrawn
    unless another waiting job needs the same victim.
    """
    # the jobs still waiting, in line order, and the fewest devices each could start on; a job
    # is tried only while its type has that many free (free devices change only when one starts)
    line = tick.line[tick.state.alloc[tick.line] == 0]
    line = line[np.fromiter((j in tick.waiting for j in line.tolist()), np.bool_, line.size)]
    type_of, floor = tick.snapshot.jobs.type_id[line], tick.floor_count[line]
    placed = set()
    pos = 0
    while pos < line.size:
        free_by_type = tick.state.free_count[3].sum(axis=0)
        tried = np.flatnonzero(free_by_type[type_of[pos:]] >= floor[pos:])
        if not tried.size:
            break
        pos += int(tried[0])
        j = int(line[pos])
        pos += 1
        before = tick.waiting[j]
        admitted = _admit(tick, j)
        tick.state.close_pools()
        if admitted:
            placed.add(j)
        else:
            tick.waiting[j] = before
    if placed and tick.approval_waiters:
        withdrawn = {v for v, waiters in tick.approval_waiters.items() if waiters and waiters <= placed}
        if withdrawn:
            tick.decisions = [d for d in tick.decisions
                              if not (isinstance(d, Preempt) and d.needs_approval and d.job in withdrawn)]


def _plan(tick: Tick) -> Plan:
    """Returns the Plan: decisions in the order made; every pending job's reason and place."""
    jobs, line = tick.snapshot.jobs, tick.line
    waiting_js = line[tick.state.alloc[line] == 0].tolist()
    get, requeued = tick.waiting.get, tick.requeued
    unconsidered = ("not considered", "not considered this tick")
    why = [get(j) or requeued.get(j) or unconsidered for j in waiting_js]
    # jobs preempted this tick join the end of the line; the next tick orders them
    if requeued:
        in_line = set(line.tolist())
        for j, reason in requeued.items():
            if j not in in_line and tick.state.alloc[j] == 0:
                waiting_js.append(j)
                why.append(reason)
    ids = jobs.ids[np.asarray(waiting_js, np.int64)].tolist()
    return Plan(decisions=tuple(tick.decisions),
                waiting=tuple(WaitReason(j, job_id, place, code, reason) for place, (j, job_id, (code, reason))
                              in enumerate(zip(waiting_js, ids, why), 1)))
