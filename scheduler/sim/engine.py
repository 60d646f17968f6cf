"""The discrete-event engine: arrivals, completions, checkpoint/restore pauses, node failures
and repairs, and batched scheduling passes.

Time advances from event to event. Between events every running job progresses at a
constant rate (`CostModel.rate`: d/W x splice efficiency, shared among time-sliced jobs),
so a job's finish time is known exactly and sits in a heap until something changes the job
(a resize, a preemption, a new job sharing its devices), which invalidates the old entry
by bumping the job's version.

Scheduling is batched like production ticks: an event that could change a decision (an
arrival, a completion, a failure or repair) marks the engine dirty, and the policy is asked
for a plan at the next multiple of `tick_s`, once for everything that happened since. A
policy may also ask to be woken at a given time (Tiresias when a job crosses a queue
threshold, Meridian while jobs wait). Decisions are applied in order; a decision that breaks
the rules (a device given twice, a size the job does not allow) raises SimulationError,
because that is a bug in the policy, not an event to simulate.

Costs: a preempted job's devices stay busy for its checkpoint time (`free_at`), and a job
started on them begins only when they are free plus its own restore time; a migration
pays checkpoint + transfer + restore; a resize pays the state move of the ranks that change
device. A node failure rolls its jobs back to their last periodic checkpoint and re-queues
them. A job's first allocation pays its start-up (`fidelity.StartupCosts`).

Termination: a job that can never fit the fleet (its smallest size for this policy, W for the
full-size baselines and the elastic floor for a policy that splices, above the most devices
of its accelerator type in one region; or a type the fleet lacks) is rejected when it
arrives and reported (`rejections`), as the production API refuses it at submission. A
replay whose fleet is whole and idle, with no arrival left, where the policy's passes start
nothing, ends: the jobs still waiting are reported as stranded (a policy that cannot place a
job that fits), never waited on forever.

Approvals: a policy asks `request_approval(job)`; `fidelity.ApprovalModel` draws when the
answer comes and whether it is a grant (`approved[job]`) or a denial (`denied[job]`); both
last for the job's current run.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from array import array

import numpy as np

from .costs import CostModel

NOT_ARRIVED, PENDING, RUNNING, DONE, REJECTED = 0, 1, 2, 3, 4

START, PREEMPT, MIGRATE, RESIZE = "start", "preempt", "migrate", "resize"

_FINISH, _PAUSE_END, _REPAIR, _ANSWER = 0, 1, 2, 3

# Passes in a row that start nothing on a whole, idle fleet with no arrival left before the
# waiting jobs are declared stranded (a policy's answer may change with time alone, e.g. age).
STRANDED_AFTER_PASSES = 3


class SimulationError(RuntimeError):
    """A policy made a decision the simulated fleet cannot carry out (a policy bug)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """One action a policy asks for. `devices` are global device indices; `share=True`
    starts the job time-sliced on devices another job holds (Gandiva-like only)."""

    kind: str
    job: int
    devices: np.ndarray | None = None
    reason: str = ""
    share: bool = False


class Policy:
    """What the engine calls. `schedule(engine, now)` returns a list of Decisions; it may
    call `engine.wake_at(t)` to be called again at time t even if nothing happens."""

    name = "policy"
    slots_per_device = 1
    # True for a policy that may run a job on fewer than W devices (down to its elastic floor):
    # what decides whether a job can ever fit.
    runs_below_world_size = False
    # Tiers whose jobs this policy starts only at their full world size even when it runs others
    # below it (Meridian: PolicySettings.full_size_tiers): for them W must fit, not the floor.
    full_size_tiers: tuple = ()

    def schedule(self, engine, now):  # pragma: no cover - interface
        raise NotImplementedError


