"""Work conservation (grow), defragmentation, and drain-and-move, each on a small fleet."""
import numpy as np
import pytest
from plans import nodes_of

import scheduler
from scheduler import (
    BASIC,
    NODE_DRAINING,
    NODE_LOST,
    PREMIUM,
    SPREAD_NODE,
    Migrate,
    Policy,
    Preempt,
    Resize,
    Start,
)
from scheduler.builders import make_fleet, make_job, make_snapshot, make_team

NOW = 10_000.0


def plan_of(snap, **policy):
    plan = scheduler.schedule(snap, Policy.from_names(**policy) if policy else None)
    scheduler.apply_plan(snap, plan, NOW + 1).validate()
    return plan


def by_name(snap, plan, kind):
    return {snap.jobs.name(d.job): d for d in plan.of_kind(kind)}


# --- grow ---------------------------------------------------------------------------------
GROW_CASES = [
    pytest.param(8, 1, 2, 8, 8, id="grows-to-W-when-room"),
    pytest.param(6, 1, 2, 5, 6, id="grows-by-allowed-counts-only"),  # 2 -> 6 needs 4 more
    pytest.param(6, 1, 2, 3, 3, id="takes-the-largest-divisor-that-fits"),  # 2 -> 3
    pytest.param(8, 2, 2, 1, 2, id="does-not-grow-without-a-fitting-count"),  # 2 -> 4 needs 2
]


@pytest.mark.parametrize("world, min_devices, have, idle_after, expected", GROW_CASES)
def test_elastic_jobs_grow_into_idle_devices(world, min_devices, have, idle_after, expected):
    devices = have + idle_after
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=devices)).now(NOW)
            .job(make_job("e").ranks(world).elastic(min_devices).running(have)).build())
    plan = plan_of(snap)
    grown = by_name(snap, plan, Resize)
    assert len(grown["e"].devices) == expected if "e" in grown else expected == have


def test_growth_stays_in_the_jobs_region_and_prefers_its_node():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4).region("us", nodes=1, devices=8))
            .now(NOW).job(make_job("e").ranks(16).elastic(1).running(2, node=1)).build())
    grown = by_name(snap, plan_of(snap), Resize)["e"]
    assert len(grown.devices) == 8
    assert {int(snap.accelerators.region[d]) for d in grown.devices} == {0}
    assert set(range(4, 8)) <= set(grown.devices)  # all of its own node first


def test_growth_over_quota_is_stated_borrowing_and_off_when_borrowing_is():
    def snap(borrow):
        return (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
                .settings(allow_borrowing=borrow).team(make_team("A").quota("H100-80GB", 4))
                .job(make_job("e").team("A").ranks(8).elastic(1).running(4)).build())
    s = snap(True)
    grown = by_name(s, plan_of(s), Resize)["e"]
    assert grown.borrowed == 4 and grown.code == "grew into idle devices, borrowing"
    s = snap(False)
    assert by_name(s, plan_of(s), Resize) == {}


def test_a_job_shrunk_this_tick_is_not_grown_back():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(NOW)
            .job(make_job("e").ranks(4).elastic(1).running(4).started(0))
            .job(make_job("p").tier(PREMIUM).ranks(2)).build())
    plan = plan_of(snap)
    assert [(d.kind, snap.jobs.name(d.job), len(d.devices)) for d in plan.decisions] == \
        [("resize", "e", 2), ("start", "p", 2)]


def test_without_the_resize_plugin_nothing_grows():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .job(make_job("e").ranks(8).elastic(1).running(2)).build())
    assert plan_of(snap, resize=None).decisions == ()


# --- defragment ---------------------------------------------------------------------------
def fragmented(**kw):
    """Two nodes of 4: node 0 holds x (1 device), node 1 holds y and z (1 each); g needs 4 on one node."""
    builder = make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(NOW)
    if kw:
        builder.settings(**kw)
    return builder


def test_defrag_moves_the_cheapest_small_job_to_free_a_node():
    snap = (fragmented()
            .job(make_job("x").ranks(1).running(1, node=0).started(0).checkpoint(NOW, size_bytes=100))
            .job(make_job("y").ranks(1).running(1, node=1).started(0))
            .job(make_job("z").ranks(1).running(1, node=1).started(0))
            .job(make_job("g").tier(BASIC).ranks(4).spread(SPREAD_NODE)).build())
    plan = plan_of(snap)
    moves = by_name(snap, plan, Migrate)
    assert list(moves) == ["x"]  # node 0 misses one device: move x, the cheapest way
    assert {int(snap.accelerators.node[d]) for d in moves["x"].devices} == {1}
    start = by_name(snap, plan, Start)["g"]
    assert {int(snap.accelerators.node[d]) for d in start.devices} == {0}
    assert start.code == "placed after defragmentation"


