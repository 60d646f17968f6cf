"""Applying a Plan to a Snapshot: what the control loop does to the database, done on arrays.

Used by the simulator (to advance its world) and by the property test "applying the plan
yields a valid snapshot". It checks every decision as it goes and raises PlanConflict, naming
the decision, if one would give a device twice, use an unusable device, split a gang or
break a job's allowed counts; it never repairs a plan.
"""
from __future__ import annotations

import numpy as np

from protocol.layout import layout_fits
from scheduler.plan import Migrate, Plan, Preempt, Resize, Start
from scheduler.plugins.drain import REASON_LOST_REQUEUED as LOST_CODE
from scheduler.snapshot import NO_JOB, NODE_READY, PENDING, RUNNING, Snapshot


class PlanConflict(ValueError):
    """A decision cannot be applied to the snapshot; the message names it and why."""


def apply_plan(snapshot: Snapshot, plan: Plan, now: float) -> Snapshot:
    """Returns a new Snapshot with the plan's decisions applied in order and `now` set.

    Start / Migrate set the job RUNNING with last_start_time = now; Preempt sets it PENDING
    and clears its approval; Resize changes its devices and sets last_resize_time = now. A Preempt, a live Migrate and a
    Resize checkpoint at a consistent cut, so they set last_checkpoint_time = now (the step is
    the caller's to record); a restart from checkpoint (lost node) does not. Preemptions that
    need approval change nothing (they wait for a capacity manager). Progress (attained
    service) is the caller's to account.
    """
    acc, jobs = snapshot.accelerators, snapshot.jobs
    holder = acc.holder.astype(np.int32).copy()
    state = jobs.state.copy()
    last_start = jobs.last_start_time.copy()
    approved = jobs.preemption_approved.copy()
    checkpointed = jobs.last_checkpoint_time.copy()
    resized = jobs.last_resize_time.copy()
    usable = acc.healthy & (snapshot.node_status[acc.node] == NODE_READY) & \
        ~snapshot.region_drained[acc.region]

    def check_new(decision, devices: np.ndarray, j: int, kept: np.ndarray):
        """Checks devices about to be given to j; `kept` are ones it already held (just freed)."""
        if devices.size == 0:
            raise PlanConflict(f"{decision}: no devices")
        if np.unique(devices).size != devices.size:
            raise PlanConflict(f"{decision}: a device is listed twice")
        if devices.min() < 0 or devices.max() >= len(acc):
            raise PlanConflict(f"{decision}: device index out of range")
        current = holder[devices]
        ok = current == NO_JOB
        if not np.all(ok):
            other = int(current[~ok][0])
            raise PlanConflict(f"{decision}: device {int(devices[~ok][0])} is held by job index {other}")
        fresh = np.setdiff1d(devices, kept)
        if not usable[fresh].all():
            raise PlanConflict(f"{decision}: device {int(fresh[~usable[fresh]][0])} is not usable")
        if (acc.type_id[devices] != jobs.type_id[j]).any():
            raise PlanConflict(f"{decision}: a device is not of the job's type")
        if np.unique(acc.region[devices]).size != 1:
            raise PlanConflict(f"{decision}: devices span regions")
        w, d = int(jobs.world_size[j]), int(devices.size)
        if not layout_fits(w, d) or d < jobs.min_devices[j]:
            raise PlanConflict(f"{decision}: {d} devices is not an allowed count for W={w}")

    for decision in plan.decisions:
        j = decision.job
        if isinstance(decision, Preempt):
            if decision.needs_approval:
                continue
            if state[j] != RUNNING:
                raise PlanConflict(f"{decision}: job is not running")
            holder[holder == j] = NO_JOB
            state[j] = PENDING
            approved[j] = False
            if decision.code != LOST_CODE:
                checkpointed[j] = now
            continue
        devices = np.asarray(decision.devices, dtype=np.int64)
        if isinstance(decision, Start):
            if state[j] != PENDING:
                raise PlanConflict(f"{decision}: job is not pending")
            check_new(decision, devices, j, kept=np.empty(0, np.int64))
            holder[devices] = j
            state[j] = RUNNING
            last_start[j] = now
        elif isinstance(decision, Migrate):
            if state[j] != RUNNING:
                raise PlanConflict(f"{decision}: job is not running")
            current = np.flatnonzero(holder == j)
            holder[current] = NO_JOB
            check_new(decision, devices, j, kept=np.empty(0, np.int64))  # all must be usable
            holder[devices] = j
            last_start[j] = now
            if not decision.from_checkpoint:
                checkpointed[j] = now
        elif isinstance(decision, Resize):
            if state[j] != RUNNING:
                raise PlanConflict(f"{decision}: job is not running")
            current = np.flatnonzero(holder == j)
            if not (np.isin(current, devices).all() or np.isin(devices, current).all()):
                raise PlanConflict(f"{decision}: a resize must keep a subset or superset of its devices")
            holder[current] = NO_JOB
            check_new(decision, devices, j, kept=current)
            holder[devices] = j
            checkpointed[j] = now
            resized[j] = now
        else:
            raise PlanConflict(f"unknown decision {decision!r}")

    new_acc = acc.replace(holder=holder)
    new_jobs = jobs.replace(state=state, last_start_time=last_start, preemption_approved=approved,
                            last_checkpoint_time=checkpointed, last_resize_time=resized)
    return snapshot.replace(accelerators=new_acc, jobs=new_jobs, now=now)
