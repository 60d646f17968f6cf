"""Every Prometheus metric Meridian exports, defined once, and the one-line calls that record them.

Multi-process (prometheus_client's multiprocess mode): every web process and Celery worker writes
its samples to files under PROMETHEUS_MULTIPROC_DIR (portal.settings sets it before this module is
imported, from MERIDIAN_METRICS_DIR); the /metrics view (portal.metrics) sums them per scrape by
reading those files, never the job tables. Gauges are set by the tick from the Snapshot it built
anyway ("mostrecent": the last tick's value wins whichever worker ran it), so a scrape costs the
same whatever the fleet's size.

Callers (one line each): jobs.tick.tick_run -> tick_observed; jobs.moves -> move_step_observed,
move_ended; portal.metrics.HeartbeatMetricsMiddleware -> heartbeat_observed;
fleet.lease_api -> lease_observed. Names and labels
are listed in docs/operator-guide.md#metrics.
"""
from __future__ import annotations

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

import scheduler
from scheduler.snapshot import NO_JOB, RUNNING

TIERS = ("premium", "standard", "basic")  # scheduler's PREMIUM, STANDARD, BASIC (0, 1, 2)
DECISION_KINDS = ("start", "preempt", "migrate", "resize", "approval")
TICK_PHASES = ("snapshot", "plan", "apply", "total")
TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

TICK_SECONDS = Histogram("meridian_tick_duration_seconds", "Scheduler tick duration by phase",
                         ["phase"], buckets=TICK_BUCKETS)
TICK_DECISIONS = Counter("meridian_tick_decisions", "Decisions the ticks made, by kind", ["kind"])
HEARTBEATS = Counter("meridian_heartbeats_received", "Agent heartbeats received (any answer)")
HEARTBEATS_REJECTED = Counter("meridian_heartbeats_rejected",
                              "Agent heartbeats refused, by HTTP status (401 bad token, 400 malformed, ...)",
                              ["status"])
QUEUE_DEPTH = Gauge("meridian_queue_depth", "Jobs the last tick left waiting, by tier and accelerator type",
                    ["tier", "accelerator_type"], multiprocess_mode="mostrecent")
QUEUE_WAIT = Gauge("meridian_queue_wait_seconds",
                   "How long the waiting jobs have waited since submission (last tick): stat=max|mean",
                   ["tier", "accelerator_type", "stat"], multiprocess_mode="mostrecent")
DEVICES = Gauge("meridian_devices",
                "Devices as the last tick's snapshot saw them, by type, region (its id) and state: allocated "
                "(held by a job), used (held by a running job), free (healthy, unheld), unhealthy",
                ["accelerator_type", "region", "state"], multiprocess_mode="mostrecent")
LEASES = Counter("meridian_leases", "Liveness leases answered (POST /api/agent/lease/), by HTTP status", ["status"])
NODES_LOST = Counter("meridian_nodes_lost", "Nodes marked lost for missed heartbeats")
MOVES = Counter("meridian_moves", "Moves (preemption, migration, resize) that ended, by kind and outcome",
                ["kind", "outcome"])
MOVE_STEP_SECONDS = Histogram("meridian_move_step_duration_seconds", "Duration of each completed move step",
                              ["kind", "step"], buckets=STEP_BUCKETS)


def tick_observed(*, result, index, plan: scheduler.Plan) -> None:
    """Records one tick (a jobs.tick.TickResult, its jobs.snapshot.SnapshotIndex and its Plan): its
    phases' durations, its decisions, the nodes it found lost; the queue gauges from the jobs its
    plan leaves waiting and the device gauges from its snapshot (numpy over arrays it holds)."""
    for phase in TICK_PHASES:
        if phase in result.seconds:
            TICK_SECONDS.labels(phase).observe(result.seconds[phase])
    for kind in DECISION_KINDS:
        if result.counts.get(kind):
            TICK_DECISIONS.labels(kind).inc(result.counts[kind])
    if result.lost_nodes:
        NODES_LOST.inc(len(result.lost_nodes))
    _queue_gauges_set(index.snapshot, [wait.job for wait in plan.waiting])
    _device_gauges_set(index.snapshot, [str(region_id) for region_id in index.region_ids])


def _queue_gauges_set(snapshot: scheduler.Snapshot, waiting_jobs: list[int]) -> None:
    jobs = snapshot.jobs
    rows = np.asarray(waiting_jobs, dtype=np.int64)
    submitted = np.zeros(len(jobs.ids)) if jobs.submit_time is None else np.asarray(jobs.submit_time, dtype=float)
    waited = snapshot.now - submitted[rows]
    tiers, types = np.asarray(jobs.tier)[rows], np.asarray(jobs.type_id)[rows]
    for tier_index, tier in enumerate(TIERS):
        for type_index, type_name in enumerate(snapshot.type_names):
            mask = (tiers == tier_index) & (types == type_index)
            n = int(mask.sum())
            QUEUE_DEPTH.labels(tier, type_name).set(n)
            QUEUE_WAIT.labels(tier, type_name, "max").set(float(waited[mask].max()) if n else 0.0)
            QUEUE_WAIT.labels(tier, type_name, "mean").set(float(waited[mask].mean()) if n else 0.0)


def _device_gauges_set(snapshot: scheduler.Snapshot, region_labels: list[str]) -> None:
    devices = snapshot.accelerators
    n = len(devices.type_id)
    holder = np.full(n, NO_JOB) if devices.holder is None else np.asarray(devices.holder)
    healthy = np.ones(n, dtype=bool) if devices.healthy is None else np.asarray(devices.healthy, dtype=bool)
    held = holder != NO_JOB
    states_of_jobs = snapshot.jobs.state
    running_jobs = np.zeros(len(snapshot.jobs.ids), dtype=bool) if states_of_jobs is None else \
        np.asarray(states_of_jobs) == RUNNING
    used = held & running_jobs[np.where(held, holder, 0)] if len(running_jobs) else np.zeros_like(held)
    types, regions = np.asarray(devices.type_id), np.asarray(devices.region)
    region_names = region_labels or snapshot.region_names or ()
    states = {"allocated": held, "used": used, "free": healthy & ~held, "unhealthy": ~healthy}
    for type_index, type_name in enumerate(snapshot.type_names):
        for region_index, region in enumerate(region_names):
            where = (types == type_index) & (regions == region_index)
            for state, mask in states.items():
                DEVICES.labels(type_name, region, state).set(int((where & mask).sum()))


def heartbeat_observed(*, status: int) -> None:
    """Records one heartbeat request and, for an answer of 400 or more, its refusal."""
    HEARTBEATS.inc()
    if status >= 400:
        HEARTBEATS_REJECTED.labels(str(status)).inc()


def lease_observed(*, status: int) -> None:
    """Records one lease answer (fleet.lease_api) by its HTTP status."""
    LEASES.labels(str(status)).inc()


def move_step_observed(*, kind: str, step: str, seconds: float, last: bool) -> None:
    """Records a move step completed after `seconds` (from the step's start); the `last` step's
    completion ends the move as done."""
    MOVE_STEP_SECONDS.labels(kind, step).observe(max(0.0, seconds))
    if last:
        MOVES.labels(kind, "done").inc()


def move_ended(*, kind: str, outcome: str) -> None:
    """Records a move that ended: outcome done, failed, timed_out, ..."""
    MOVES.labels(kind, outcome).inc()
