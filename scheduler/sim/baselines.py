"""The baseline policies, run by the same engine as Meridian.

- FIFO: gang scheduling in submit order, no preemption, no backfill: the job at the head of
  the line waits until all of its W devices are free together, and the jobs behind it wait
  too (head-of-line blocking, like a plain batch queue).
- Tiresias (Gu et al., NSDI'19), discretized two-dimensional least-attained-service: a job's
  service is devices x time it has held; queues split at `thresholds` device-seconds
  (defaults 1 and 10 GPU-hours); lower queues first, submit order inside a queue. Each pass
  the highest-priority jobs that fit in the healthy capacity run; running jobs that fall out
  of that set are preempted (checkpoint, then restart from it later, possibly elsewhere).
  Placement consolidates when it can and spreads when it must (Tiresias' relaxed
  consolidation). Full size only: no resizing.
- Gandiva-like (Xiao et al., OSDI'18): jobs start in submit order wherever they fit (skipping
  those that do not); when nothing fits, a job time-slices the devices of a running job of
  the same size (at most two jobs per device, each at half speed x slicing efficiency);
  when devices free up, one job of a time-sliced pair migrates onto them, and a job spread
  over more nodes than it needs migrates onto one node when one has room (Gandiva's
  packing/consolidation migrations).

On a fleet of several accelerator types each job runs on its own type only: every policy
places into one workspace per type (`workspaces`), FIFO keeps one line per type, Tiresias
picks its top set per type, and Gandiva time-slices only a host of the same size and type.
All three run jobs at full size (W devices), so a job whose W exceeds one region's devices of
its type is rejected by the engine when it arrives.
"""
from __future__ import annotations

import numpy as np

from .engine import MIGRATE, PREEMPT, START, Decision, Policy
from .placement import Workspace


def workspaces(engine):
    """Returns one placement Workspace per accelerator type (indexed by type id), each seeing
    only the nodes of its type (a node has one type, so they never share a device)."""
    fleet = engine.fleet
    if len(fleet.type_names) == 1:
        return [Workspace(engine)]
    out = []
    for t in range(len(fleet.type_names)):
        ws = Workspace(engine)
        other = fleet.node_type != t
        ws.node_free[other] = 0
        ws.dev_free[engine.dev_type != t] = False
        ws.free_total = int(ws.node_free.sum())
        ws.max_node = int(fleet.node_devices[~other].max()) if (~other).any() else 0
        out.append(ws)
    return out


def free_total(spaces):
    return sum(ws.free_total for ws in spaces)


class Fifo(Policy):
    name = "fifo"

    def schedule(self, engine, now):
        pending = engine.pending_in_submit_order()
        if not pending:
            return []
        spaces = workspaces(engine)
        out = []
        W = engine.W
        job_type = engine.job_type
        blocked = set()  # one line per accelerator type (a partition's queue)
        for j in pending:
            t = int(job_type[j])
            if t in blocked:
                continue
            ws = spaces[t]
            devs = ws.find(int(W[j]))
            if devs is None:
                blocked.add(t)  # head-of-line blocking: nobody jumps the queue of this type
                if len(blocked) == len(spaces):
                    break
                continue
            ws.take(devs)
            out.append(Decision(START, j, devs, "fifo: head of line fits"))
            if free_total(spaces) == 0:
                break
        return out


class Tiresias(Policy):
    name = "tiresias"

    def __init__(self, thresholds=(3600.0, 36000.0)):
        self.thresholds = np.asarray(sorted(thresholds), dtype=np.float64)

    def schedule(self, engine, now):
        running = np.fromiter(engine.running, dtype=np.int64, count=len(engine.running))
        pending = np.fromiter(engine.pending, dtype=np.int64, count=len(engine.pending))
        if pending.size == 0:
            self._wake_for_demotions(engine, running, now)
            return []
        active = np.concatenate([running, pending])
        service = engine.attained_now(active)
        queue = np.searchsorted(self.thresholds, service, side="right")
        order = active[np.lexsort((active, engine.submit[active], queue))]
        fleet = engine.fleet
        healthy = engine.node_healthy
        left = np.bincount(fleet.node_type[healthy], weights=fleet.node_devices[healthy],
                           minlength=len(fleet.type_names)).astype(np.int64)
        W = engine.W
        job_type = engine.job_type
        chosen = []
        smallest = int(W[active].min())
        for j in order.tolist():
            w, t = int(W[j]), job_type[j]
            if w <= left[t]:
                chosen.append(j)
                left[t] -= w
                if left.max() < smallest:
                    break
        chosen_set = set(chosen)
        running_set = engine.running
        victims = [j for j in running.tolist() if j not in chosen_set]
        starters = [j for j in chosen if j not in running_set]
        if not starters:
            self._wake_for_demotions(engine, running, now)
            return []
        spaces = workspaces(engine)
        out = []
        # Preempt only as many victims of each type as that type's starters need, lowest
        # priority first.
        need = np.zeros(len(spaces), dtype=np.int64)
        for j in starters:
            need[job_type[j]] += int(W[j])
        need -= np.array([ws.free_total for ws in spaces])
        rank = {j: i for i, j in enumerate(order.tolist())}
        for j in sorted(victims, key=rank.__getitem__, reverse=True):
            t = job_type[j]
            if need[t] <= 0:
                continue
            out.append(Decision(PREEMPT, j, None, "tiresias: lower priority queue"))
            spaces[t].give(engine.job_devices[j])
            need[t] -= int(W[j])
        for j in starters:
            ws = spaces[job_type[j]]
            devs = ws.find(int(W[j]))
            if devs is None:
                continue
            ws.take(devs)
            out.append(Decision(START, j, devs, "tiresias: highest attained-service priority"))
        still_running = [j for j in running.tolist() if j in chosen_set]
        self._wake_for_demotions(engine, np.asarray(still_running, dtype=np.int64), now)
        return out

    def _wake_for_demotions(self, engine, running, now):
        """Asks to be woken when the first running job crosses into a lower queue (only
        matters when jobs wait behind it)."""
        if running.size == 0 or not engine.pending:
            return
        service = engine.attained_now(running)
        idx = np.searchsorted(self.thresholds, service, side="right")
        has_next = idx < self.thresholds.size
        if not has_next.any():
            return
        gap = self.thresholds[idx[has_next]] - service[has_next]
        rate = np.maximum(engine.ndev[running[has_next]], 1)
        engine.wake_at(now + float((gap / rate).min()) + 1e-6)