@pytest.mark.parametrize("change", [
    pytest.param(dict(tier=PREMIUM), id="premium-small-jobs-stay"),
    pytest.param(dict(started=NOW - 1), id="recently-started-small-jobs-stay"),
    pytest.param(dict(budget=0), id="no-budget-no-moves"),
])
def test_defrag_respects_its_limits(change):
    builder = fragmented(max_defrag_migrations_per_tick=change.get("budget", 16))
    for name, node in (("x", 0), ("y", 1), ("z", 1)):
        job = make_job(name).ranks(1).running(1, node=node).started(change.get("started", 0.0))
        builder.job(job.tier(change.get("tier", BASIC)))
    snap = builder.job(make_job("g").tier(BASIC).ranks(4).spread(SPREAD_NODE)).build()
    plan = plan_of(snap)
    assert plan.of_kind(Migrate) == [] and by_name(snap, plan, Start) == {}
    assert plan.wait_reason(3) is not None


# --- drain and move -----------------------------------------------------------------------
def two_regions():
    return (
        make_snapshot()
        .fleet(make_fleet().region("eu", nodes=2, devices=4).region("us", nodes=1, devices=4))
        .now(NOW)
    )


def test_a_job_on_a_lost_node_restarts_from_its_checkpoint_elsewhere():
    snap = (two_regions().node(0, NODE_LOST)
            .job(make_job("a").tier(PREMIUM).ranks(4).running(4, node=0).checkpoint(NOW - 30, step=1234))
            .build())
    move = by_name(snap, plan_of(snap), Migrate)["a"]
    assert move.from_checkpoint and move.restart_step == 1234
    assert {int(snap.accelerators.node[d]) for d in move.devices} == {1}  # same region first
    assert "node 0 is lost" in move.reason


def test_a_job_on_a_lost_node_with_no_room_goes_back_in_line():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(NOW).node(0, NODE_LOST)
            .job(make_job("a").ranks(4).running(4, node=0).checkpoint(NOW, step=7))
            .job(make_job("p").tier(PREMIUM).ranks(4).running(4, node=1).started(NOW)).build())
    plan = plan_of(snap)
    assert by_name(snap, plan, Preempt)["a"].code == "node lost, requeued"
    assert plan.wait_reason(0).reason.startswith("needs 4 H100-80GB in one region; at most 0 free together")


def test_a_draining_node_is_emptied_live_across_regions_when_needed():
    snap = (two_regions().node(0, NODE_DRAINING)
            .job(make_job("p").tier(PREMIUM).ranks(4).running(4, node=1).started(NOW))
            .job(make_job("a").ranks(4).running(4, node=0)).build())
    move = by_name(snap, plan_of(snap), Migrate)["a"]
    assert not move.from_checkpoint
    assert {int(snap.accelerators.region[d]) for d in move.devices} == {1}
    assert "(from eu)" in move.reason


def test_a_draining_node_keeps_its_job_while_there_is_no_room():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(NOW).node(0, NODE_DRAINING)
            .job(make_job("a").ranks(4).running(4)).build())
    assert plan_of(snap).decisions == ()


def test_a_drained_region_moves_out_and_takes_nothing_new():
    snap = (two_regions().drain_region("eu")
            .job(make_job("a").ranks(2).running(2, node=0))
            .job(make_job("new").ranks(4)).build())
    plan = plan_of(snap)
    move = by_name(snap, plan, Migrate)["a"]
    assert {int(snap.accelerators.region[d]) for d in move.devices} == {1}
    assert "region eu is drained" in move.reason
    # "new" needs 4 and the only ready region now has 2 free: it waits
    assert plan.wait_reason(1) is not None


def test_a_failed_device_restarts_its_job():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(NOW).unhealthy(1)
            .job(make_job("a").ranks(2).on_devices(0, 1)).build())
    move = by_name(snap, plan_of(snap), Migrate)["a"]
    assert move.from_checkpoint and "device 1 failed" in move.reason
    assert 1 not in move.devices


# --- partial migration: a job spanning nodes keeps its healthy nodes' devices (issue 14) -------
def four_nodes(**region):
    """One region of 4 nodes x 4 devices (nodes 0-3: devices 0-3, 4-7, 8-11, 12-15)."""
    return make_snapshot().fleet(make_fleet().region("eu", **{"nodes": 4, "devices": 4, **region})).now(NOW)


@pytest.mark.parametrize("status, from_checkpoint", [
    pytest.param(NODE_DRAINING, False, id="draining-live"),
    pytest.param(NODE_LOST, True, id="lost-from-checkpoint"),
])
def test_a_job_on_two_nodes_keeps_its_first_nodes_devices_when_the_second_leaves(status, from_checkpoint):
    # W = 8 on nodes 0 + 1; node 1 leaves; nodes 2 and 3 are free. The whole-job search took 2 + 3.
    snap = (four_nodes().node(1, status)
            .job(make_job("wide").ranks(8).on_devices(*range(8)).checkpoint(NOW - 30, step=40)).build())
    move = by_name(snap, plan_of(snap), Migrate)["wide"]
    assert move.from_checkpoint is from_checkpoint
    assert move.devices[:4] == (0, 1, 2, 3) and len(move.devices) == 8  # node 0's devices, kept
    assert nodes_of(snap, move.devices) == [0, 2]  # node 1's four replaced by one whole node
    assert move.kept == 4
    assert "keeping 4 it holds on node 0" in move.reason


