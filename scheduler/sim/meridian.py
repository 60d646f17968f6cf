"""Meridian in the simulator: the production scheduler core, called through its public
interface. Each pass builds a `scheduler.Snapshot` from the engine's arrays, calls
`scheduler.schedule(snapshot, policy)` and hands the Plan's decisions to the engine.
Nothing of the policy lives here: only the translation between the engine's job ids /
device indices and the snapshot's rows, and when to call.

Translation (engine -> Snapshot):
- accelerators: one row per device, in the engine's order (so device indices are the same);
  type, node, rack, cluster, region fixed per fleet and built once; `healthy` from the
  engine's node health; `holder` = the snapshot row of the engine's owner.
- jobs: the pending and running jobs, in job-id order; `attained_device_seconds` = devices x
  seconds held so far; `ideal_device_seconds` = W x (now - submit); last checkpoint = the
  last periodic checkpoint of the run segment (or the preemption that queued it);
  `checkpoint_bytes` from the trace's seeded sizes; `last_resize_time` = the last resize.
  `releasing_until` = the engine's `free_at`: a device a victim still checkpoints on.
- teams: the trace's teams, unlimited quota (the trace has none), decayed past usage kept
  here with the settings' half-life.
- failed nodes are NODE_LOST (their jobs were already re-queued by the engine).

Plan -> engine: Start/Preempt/Migrate/Resize become engine Decisions in plan order; a
Preempt with needs_approval is a request to a capacity manager (`engine.request_approval`,
answered by the engine's `fidelity.ApprovalModel`; the answer reaches the core as
Jobs.preemption_approved / preemption_denied): counted in `approval_requests`, not applied.

When to call: on the engine's batched ticks (arrivals, completions, failures), and every
`wait_wake_s` while jobs wait (time alone changes the core's answer: age, attained
fractions, the no-thrash window). Two passes are skipped without calling the core, because
its plan would be empty: nothing pending and no idle device, or no job below its W and no
spread-out job that the idle devices could hold; or no
idle device while the core's policy has no plugin that takes devices back (preempt,
defragment, drain are all off).
"""
from __future__ import annotations

import math

import numpy as np

import scheduler
from scheduler import placement_cost
from scheduler.snapshot import (
    NODE_LOST,
    NODE_READY,
    Accelerators,
    Jobs,
    PolicySettings,
    Snapshot,
    Teams,
)
from scheduler.snapshot import (
    PENDING as SNAP_PENDING,
)
from scheduler.snapshot import (
    RUNNING as SNAP_RUNNING,
)

from .engine import MIGRATE, PREEMPT, RESIZE, RUNNING, START, Decision, Policy


