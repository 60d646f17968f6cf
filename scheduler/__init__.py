"""Meridian's scheduler core: a frozen Snapshot in, a Plan out. Pure (numpy only), deterministic.

How to call it:

    import scheduler
    from scheduler import BASIC, Accelerators, JobRow, Jobs, PolicySettings, Snapshot, Teams

    snap = Snapshot(
        accelerators=Accelerators(type_id=[...], node=[...], rack=[...], cluster=[...],
                                  region=[...], healthy=[...], holder=[...]),  # lists or arrays
        # (or Accelerators.from_rows([AcceleratorRow(type_id=0, node=3, ...), ...]))
        jobs=Jobs.from_rows([JobRow(id=7, team=0, tier=BASIC, type_id=0, world_size=8), ...]),
        teams=Teams(names=["vision"], quota=[[64]]),
        now=1_764_000_000.0,                     # seconds; the core never reads a clock
        type_names=["H100-80GB"], region_names=["eu-west"],
        node_status=None, region_drained=None,   # None = all nodes ready, no region drained
        settings=PolicySettings())
    plan = scheduler.schedule(snap)              # or schedule(snap, Policy.from_names(order="order.fifo"))
    for decision in plan.decisions:              # Start / Preempt / Migrate / Resize, apply in order
        print(decision.kind, decision.job_id, decision.code, decision.reason)
    for wait in plan.waiting:                    # every pending job: place in line and why
        print(wait.place, wait.job_id, wait.reason)
    next_snap = scheduler.apply_plan(snap, plan, now=snap.now + 30)   # simulator / tests

Between ticks the caller advances Teams.decayed_usage with scheduler.decay_usage(...).
Tests build snapshots with scheduler.builders (make_snapshot, make_fleet, make_team, make_job);
large fleets come from scheduler.builders.synthetic_fleet. Pass timer=time.perf_counter to
schedule() to get Plan.phase_seconds. The phases and plugins are described in
scheduler/framework.py and the README ("How the scheduler decides").
"""
from scheduler import placement_cost
from scheduler.apply import PlanConflict, apply_plan
from scheduler.framework import PHASES, Policy, schedule
from scheduler.plan import Migrate, Plan, Preempt, Resize, Start, WaitReason, rank_layout
from scheduler.plugins.order import decay_usage
from scheduler.snapshot import (
    BASIC,
    NODE_DRAINING,
    NODE_LOST,
    NODE_READY,
    PENDING,
    PREMIUM,
    RUNNING,
    SPREAD_CLUSTER,
    SPREAD_NODE,
    SPREAD_RACK,
    SPREAD_REGION,
    STANDARD,
    UNLIMITED,
    AcceleratorRow,
    Accelerators,
    JobRow,
    Jobs,
    PolicySettings,
    Snapshot,
    SnapshotError,
    Teams,
)

__all__ = [
    "schedule", "apply_plan", "Policy", "PHASES", "PlanConflict", "placement_cost",
    "Plan", "Start", "Preempt", "Migrate", "Resize", "WaitReason", "rank_layout", "decay_usage",
    "Snapshot", "Accelerators", "AcceleratorRow", "Jobs", "JobRow", "Teams", "PolicySettings", "SnapshotError",
    "PREMIUM", "STANDARD", "BASIC", "PENDING", "RUNNING", "NODE_READY", "NODE_DRAINING",
    "NODE_LOST", "SPREAD_NODE", "SPREAD_RACK", "SPREAD_CLUSTER", "SPREAD_REGION", "UNLIMITED",
]
