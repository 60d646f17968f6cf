"""Drain and move: jobs on lost or draining nodes, failed devices or drained regions move.

Runs first in the place phase, before any pending job, because these jobs already hold (or
held) devices and their users expect them to keep running.
  - Lost node or failed device: the job's processes are gone. It restarts from its last
    checkpoint on new devices (Migrate with from_checkpoint=True); if there is no room now,
    it is preempted (its devices are released) and joins the line, where it may preempt
    lower tiers like any job. Premium included: nothing is taken from it that it still has.
  - Draining node or drained region: the job is live-migrated (checkpoint at a consistent
    cut, restore elsewhere). If there is no room it keeps running where it is and is tried
    again next tick (draining waits for room; it never kills).
A job that keeps some devices on healthy nodes (a job spanning hosts, one of which drains or
is lost; a failed device) moves only partly: it keeps those devices and gets as many new ones
as it loses, of its type, in the same topology entity (placement.GangPlacement.replace: its
region, its spread level, the kept nodes first, the fewest nodes). Only when no such partial
placement fits are new devices searched for the whole job: in its own region first, then in
every other region (a move across clusters and regions), with the job's allowed counts up to
its current size, largest first (a move may shrink an elastic job; it never grows one).
Either way the decision is one Migrate with the job's complete new device set; `kept` says how
many of them it already held (the control loop still relaunches every rank from the cut: the
staying hosts' processes are not kept alive, see docs/operator-guide.md).
"""
from __future__ import annotations

import numpy as np

from scheduler.plan import Migrate, Preempt
from scheduler.snapshot import NODE_DRAINING, NODE_LOST, NODE_STATUS_NAMES, TIER_NAMES

NAME = "drain.move_jobs"
REASON_RESTARTED_FROM_CHECKPOINT = "restarted from checkpoint"  # Migrate off a lost node/device
REASON_LOST_REQUEUED = "node lost, requeued"  # Preempt: no room now; back in line
REASON_DRAINED = "moved off draining node"  # Migrate off a draining node / drained region


class DrainAndMove:
    NAME = NAME

    def affected_jobs(self, tick) -> tuple[np.ndarray, np.ndarray]:
        """Returns (jobs whose processes died, jobs that must move live), in tier order."""
        snap, state = tick.snapshot, tick.state
        acc = snap.accelerators
        held = np.flatnonzero(state.holder >= 0)
        status = snap.node_status[acc.node[held]]
        dead = (status == NODE_LOST) | ~acc.healthy[held]
        moving = ((status == NODE_DRAINING) | snap.region_drained[acc.region[held]]) & ~dead
        n = state.n_jobs
        dead_jobs = np.flatnonzero(np.bincount(state.holder[held[dead]], minlength=n) > 0)
        move_jobs = np.flatnonzero(np.bincount(state.holder[held[moving]], minlength=n) > 0)
        move_jobs = np.setdiff1d(move_jobs, dead_jobs)
        jobs = snap.jobs
        order = lambda x: x[np.lexsort((jobs.ids[x], jobs.submit_time[x], jobs.tier[x]))]  # noqa: E731
        return order(dead_jobs), order(move_jobs)

    def run(self, tick) -> None:
        if tick.state.all_usable:
            return  # no lost node, failed device, draining node or drained region: nothing to move
        dead, moving = self.affected_jobs(tick)
        for j in dead.tolist():
            self._move(tick, j, lost=True)
        for j in moving.tolist():
            self._move(tick, j, lost=False)

    def _cause(self, tick, j: int) -> str:
        snap, state = tick.snapshot, tick.state
        devices = state.job_devices(j)
        acc = snap.accelerators
        nodes = np.unique(acc.node[devices])
        for node in nodes.tolist():
            status = int(snap.node_status[node])
            if status != 0:
                name = snap.node_names[node] if snap.node_names else f"node {node}"
                return f"{name} is {NODE_STATUS_NAMES[status]}"
        bad = devices[~acc.healthy[devices]]
        if bad.size:
            return f"device {int(bad[0])} failed"
        region = int(acc.region[devices[0]])
        return f"region {snap.region_names[region]} is drained"

    def _move(self, tick, j: int, lost: bool) -> None:
        snap, jobs = tick.snapshot, tick.snapshot.jobs
        old = tick.state.job_devices(j)
        home = int(snap.accelerators.region[old[0]])
        # its current size or smaller: moving is not the moment to grow (the resize step grows)
        counts = tuple(c for c in jobs.allowed_counts(j) if c <= old.size) or jobs.allowed_counts(j)[-1:]
        cause = self._cause(tick, j)
        keep = old[tick.state.usable[old]]  # on healthy nodes, healthy: stays where it is
        placement = tick.policy.place.replace(tick, j, keep) if keep.size else None
        kept = keep.size if placement is not None else 0
        if placement is None:
            placement = tick.policy.place.place(tick, j, counts, region=home)
        if placement is None:
            placement = tick.policy.place.place(tick, j, counts)
        step = int(jobs.last_checkpoint_step[j])
        if placement is None:
            if not lost:
                return  # keeps running on the draining node; retried next tick
            tick.take(j, old)
            reason = f"{cause}; no room for {min(counts)} {tick.type_name(j)} now; back in line"
            tick.decisions.append(Preempt(job=j, job_id=int(jobs.ids[j]), code=REASON_LOST_REQUEUED,
                                          reason=reason + f", restarts from checkpoint step {step}",
                                          released=tuple(old.tolist())))
            tick.requeued[j] = (REASON_LOST_REQUEUED, reason)
            return
        tick.take(j, old)
        tick.give(j, placement.devices)
        new_region = int(snap.accelerators.region[placement.devices[0]])
        where = snap.region_names[new_region] + ("" if new_region == home else f" (from {snap.region_names[home]})")
        if kept:
            where += f", keeping {kept} it holds on {self._nodes(tick, keep)}"
        if lost:
            code = REASON_RESTARTED_FROM_CHECKPOINT
            reason = f"{cause}; restarts from checkpoint step {step} on {len(placement)} devices in {where}"
        else:
            code = REASON_DRAINED
            reason = f"{cause}; live-migrated to {len(placement)} devices in {where}"
        tick.decisions.append(Migrate(job=j, job_id=int(jobs.ids[j]), devices=tuple(placement.devices.tolist()),
                                      code=code, reason=f"{TIER_NAMES[int(jobs.tier[j])]}: {reason}",
                                      from_checkpoint=lost, restart_step=step if lost else 0, kept=kept))

    @staticmethod
    def _nodes(tick, devices) -> str:
        """Returns "node-a, node-b": the nodes of `devices` by name (index where the snapshot has none)."""
        snap = tick.snapshot
        nodes = np.unique(snap.accelerators.node[devices]).tolist()
        return ", ".join(snap.node_names[n] if snap.node_names else f"node {n}" for n in nodes)