class Engine:
    def __init__(self, trace, fleet, policy, costs=None, tick_s=60.0, seed=0, until=None,
                 sample_s=None, failures=None, progress=None, progress_every_s=60.0,
                 startup=None, approvals=None):
        """`failures`: an optional list of (time, node) node failures to use instead of the
        seeded random ones (maintenance plans, tests). `startup`: fidelity.StartupCosts (None:
        no start-up); `approvals`: fidelity.ApprovalModel (None: no one answers)."""
        from .fidelity import NEVER

        self.trace = trace
        self.fleet = fleet
        self.policy = policy
        self.costs = costs or CostModel()
        if tick_s < 0:
            raise ValueError("tick_s must be >= 0")
        self.tick_s = float(tick_s)
        self.seed = seed
        self.until = until
        self.progress = progress  # callable(line) for a progress line every progress_every_s of wall time
        self.progress_every_s = progress_every_s
        self.sample_s = float(sample_s if sample_s is not None else max(tick_s, 60.0))

        n = len(trace)
        self.n_jobs = n
        self.W = trace.ranks.astype(np.int64)
        self.work = trace.duration.astype(np.float64)
        self.submit = trace.submit
        self.min_devices = trace.min_devices
        self.checkpoint_gb = trace.checkpoint_gb
        self.startup = startup
        self.startup_s = startup.per_job(trace.ranks) if startup is not None else np.zeros(n)
        self.approvals = approvals or NEVER
        self.approval_rng = np.random.default_rng([seed, 7006])
        self.approved = np.zeros(n, dtype=bool)   # a grant holds for the job's current run
        self.denied = np.zeros(n, dtype=bool)     # a denial holds for the job's current run
        self.asked = np.zeros(n, dtype=bool)      # a request is waiting for its answer
        self.approval_counts = {"requests": 0, "granted": 0, "denied": 0, "dropped": 0}
        self.state = np.zeros(n, dtype=np.int8)
        self.done_work = np.zeros(n)
        self.settle_t = np.zeros(n)
        self.rate = np.zeros(n)
        self.pause_until = np.zeros(n)
        self.ndev = np.zeros(n, dtype=np.int64)
        # A job's first start is when its first devices are its own (its previous holder has
        # finished checkpointing off them) and its start-up begins: the control plane's
        # started_at, which the agent's first running report sets (jobs/workflows.py), not the
        # placement decision; a wait for a victim's checkpoint before that is queueing, as the
        # user sees it. `first_placed` keeps the decision's time (the job's SCHEDULED).
        self.first_start = np.full(n, np.nan)
        self.first_placed = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.last_start = np.full(n, -np.inf)
        self.last_resize = np.full(n, -np.inf)  # when its device count last changed
        self.queued_since = np.zeros(n)
        self.wait_total = np.zeros(n)
        self.attained = np.zeros(n)           # device-seconds held (Tiresias' service)
        self.segment_start = np.zeros(n)      # when the current run segment began
        self.segment_work = np.zeros(n)       # work done when it began (a checkpoint)
        self.needs_restore = np.zeros(n, dtype=bool)
        self.n_preempt = np.zeros(n, dtype=np.int32)
        self.n_migrate = np.zeros(n, dtype=np.int32)
        self.n_resize = np.zeros(n, dtype=np.int32)
        self.n_fail = np.zeros(n, dtype=np.int32)
        self.lost_work = np.zeros(n)
        self.version = np.zeros(n, dtype=np.int64)
        self.contrib = np.zeros(n)             # this job's share of useful_rate
        self.job_devices = [None] * n
        self.pending = {}                      # job -> None, insertion ordered
        self.running = {}
        self.requeued = False                  # a job re-entered pending out of submit order

        self.n_devices = fleet.n_devices
        self.dev_node = fleet.device_node
        self.dev_type = fleet.node_type[self.dev_node]
        self.job_type, self.rejected, self.rejections = self._admission(trace, fleet, policy)
        self.type_node_max = np.zeros(len(fleet.type_names), dtype=np.int64)
        np.maximum.at(self.type_node_max, fleet.node_type, fleet.node_devices)
        self.stranded = np.zeros(n, dtype=bool)
        self._idle_empty_passes = 0
        self.node_first = fleet.node_first_device
        self.owner = np.full(self.n_devices, -1, dtype=np.int64)
        self.owner2 = np.full(self.n_devices, -1, dtype=np.int64)
        self.free_at = np.zeros(self.n_devices)
        self.node_free = fleet.node_devices.astype(np.int64).copy()
        self.node_healthy = np.ones(fleet.n_nodes, dtype=bool)
        self.healthy_devices = self.n_devices
        self.any_shared = False
        self.shared_flag = np.zeros(n, dtype=bool)  # host or guest of a time-sliced pair
        self.guests = {}                       # jobs time-sliced onto another job's devices
        self.spread_jobs = {}                  # jobs spread over more nodes than they need

        self.heap = []
        self.now = 0.0
        self.next_arrival = 0
        self.next_pass = math.inf
        self.allocated = 0           # devices with at least one job
        self.useful_rate = 0.0       # sum of rate x W over running, unpaused jobs
        self.alloc_integral = 0.0
        self.useful_integral = 0.0
        self.last_t = 0.0
        self.samples = {k: array("d") for k in ("t", "allocated", "useful", "pending", "running")}
        self.last_sample = -math.inf
        self.passes = 0
        self.decisions = 0
        self.policy_seconds = 0.0

        self.rng = np.random.default_rng([seed, 7004])
        mtbf = self.costs.node_mtbf_s
        self.fleet_failure_rate = (fleet.n_nodes / mtbf) if mtbf else 0.0
        self.scripted_failures = None
        if failures is not None:
            self.scripted_failures = sorted((float(t), int(node)) for t, node in failures)
            for _, node in self.scripted_failures:
                if not 0 <= node < fleet.n_nodes:
                    raise ValueError(f"scripted failure names node {node}; the fleet has {fleet.n_nodes}")
            self.scripted_failures.reverse()  # pop() takes the earliest
        self.next_failure = self._draw_failure(0.0)
        self.failures = 0

    def _admission(self, trace, fleet, policy):
        """Returns (fleet type id per job, rejected mask, [(job, reason)]): the jobs that can
        never fit this fleet under this policy (see the module docstring)."""
        n = len(trace)
        job_type = np.zeros(n, dtype=np.int16)
        unknown = np.zeros(n, dtype=bool)
        if trace.type_names:
            index = {name: i for i, name in enumerate(fleet.type_names)}
            table = np.array([index.get(name, -1) for name in trace.type_names], dtype=np.int16)
            mapped = table[trace.type_id]
            unknown = mapped < 0
            job_type = np.where(unknown, 0, mapped).astype(np.int16)
        capacity = fleet.region_capacity()[job_type]
        full_size = np.isin(trace.tier, np.asarray(policy.full_size_tiers, dtype=trace.tier.dtype))
        need = (np.where(full_size, trace.ranks, self.min_devices) if policy.runs_below_world_size
                else trace.ranks)
        too_big = need > capacity
        rejected = unknown | too_big
        reasons = []
        for j in np.flatnonzero(rejected).tolist():
            if unknown[j]:
                asked = trace.type_names[int(trace.type_id[j])]
                reasons.append((j, f"asks for accelerator type {asked!r}; the fleet has only "
                                   f"{', '.join(fleet.type_names)}"))
            else:
                size = ("its world size (this policy starts its tier only at full size)" if full_size[j]
                        else "its elastic floor" if policy.runs_below_world_size
                        else "its world size (this policy runs jobs at full size)")
                reasons.append((j, f"needs {int(need[j])} {fleet.type_names[job_type[j]]} devices ({size}, "
                                   f"W={int(trace.ranks[j])}); one region of the fleet has at most "
                                   f"{int(capacity[j])}"))
        return job_type, rejected, reasons

    # ----- views for policies -------------------------------------------------------

    def dev_free_mask(self):
        """Returns a bool array: device holds no job and its node is healthy."""
        return (self.owner < 0) & self.node_healthy[self.dev_node]

    def pending_in_submit_order(self):
        """Returns pending job ids ordered by submit time (then id)."""
        if self.requeued:
            self.pending = dict.fromkeys(sorted(self.pending))
            self.requeued = False
        return self.pending

    def attained_now(self, jobs):
        """Returns device-seconds held so far by each job in `jobs` (int array), up to now."""
        running = self.state[jobs] == RUNNING
        extra = np.where(running, self.ndev[jobs] * (self.now - self.settle_t[jobs]), 0.0)
        return self.attained[jobs] + extra

    def progress_now(self, jobs):
        """Returns the work done so far (ideal seconds at W devices) by each job in `jobs`."""
        start = np.maximum(self.settle_t[jobs], self.pause_until[jobs])
        running = self.state[jobs] == RUNNING
        extra = np.where(running, self.rate[jobs] * np.maximum(0.0, self.now - start), 0.0)
        return np.minimum(self.work[jobs], self.done_work[jobs] + extra)

    def request_approval(self, j):
        """Asks a capacity manager to approve preempting or shrinking running job j; returns
        True when a new request was made (not already asked, granted or denied this run)."""
        if self.state[j] != RUNNING or self.asked[j] or self.approved[j] or self.denied[j]:
            return False
        self.asked[j] = True
        self.approval_counts["requests"] += 1
        delay, deny = self.approvals.draw(self.approval_rng)
        if math.isfinite(delay):
            # The answer carries the run it was asked in (its start time) and the verdict.
            heapq.heappush(self.heap, (self.now + delay, _ANSWER, j, (float(self.last_start[j]), deny)))
        return True

    def _answer(self, j, asked_in):
        run_started, deny = asked_in
        if self.state[j] != RUNNING or self.last_start[j] != run_started:
            self.approval_counts["dropped"] += 1  # the run it was asked for has ended
            return
        self.asked[j] = False
        if deny:
            self.denied[j] = True
            self.approval_counts["denied"] += 1
        else:
            self.approved[j] = True
            self.approval_counts["granted"] += 1
        self._mark_dirty()

    def wake_at(self, t):
        """Asks for a scheduling pass at time t (rounded up to the next tick)."""
        t = max(t, self.now)
        self.next_pass = min(self.next_pass, self._tick_ceil(t))

    # ----- main loop -----------------------------------------------------------------

    def run(self):
        """Runs to the end of the trace (or `until`); returns a SimResult."""
        from .metrics import SimResult  # local: metrics imports nothing from here at load

        started = time.perf_counter()
        cpu_started = time.process_time()
        n = self.n_jobs
        submit = self.submit
        inf = math.inf
        next_report = started + self.progress_every_s
        events = 0
        stopped_early = False
        while True:
            events += 1
            if self.progress is not None and events % 1024 == 0 and time.perf_counter() >= next_report:
                next_report = time.perf_counter() + self.progress_every_s
                done = n - self.next_arrival + (self.next_arrival - len(self.pending) - len(self.running))
                self.progress(
                    f"[{self.policy.name}] wall {time.perf_counter() - started:7.0f} s  sim day "
                    f"{self.now / 86400:7.2f}  arrived {self.next_arrival}/{n}  finished "
                    f"{done - (n - self.next_arrival)}  running {len(self.running)}  pending "
                    f"{len(self.pending)}  passes {self.passes}  policy {self.policy_seconds:.0f} s")
            t_heap = self.heap[0][0] if self.heap else inf
            t_arr = submit[self.next_arrival] if self.next_arrival < n else inf
            t_fail = self.next_failure
            t_pass = self.next_pass
            t = min(t_heap, t_arr, t_fail, t_pass)
            if t == inf or (self.until is not None and t > self.until):
                stopped_early = t != inf
                break
            if not (self.running or self.pending) and t_heap == inf and t_fail < t_arr and t_pass == inf:
                # Idle fleet: failures of empty nodes change nothing the metrics see but
                # keep happening (the repair must still be tracked).
                pass
            self._advance(t)
            if t_heap == t:
                self._pop_heap()
            elif t_fail == t:
                self._fail_node()
            elif t_arr == t:
                self._arrive(self.next_arrival)
                self.next_arrival += 1
            else:
                self._pass()
            if self.next_arrival >= n and not self.pending and not self.running:
                break
            if self._idle_empty_passes >= STRANDED_AFTER_PASSES:
                break  # nothing will ever change: the waiting jobs are stranded
        if not stopped_early and self.next_arrival >= n and not self.running:
            for j in self.pending:
                self.stranded[j] = True
        self._advance(self.now)
        self._sample(force=True)
        result = SimResult.from_engine(self, time.perf_counter() - started)
        result.cpu_s = time.process_time() - cpu_started
        return result

    def _tick_ceil(self, t):
        if self.tick_s <= 0:
            return t
        return math.ceil(t / self.tick_s - 1e-9) * self.tick_s

    def _mark_dirty(self):
        self.wake_at(self.now)

    def _advance(self, t):
        dt = t - self.last_t
        if dt > 0:
            self.alloc_integral += self.allocated * dt
            self.useful_integral += self.useful_rate * dt
            self.last_t = t
        self.now = t
        self._sample()

    def _sample(self, force=False):
        if force or self.now - self.last_sample >= self.sample_s:
            s = self.samples
            s["t"].append(self.now)
            s["allocated"].append(self.allocated)
            s["useful"].append(self.useful_rate)
            s["pending"].append(len(self.pending))
            s["running"].append(len(self.running))
            self.last_sample = self.now

    def _draw_failure(self, after):
        if self.scripted_failures is not None:
            return self.scripted_failures[-1][0] if self.scripted_failures else math.inf
        if not self.fleet_failure_rate:
            return math.inf
        return after + self.rng.exponential(1.0 / self.fleet_failure_rate)

    def _pop_heap(self):
        t, kind, j, ver = heapq.heappop(self.heap)
        if kind == _REPAIR:
            self._repair_node(j)
            return
        if kind == _ANSWER:
            self._answer(j, ver)
            return
        if ver != self.version[j] or self.state[j] != RUNNING:
            return
        if kind == _PAUSE_END:
            self._update_contrib(j)
        else:
            self._complete(j)

    # ----- events --------------------------------------------------------------------

    def _arrive(self, j):
        if self.rejected[j]:
            self.state[j] = REJECTED  # refused at submission: it could never start
            return
        self.state[j] = PENDING
        self.pending[j] = None
        self.queued_since[j] = self.now
        self._mark_dirty()

    def _complete(self, j):
        self._settle(j)
        self.done_work[j] = self.work[j]
        co = self._release(j, self.now)
        self._set_contrib(j, 0.0)
        self.state[j] = DONE
        self.finish[j] = self.now
        del self.running[j]
        for other in co:  # a time-sliced partner runs alone from now
            self._settle(other)
            self._rerate(other)
        self._mark_dirty()

    def _fail_node(self):
        if self.scripted_failures is not None:
            node = self.scripted_failures.pop()[1]
        else:
            node = int(self.rng.integers(self.fleet.n_nodes))
        self.next_failure = self._draw_failure(self.now)
        if not self.node_healthy[node]:
            return
        self.failures += 1
        first = self.node_first[node]
        devs = slice(first, first + self.fleet.node_devices[node])
        victims = set(self.owner[devs][self.owner[devs] >= 0].tolist())
        victims |= set(self.owner2[devs][self.owner2[devs] >= 0].tolist())
        self.node_healthy[node] = False
        self.healthy_devices -= int(self.fleet.node_devices[node])
        for j in sorted(victims):
            self._settle(j)
            checkpoint = self._last_checkpoint_work(j)
            self.lost_work[j] += self.done_work[j] - checkpoint
            self.done_work[j] = checkpoint
            self.n_fail[j] += 1
            self._stop(j, self.now)
        self.node_free[node] = 0
        heapq.heappush(self.heap, (self.now + self.costs.node_repair_s, _REPAIR, node, -1))
        self._mark_dirty()

    def _repair_node(self, node):
        self.node_healthy[node] = True
        self.healthy_devices += int(self.fleet.node_devices[node])
        first = self.node_first[node]
        self.node_free[node] = int((self.owner[first:first + self.fleet.node_devices[node]] < 0).sum())
        self._mark_dirty()

    def _last_checkpoint_work(self, j):
        """Returns the work saved by the job's last periodic checkpoint (every
        periodic_checkpoint_s of run time since its segment began; a segment begins at each
        start, restore, migration or resize, all of which take a checkpoint)."""
        interval = self.costs.periodic_checkpoint_s
        begun = max(self.segment_start[j], 0.0)
        periods = math.floor(max(0.0, self.now - begun) / interval)
        if periods < 1:
            return self.segment_work[j]
        at = begun + periods * interval
        back = self.rate[j] * max(0.0, self.now - max(at, self.pause_until[j]))
        return max(self.segment_work[j], self.done_work[j] - back)

    def _pass(self):
        self.next_pass = math.inf
        self.passes += 1
        began = time.perf_counter()
        decisions = self.policy.schedule(self, self.now)
        self.policy_seconds += time.perf_counter() - began
        for decision in decisions:
            self.apply(decision)
        if decisions or self.running or not self.pending or self.next_arrival < self.n_jobs:
            self._idle_empty_passes = 0
        elif self.healthy_devices == self.n_devices and not (self.free_at > self.now).any():
            self._idle_empty_passes += 1  # a pass on a part-failed fleet proves nothing either way

    # ----- decisions -----------------------------------------------------------------

    def apply(self, d):
        """Carries out one decision at the current time; raises SimulationError if it breaks
        the fleet's rules."""
        self.decisions += 1
        j = int(d.job)
        if not 0 <= j < self.n_jobs:
            raise SimulationError(f"{d.kind} names unknown job {j}")
        if d.kind == START:
            self._start(j, self._checked_devices(d, j), d.share)
        elif d.kind == PREEMPT:
            if self.state[j] != RUNNING:
                raise SimulationError(f"preempt of job {j} which is not running")
            self._settle(j)
            self.n_preempt[j] += 1
            self._stop(j, self.now + self.costs.checkpoint_s(self.checkpoint_gb[j]))
        elif d.kind == MIGRATE:
            self._move(j, d, migrate=True)
        elif d.kind == RESIZE:
            self._move(j, d, migrate=False)
        else:
            raise SimulationError(f"unknown decision kind {d.kind!r}")

    def _checked_devices(self, d, j, moving_from=None):
        devs = np.asarray(d.devices, dtype=np.int64)
        count = devs.shape[0]
        W = int(self.W[j])
        if count < 1 or W % count or count < self.min_devices[j]:
            raise SimulationError(
                f"{d.kind} job {j}: {count} devices is not an allowed size "
                f"(a divisor of W={W} that is >= {int(self.min_devices[j])})")
        # set() over a few dozen ints is ~10x cheaper than np.unique (one call per decision).
        if len(set(devs.tolist())) != count or devs.min() < 0 or devs.max() >= self.n_devices:
            raise SimulationError(f"{d.kind} job {j}: devices repeated or out of range: {devs.tolist()}")
        if not self.node_healthy[self.dev_node[devs]].all():
            raise SimulationError(f"{d.kind} job {j}: a device is on a failed node")
        held = self.owner[devs]
        if d.share:
            if (held < 0).any() or (self.owner2[devs] >= 0).any():
                raise SimulationError(f"share-start job {j}: devices must each hold exactly one job")
        else:
            ok = held < 0
            if moving_from is not None:
                ok |= held == j
            if not ok.all():
                taken = devs[~ok]
                raise SimulationError(
                    f"{d.kind} job {j}: devices {taken.tolist()} are held by jobs "
                    f"{sorted(set(self.owner[taken].tolist()))}")
        return devs

    def _start(self, j, devs, share):
        if self.state[j] != PENDING:
            raise SimulationError(f"start of job {j} which is not pending (state {int(self.state[j])})")
        if self.needs_restore[j]:
            overhead = self.costs.restore_s(self.checkpoint_gb[j])
        else:
            overhead = self.startup_s[j] if math.isnan(self.first_start[j]) else 0.0
        ready = max(self.now, float(self.free_at[devs].max()))
        self.approved[j] = self.denied[j] = self.asked[j] = False  # approvals hold for one run
        del self.pending[j]
        self.running[j] = None
        self.state[j] = RUNNING
        self.wait_total[j] += self.now - self.queued_since[j]
        if math.isnan(self.first_start[j]):
            self.first_start[j] = ready
        if math.isnan(self.first_placed[j]):
            self.first_placed[j] = self.now
        self.last_start[j] = self.now
        self.needs_restore[j] = False
        self.settle_t[j] = self.now
        self.pause_until[j] = ready + overhead
        self.segment_start[j] = self.pause_until[j]
        self.segment_work[j] = self.done_work[j]
        self._acquire(j, devs, share)
        self._rerate(j)
        if share:
            for other in self._co_located(devs, j):
                self._settle(other)
                self._rerate(other)

    def _move(self, j, d, migrate):
        if self.state[j] != RUNNING:
            raise SimulationError(f"{d.kind} of job {j} which is not running")
        devs = self._checked_devices(d, j, moving_from=j)
        self._settle(j)
        gb = self.checkpoint_gb[j]
        old = self.job_devices[j]
        if migrate:
            cost = self.costs.migration_s(gb)
            self.n_migrate[j] += 1
        else:
            moved = np.setdiff1d(devs, old, assume_unique=True).shape[0]
            cost = self.costs.resize_s(gb, moved / devs.shape[0]) if moved else self.costs.resize_s(gb, 0.0)
            self.n_resize[j] += 1
            self.last_resize[j] = self.now
        released_busy_until = self.now + self.costs.checkpoint_s(gb)
        co = self._release(j, released_busy_until)
        ready = max(self.now + cost, float(self.free_at[devs].max()))
        self.pause_until[j] = max(self.pause_until[j], ready)
        self.segment_start[j] = self.pause_until[j]
        self.segment_work[j] = self.done_work[j]
        self.free_at[devs] = np.minimum(self.free_at[devs], self.now)  # its own devices
        self._acquire(j, devs, False)
        self._rerate(j)
        for other in co:
            self._settle(other)
            self._rerate(other)

    def _stop(self, j, free_at):
        """Takes a running job off its devices back to pending (preemption or failure)."""
        if self.now < self.first_start[j]:
            self.first_start[j] = np.nan  # stopped before its devices were ever its own: not started
        co = self._release(j, free_at)
        del self.running[j]
        self.pending[j] = None
        self.requeued = True
        self.state[j] = PENDING
        self.queued_since[j] = self.now
        self.needs_restore[j] = True
        self.version[j] += 1
        self.rate[j] = 0.0
        self._set_contrib(j, 0.0)
        for other in co:
            self._settle(other)
            self._rerate(other)
        self._mark_dirty()

    # ----- bookkeeping ----------------------------------------------------------------

    def _settle(self, j):
        """Brings the job's done work and attained service up to now."""
        now = self.now
        if self.state[j] == RUNNING:
            start = max(self.settle_t[j], self.pause_until[j])
            if now > start:
                self.done_work[j] = min(self.work[j], self.done_work[j] + self.rate[j] * (now - start))
            self.attained[j] += self.ndev[j] * (now - self.settle_t[j])
        self.settle_t[j] = now

    def _rerate(self, j):
        devs = self.job_devices[j]
        share = 1
        if self.any_shared:
            share = 1 + int((self.owner2[devs] >= 0).any())
        speed = self.costs.rate(devs.shape[0], int(self.W[j]), share)
        if devs.shape[0] > 1:
            nodes = len(set(self.dev_node[devs].tolist()))
            # The fewest nodes of the job's type that could hold it (a 2-GPU-node type spreads
            # an 8-device job over 4 nodes by necessity, which is no penalty).
            least = -(-devs.shape[0] // int(self.type_node_max[self.job_type[j]]))
            if nodes > least:
                speed *= self.costs.spread_efficiency
                self.spread_jobs[j] = None
            else:
                self.spread_jobs.pop(j, None)
        self.rate[j] = speed
        self.version[j] += 1
        ver = self.version[j]
        begin = max(self.now, self.pause_until[j])
        remaining = self.work[j] - self.done_work[j]
        heapq.heappush(self.heap, (begin + remaining / speed, _FINISH, j, ver))
        if self.pause_until[j] > self.now:
            heapq.heappush(self.heap, (self.pause_until[j], _PAUSE_END, j, ver))
        self._update_contrib(j)

    def _update_contrib(self, j):
        value = self.rate[j] * self.W[j] if (self.state[j] == RUNNING and self.now >= self.pause_until[j]) else 0.0
        self._set_contrib(j, value)

    def _set_contrib(self, j, value):
        self.useful_rate += value - self.contrib[j]
        self.contrib[j] = value

    def _acquire(self, j, devs, share):
        if share:
            self.owner2[devs] = j
            self.any_shared = True
            self.shared_flag[j] = True
            self.shared_flag[self.owner[devs]] = True
            self.guests[j] = None
        else:
            self.owner[devs] = j
            self.allocated += devs.shape[0]
            if devs.shape[0] == 1:
                self.node_free[self.dev_node[devs[0]]] -= 1
            else:
                np.subtract.at(self.node_free, self.dev_node[devs], 1)
        self.job_devices[j] = devs
        self.ndev[j] = devs.shape[0]

    def _release(self, j, free_at):
        """Takes the job off its devices (which become usable at free_at); returns the jobs
        that time-share those devices and need a new rate."""
        self._settle(j)
        devs = self.job_devices[j]
        self.job_devices[j] = None
        self.ndev[j] = 0
        self.spread_jobs.pop(j, None)
        co = []
        if self.shared_flag[j]:
            second = self.owner2[devs]
            mine_second = second == j
            if mine_second.any():
                self.owner2[devs[mine_second]] = -1
                co = sorted(set(self.owner[devs[mine_second]].tolist()))
                devs = devs[~mine_second]
            if devs.shape[0]:
                promoted = self.owner2[devs]
                has = promoted >= 0
                if has.any():
                    self.owner[devs[has]] = promoted[has]
                    self.owner2[devs[has]] = -1
                    co = sorted(set(co) | set(promoted[has].tolist()))
                    devs = devs[~has]
            self.shared_flag[j] = False
            self.guests.pop(j, None)
            for other in co:
                self.shared_flag[other] = False
                self.guests.pop(other, None)
        if devs.shape[0]:
            self.owner[devs] = -1
            self.allocated -= devs.shape[0]
            self.free_at[devs] = free_at
            nodes = self.dev_node[devs]
            if devs.shape[0] == 1:
                if self.node_healthy[nodes[0]]:
                    self.node_free[nodes[0]] += 1
            else:
                np.add.at(self.node_free, nodes[self.node_healthy[nodes]], 1)
        return [o for o in co if o != j]

    def _co_located(self, devs, j):
        others = set(self.owner[devs].tolist()) | set(self.owner2[devs].tolist())
        others.discard(-1)
        others.discard(j)
        return sorted(others)