class Gandiva(Policy):
    name = "gandiva"
    slots_per_device = 2

    def __init__(self, max_migrations_per_pass=8):
        self.max_migrations = max_migrations_per_pass

    def schedule(self, engine, now):
        spaces = workspaces(engine)
        out = []
        W = engine.W
        job_type = engine.job_type
        migrations = 0
        # 1. Admit in submit order, skipping jobs that do not fit.
        pending = engine.pending_in_submit_order()
        hosts = None
        for j in list(pending):
            w = int(W[j])
            ws = spaces[job_type[j]]
            devs = ws.find(w) if ws.free_total >= w else None
            if devs is not None:
                ws.take(devs)
                out.append(Decision(START, j, devs, "gandiva: fits"))
                continue
            if hosts is None:
                hosts = self._unshared_hosts(engine, out)
            candidates = hosts.get((w, int(job_type[j])))
            if candidates:
                host = candidates.pop()
                out.append(Decision(START, j, engine.job_devices[host], "gandiva: time-slice", share=True))
            elif free_total(spaces) == 0 and not any(hosts.values()):
                break
        # 2. Un-share: a time-sliced pair splits when one of them fits on free devices.
        if engine.any_shared and free_total(spaces):
            for j in list(engine.guests):
                if migrations >= self.max_migrations or free_total(spaces) == 0:
                    break
                devs = engine.job_devices[j]
                if (engine.owner2[devs] != j).all():
                    continue  # only the guest of a pair moves
                ws = spaces[job_type[j]]
                target = ws.find_on_one_node(int(W[j])) if W[j] <= ws.max_node else ws.find(int(W[j]))
                if target is None:
                    continue
                ws.take(target)
                out.append(Decision(MIGRATE, j, target, "gandiva: leave time-slice for free devices"))
                migrations += 1
        # 3. Consolidate: a job spread over more nodes than it needs moves onto one node.
        if free_total(spaces) and migrations < self.max_migrations:
            for j in list(engine.spread_jobs):
                if migrations >= self.max_migrations:
                    break
                w = int(W[j])
                ws = spaces[job_type[j]]
                if w < 2 or w > ws.max_node:
                    continue
                devs = engine.job_devices[j]
                if devs is None or devs.shape[0] != w or np.unique(engine.dev_node[devs]).shape[0] == 1:
                    continue
                if engine.any_shared and ((engine.owner2[devs] >= 0).any()):
                    continue
                target = ws.find_on_one_node(w)
                if target is None:
                    continue
                ws.take(target)
                out.append(Decision(MIGRATE, j, target, "gandiva: consolidate onto one node"))
                migrations += 1
        return out

    def _unshared_hosts(self, engine, planned):
        """Returns (W, type) -> running jobs at full size that share no device and that no
        decision of this pass moves (oldest popped first)."""
        moved = {d.job for d in planned}
        running = np.fromiter(engine.running, dtype=np.int64, count=len(engine.running))
        ok = (engine.ndev[running] == engine.W[running]) & ~engine.shared_flag[running]
        running = running[ok]
        hosts = {}
        keys = engine.W[running] * 65536 + engine.job_type[running]
        for key in np.unique(keys).tolist():
            group = [j for j in running[keys == key].tolist() if j not in moved]
            group.reverse()
            hosts[(key // 65536, key % 65536)] = group
        return hosts


REGISTRY = {"fifo": Fifo, "tiresias": Tiresias, "gandiva": Gandiva}