def test_a_partial_move_keeps_the_device_type_and_the_jobs_count():
    # Node 1's 4 devices are replaced by 4 on one node; the free 2 on node 2 (held half by "small")
    # would spread the job over three nodes, so node 3 is taken.
    snap = (four_nodes().node(1, NODE_DRAINING)
            .job(make_job("wide").ranks(8).on_devices(*range(8)))
            .job(make_job("small").ranks(2).on_devices(8, 9)).build())
    move = by_name(snap, plan_of(snap), Migrate)["wide"]
    assert nodes_of(snap, move.devices) == [0, 3] and move.kept == 4


def test_a_failed_device_is_replaced_on_the_same_node():
    snap = (four_nodes().unhealthy(1).job(make_job("a").ranks(2).on_devices(0, 1)).build())
    move = by_name(snap, plan_of(snap), Migrate)["a"]
    assert move.devices == (0, 2) and move.kept == 1 and move.from_checkpoint


def test_with_no_partial_place_in_its_cluster_the_whole_job_moves():
    # max spread "cluster": cluster 0 (nodes 0, 1) has no free device besides the job's; cluster 1
    # (nodes 2, 3) is free. A partial move would cross clusters: the whole job moves there.
    snap = (make_snapshot().fleet(make_fleet().region("eu", clusters=2, nodes=2, devices=4)).now(NOW)
            .node(1, NODE_DRAINING)
            .job(make_job("wide").ranks(8).spread(scheduler.SPREAD_CLUSTER).on_devices(*range(8))).build())
    move = by_name(snap, plan_of(snap), Migrate)["wide"]
    assert nodes_of(snap, move.devices) == [2, 3] and move.kept == 0


@pytest.mark.parametrize("tier, expected_nodes", [
    # 4 + 2 + 2 devices over 3 hosts: unequal shares run (ranks in proportion to each host's devices)
    pytest.param(BASIC, [0, 2, 3], id="basic-takes-a-spread-partial-place"),
    pytest.param(PREMIUM, None, id="premium-takes-no-spread-place-and-waits"),
])
def test_a_partial_move_follows_the_packing_rules(tier, expected_nodes):
    # Nodes 2 and 3 have 2 free devices each: node 1's 4 fit only over two nodes (3 in all, where
    # 8 devices need 2): the spread cost. A Premium job does not take it, nor a whole-job place
    # (there is none); it keeps running on the draining node and is tried again next tick.
    snap = (four_nodes().node(1, NODE_DRAINING)
            .job(make_job("wide").tier(tier).ranks(8).on_devices(*range(8)))
            .job(make_job("x").ranks(2).on_devices(8, 9)).job(make_job("y").ranks(2).on_devices(12, 13)).build())
    moves = by_name(snap, plan_of(snap), Migrate)
    if expected_nodes is None:
        assert "wide" not in moves
    else:
        assert nodes_of(snap, moves["wide"].devices) == expected_nodes and moves["wide"].kept == 4


def test_lost_nodes_free_nothing_and_their_devices_stay_unused():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=2)).now(NOW).node(0, NODE_LOST)
            .job(make_job("a").ranks(2).running(2, node=0)).job(make_job("b").ranks(2)).build())
    plan = plan_of(snap)
    used = np.concatenate([np.asarray(d.devices) for d in plan.decisions if hasattr(d, "devices")])
    assert not set(used.tolist()) & {0, 1}


# --- resize churn: PolicySettings.min_resize_interval_seconds ------------------------------
CHURN_CASES = [
    pytest.param(None, 600.0, 8, id="never-resized-grows"),
    pytest.param(NOW - 60, 600.0, 2, id="resized-a-minute-ago-does-not-grow"),
    pytest.param(NOW - 599, 600.0, 2, id="just-inside-the-interval-does-not-grow"),
    pytest.param(NOW - 600, 600.0, 8, id="after-the-interval-grows"),
    pytest.param(NOW - 60, 0.0, 8, id="interval-zero-grows-at-once"),
]


@pytest.mark.parametrize("resized_at, interval, expected", CHURN_CASES)
def test_a_job_is_not_grown_again_within_the_resize_interval(resized_at, interval, expected):
    job = make_job("e").ranks(8).elastic(1).running(2).started(0.0)
    if resized_at is not None:
        job.resized(resized_at)
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .settings(min_resize_interval_seconds=interval).job(job).build())
    grown = by_name(snap, plan_of(snap), Resize)
    assert (len(grown["e"].devices) if "e" in grown else 2) == expected


def test_a_shrink_for_a_higher_tier_is_not_held_back_and_apply_records_the_resize():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(NOW)
            .job(make_job("e").tier(BASIC).ranks(4).elastic(1).running(4).started(0.0).resized(NOW - 60))
            .job(make_job("p").tier(PREMIUM).ranks(2)).build())
    plan = plan_of(snap)
    assert len(by_name(snap, plan, Resize)["e"].devices) == 2
    after = scheduler.apply_plan(snap, plan, NOW + 1)
    assert after.jobs.last_resize_time[0] == NOW + 1