class Meridian(Policy):
    name = "meridian"
    runs_below_world_size = True  # elastic: a job fits if its floor (min_devices) fits

    @property
    def full_size_tiers(self):
        """The tiers the core starts only at full size (engine.Policy: admission counts W for them)."""
        return self.settings.full_size_tiers

    def __init__(self, core_policy=None, settings=None, wait_wake_s=600.0):
        # The core's default plugins unless told otherwise; built once (plugins are pure).
        self.core_policy = core_policy or scheduler.Policy.default()
        self.settings = settings or PolicySettings()
        self.wait_wake_s = wait_wake_s
        self.approval_requests = 0
        self.plans = 0
        self.skipped = 0
        self.core_seconds = 0.0
        self.last_plan = None
        self._static = None

    def _build_static(self, engine):
        fleet = engine.fleet
        dev_node = engine.dev_node
        self._static = dict(
            type_id=engine.dev_type.astype(np.int16),
            node=dev_node.astype(np.int32),
            rack=fleet.node_rack[dev_node].astype(np.int32),
            cluster=fleet.node_cluster[dev_node].astype(np.int32),
            region=fleet.node_region[dev_node].astype(np.int32),
            region_names=tuple(f"region-{i}" for i in range(int(fleet.node_region.max()) + 1)),
            team_names=tuple(engine.trace.team_names) or ("team-0",),
        )
        self._row_of = np.full(engine.n_jobs + 1, -1, np.int32)  # last entry: owner -1
        self._n_types = len(fleet.type_names)
        self._usage = np.zeros((len(self._static["team_names"]), self._n_types))  # per team and type
        self._usage_t = engine.now
        self._team_alloc = np.zeros_like(self._usage)

    def snapshot(self, engine, now):
        """Returns the Snapshot of the engine's state at `now` (also used by tests)."""
        if self._static is None:
            self._build_static(engine)
        st = self._static
        running = np.fromiter(engine.running, np.int64, len(engine.running))
        pending = np.fromiter(engine.pending, np.int64, len(engine.pending))
        active = np.sort(np.concatenate([running, pending]))
        row_of = self._row_of
        row_of[:-1][active] = np.arange(active.shape[0], dtype=np.int32)
        holder = row_of[engine.owner]
        row_of[:-1][active] = -1

        # Decayed team usage: device-seconds since the last pass at the allocation then held.
        half_life = self.settings.fair_share_half_life_seconds
        dt = max(0.0, now - self._usage_t)
        self._usage = self._usage * 0.5 ** (dt / half_life) + self._team_alloc * dt
        self._usage_t = now
        team = engine.trace.team[active]
        self._team_alloc = np.bincount(team * self._n_types + engine.job_type[active], weights=engine.ndev[active],
                                       minlength=self._usage.size).astype(np.float64).reshape(self._usage.shape)

        state = np.where(engine.state[active] == RUNNING, SNAP_RUNNING, SNAP_PENDING).astype(np.int8)
        interval = engine.costs.periodic_checkpoint_s
        seg = engine.segment_start[active]
        periods = np.floor(np.maximum(0.0, now - seg) / interval)
        last_ckpt = np.where(state == SNAP_RUNNING,
                             np.where(periods >= 1, seg + periods * interval, seg),
                             np.where(engine.needs_restore[active], engine.queued_since[active], -np.inf))
        jobs = Jobs(
            ids=active,
            team=team.astype(np.int32),
            tier=engine.trace.tier[active],
            type_id=engine.job_type[active],
            world_size=engine.W[active].astype(np.int32),
            min_devices=engine.min_devices[active],
            state=state,
            submit_time=engine.submit[active],
            attained_device_seconds=engine.attained_now(active),
            ideal_device_seconds=engine.W[active] * np.maximum(0.0, now - engine.submit[active]),
            last_checkpoint_time=last_ckpt,
            checkpoint_bytes=(engine.checkpoint_gb[active] * 1e9).astype(np.int64),
            last_start_time=engine.last_start[active],
            last_resize_time=engine.last_resize[active],
            preemption_approved=engine.approved[active],  # the engine's approval model (fidelity.py)
            preemption_denied=engine.denied[active],
        )
        healthy_nodes = engine.node_healthy
        accelerators = Accelerators(
            type_id=st["type_id"], node=st["node"], rack=st["rack"], cluster=st["cluster"],
            region=st["region"], healthy=healthy_nodes[engine.dev_node], holder=holder,
            releasing_until=engine.free_at.copy(),  # a victim's devices stay busy for its checkpoint
        )
        return Snapshot(
            accelerators=accelerators, jobs=jobs,
            teams=Teams(names=st["team_names"], decayed_usage=self._usage.copy()),
            now=now, type_names=tuple(engine.fleet.type_names), region_names=st["region_names"],
            node_status=np.where(healthy_nodes, NODE_READY, NODE_LOST).astype(np.int8),
            settings=self.settings,
        )

    def schedule(self, engine, now):
        if self._static is None:
            self._build_static(engine)
        idle = engine.healthy_devices - engine.allocated
        if not engine.pending:
            # idle devices matter only to a job that can grow or that runs spread out (the
            # core moves it onto idle whole nodes: resize.grow_into_idle's repack)
            if idle <= 0 or not (self._anyone_can_grow(engine) or self._anyone_spread(engine, idle)):
                self.skipped += 1
                return []
        elif idle <= 0 and not self._can_reclaim():
            # Every device is held and the core's policy has no plugin that takes devices
            # back (preempt, defragment, drain): every pending job would wait for room.
            self.skipped += 1
            return []
        snap = self.snapshot(engine, now)
        import time as _time

        began = _time.perf_counter()
        plan = scheduler.schedule(snap, self.core_policy)
        self.core_seconds += _time.perf_counter() - began
        self.plans += 1
        self.last_plan = plan
        out = []
        for d in plan.decisions:
            job = int(d.job_id)
            if d.kind == "start":
                out.append(Decision(START, job, np.asarray(d.devices, np.int64), d.reason))
            elif d.kind == "preempt":
                if d.needs_approval:
                    self.approval_requests += engine.request_approval(job)
                    continue
                out.append(Decision(PREEMPT, job, None, d.reason))
            elif d.kind == "migrate":
                out.append(Decision(MIGRATE, job, np.asarray(d.devices, np.int64), d.reason))
            elif d.kind == "resize":
                out.append(Decision(RESIZE, job, np.asarray(d.devices, np.int64), d.reason))
            else:
                raise ValueError(f"the core returned an unknown decision kind {d.kind!r}")
        if len(engine.pending) > sum(1 for d in out if d.kind == START) and math.isfinite(self.wait_wake_s):
            engine.wake_at(now + self.wait_wake_s)
        self._wake_when_movable(engine, now, out)
        return out

    def _wake_when_movable(self, engine, now, decisions):
        """Asks for a pass when the first spread-out job becomes movable (the core's repack
        moves only jobs past min_run_seconds and min_resize_interval_seconds): without an
        arrival or a completion nothing else would call the core then. Counts the jobs this
        pass's Starts and Resizes leave spread out (the engine applies them after this)."""
        s = self.settings
        settle = max(s.min_run_seconds, s.min_resize_interval_seconds)
        for d in decisions:
            if d.kind in (START, RESIZE) and len(d.devices) > 1:
                nodes = len(set(engine.dev_node[d.devices].tolist()))
                if placement_cost.is_spread(len(d.devices), nodes, int(engine.type_node_max[engine.job_type[d.job]])):
                    engine.wake_at(now + settle)
                    break
        if not engine.spread_jobs:
            return
        spread = np.fromiter(engine.spread_jobs, np.int64, len(engine.spread_jobs))
        movable_at = np.maximum(engine.last_start[spread] + s.min_run_seconds,
                                engine.last_resize[spread] + s.min_resize_interval_seconds)
        later = movable_at[movable_at > now]
        if later.size:
            engine.wake_at(float(later.min()))

    def _can_reclaim(self):
        p = self.core_policy
        return any(getattr(p, step, None) is not None for step in ("preempt", "defrag", "drain"))

    @staticmethod
    def _anyone_spread(engine, idle):
        return any(engine.ndev[j] <= idle for j in engine.spread_jobs)

    @staticmethod
    def _anyone_can_grow(engine):
        running = np.fromiter(engine.running, np.int64, len(engine.running))
        return bool((engine.ndev[running] < engine.W[running]).any())
