"""Several ticks in a row, applying each plan: the stories the control loop will live through."""
import scheduler
from scheduler import BASIC, NODE_LOST, PENDING, PREMIUM, RUNNING, STANDARD
from scheduler.builders import make_fleet, make_job, make_snapshot

TICK = 30.0


def run(snap, ticks):
    """Returns the list of plans of `ticks` ticks and the final snapshot."""
    plans = []
    for _ in range(ticks):
        plan = scheduler.schedule(snap)
        plans.append(plan)
        snap = scheduler.apply_plan(snap, plan, now=snap.now + TICK).validate()
    return plans, snap


def test_premium_arrival_preempts_basic_which_resumes_when_room_returns():
    # 2 nodes x 4: two Basic jobs fill the fleet; a Premium job of 4 arrives
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(10_000.0)
            .job(make_job("basic-1").tier(BASIC).ranks(4).running(4).started(0).checkpoint(9_000, step=90))
            .job(make_job("basic-2").tier(BASIC).ranks(4).running(4).started(0).checkpoint(9_990, step=99))
            .job(make_job("premium").tier(PREMIUM).ranks(4).submitted(9_999)).build())
    plans, after = run(snap, 1)
    kinds = [(d.kind, after.jobs.name(d.job)) for d in plans[0].decisions]
    assert kinds == [("preempt", "basic-2"), ("start", "premium")]  # basic-2 loses 10 s, not 1000 s
    assert after.jobs.state.tolist() == [RUNNING, PENDING, RUNNING]
    # the Premium job finishes: basic-2 starts again on the next tick
    plans, final = run(after.without_jobs([2]), 1)
    assert [(d.kind, final.jobs.name(d.job)) for d in plans[0].decisions] == [("start", "basic-2")]
    assert final.jobs.state.tolist() == [RUNNING, RUNNING]


def test_an_elastic_job_shrinks_for_a_standard_job_and_grows_back_when_it_leaves():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(10_000.0)
            .job(make_job("elastic").tier(BASIC).ranks(8).elastic(2).running(8).started(0))
            .job(make_job("std").tier(STANDARD).ranks(4)).build())
    plans, after = run(snap, 1)
    assert [(d.kind, len(d.devices)) for d in plans[0].decisions] == [("resize", 4), ("start", 4)]
    # the Standard job ends; the elastic job grows back to W once min_resize_interval_seconds
    # has passed since its shrink (not on the very next tick: no grow/shrink flapping)
    plans, later = run(after.without_jobs([1]), 1)
    assert plans[0].decisions == ()
    interval = snap.settings.min_resize_interval_seconds
    plans, final = run(later.replace(now=10_000.0 + TICK + interval), 1)
    assert [(d.kind, len(d.devices)) for d in plans[0].decisions] == [("resize", 8)]
    assert final.allocation_counts().tolist() == [8]


def test_a_lost_node_restarts_its_job_and_the_fleet_settles():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=3, devices=4)).now(10_000.0)
            .job(make_job("a").ranks(4).running(4, node=0).checkpoint(9_000, step=7))
            .job(make_job("b").ranks(4).running(4, node=1))
            .node(0, NODE_LOST).build())
    plans, after = run(snap, 3)
    first = plans[0].decisions
    assert [(d.kind, d.from_checkpoint, d.restart_step) for d in first] == [("migrate", True, 7)]
    assert plans[1].decisions == () and plans[2].decisions == ()  # stable: nothing flaps
    assert {int(after.accelerators.node[d]) for d in after.job_devices(0)} == {2}


def test_plans_are_stable_when_nothing_changes():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4).region("us", nodes=2, devices=4))
            .now(10_000.0)
            .job(make_job("p").tier(PREMIUM).ranks(8))
            .job(make_job("s").tier(STANDARD).ranks(4).elastic(1))
            .job(make_job("b").tier(BASIC).ranks(2))
            .job(make_job("e").tier(BASIC).ranks(8).elastic(1)).build())
    plans, _ = run(snap, 4)
    assert plans[0].decisions
    assert plans[2].decisions == () and plans[3].decisions == ()
