"""The control loop's tick: selectors build the Snapshot from the database, the scheduler core
returns a Plan, services apply it in one transaction.

    tick_run(now=None) -> TickResult   the whole tick (what the Celery task jobs.tasks.scheduler_tick calls)

The parts live by responsibility: the lease in jobs/lease.py, the snapshot selector in
jobs/snapshot.py, the plan applier in jobs/plan_apply.py, the lost-node sweep in jobs/services.py;
device-time accounting runs apart (jobs/accounting.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.utils import timezone

import scheduler
from fleet.services import ANALYZE_AFTER_ROWS, tables_analyze
from jobs.lease import HOLDER, TICK_LEASE, tick_lease_claim, tick_lease_release
from jobs.models import ControlLoopLease, Job, Replica
from jobs.moves import moves_sweep
from jobs.plan_apply import plan_apply
from jobs.services import node_lost_sweep, preemption_expire_due
from jobs.snapshot import snapshot_build
from jobs.workflows import workflow_timeouts_sweep
from observability import metrics


@dataclass
class TickResult:
    ran: bool  # False: another worker holds the lease
    seconds: dict = field(default_factory=dict)  # snapshot, plan, apply, total
    counts: dict = field(default_factory=dict)
    rows_written: int = 0
    devices: int = 0
    jobs: int = 0
    lost_nodes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ran": self.ran, "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "counts": self.counts, "rows_written": self.rows_written, "devices": self.devices,
                "jobs": self.jobs, "lost_nodes": self.lost_nodes}


def tick_run(*, now: datetime | None = None, holder: str = HOLDER) -> TickResult:
    """Runs one tick if this caller wins the lease; returns a TickResult (ran=False otherwise).

    1. sweep lost nodes, expired approval requests and timed-out moves  2. snapshot (selectors)
    3. plan (scheduler.schedule)  4. apply (services)  5. record stats on the lease row;
    all of it in one transaction.
    """
    began = time.perf_counter()
    now = now or timezone.now()
    if not tick_lease_claim(now=now, holder=holder):
        return TickResult(ran=False)
    try:
        result = TickResult(ran=True)
        with transaction.atomic():
            # 1. sweeps
            result.lost_nodes = node_lost_sweep(now=now)
            result.counts["expired_requests"] = preemption_expire_due(now=now)
            swept = moves_sweep(now=now)
            result.counts["timed_out_moves"] = swept["timed_out"] + workflow_timeouts_sweep(now=now)
            result.counts["requeued_move_chains"] = swept["requeued"]
            # 2. snapshot
            t0 = time.perf_counter()
            index = snapshot_build(now=now)
            # 3. plan
            t1 = time.perf_counter()
            plan = scheduler.schedule(index.snapshot, timer=time.perf_counter)
            # 4. apply
            t2 = time.perf_counter()
            applied = plan_apply(index=index, plan=plan, now=now)
            t3 = time.perf_counter()
            # 5. record
            result.seconds = {"snapshot": t1 - t0, "plan": t2 - t1, "apply": t3 - t2}
            result.counts = {**result.counts, **plan.summary(),
                             **{f"applied_{k}": v for k, v in applied["counts"].items()}}
            result.rows_written = applied["rows"]
            result.devices = len(index.snapshot.accelerators)
            result.jobs = len(index.snapshot.jobs)
            result.seconds["total"] = time.perf_counter() - began
            metrics.tick_observed(result=result, index=index, plan=plan)
            ControlLoopLease.objects.filter(name=TICK_LEASE).update(last_tick_at=now,
                                                                    last_tick_stats=result.as_dict())
        if result.rows_written >= ANALYZE_AFTER_ROWS:
            # A placement tick rewrote most of the replica rows (all unplaced before): without fresh
            # statistics PostgreSQL plans each heartbeat's desired-state query as a sequential scan of
            # every replica (73 ms at 100k accelerators, instead of 0.2 ms) until autovacuum catches up.
            tables_analyze(Job, Replica)
        return result
    finally:
        tick_lease_release(holder=holder)
