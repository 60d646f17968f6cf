"""SLA tiers and cost-aware victims: shrink before preempt, least lost work, approvals, no thrash."""
import pytest

import scheduler
from scheduler import BASIC, PREMIUM, SPREAD_NODE, SPREAD_RACK, STANDARD, Preempt, Resize, Start
from scheduler.builders import make_fleet, make_job, make_snapshot, make_team

NOW = 10_000.0


def one_node(devices=4):
    return make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=devices)).now(NOW)


def outcome(snap):
    """Returns {"start": [...], "preempt": [...], "approval": [...], "shrink": [...]} by job name."""
    plan = scheduler.schedule(snap)
    name = snap.jobs.name
    out = {"start": [], "preempt": [], "approval": [], "shrink": []}
    for d in plan.decisions:
        if isinstance(d, Start):
            out["start"].append(name(d.job))
        elif isinstance(d, Preempt):
            out["approval" if d.needs_approval else "preempt"].append(name(d.job))
        elif isinstance(d, Resize):
            out["shrink"].append(name(d.job))
    scheduler.apply_plan(snap, plan, NOW + 1).validate()
    return out, plan


def old(job):
    """A job started and checkpointed long enough ago to be preemptible."""
    return job.started(0.0)


CASES = [
    pytest.param(
        [old(make_job("basic").tier(BASIC).ranks(4).running(4))],
        make_job("premium").tier(PREMIUM).ranks(4),
        {"start": ["premium"], "preempt": ["basic"]}, id="premium-preempts-basic"),
    pytest.param(
        [old(make_job("basic-recent-ckpt").tier(BASIC).ranks(2).running(2).checkpoint(NOW - 10)),
         old(make_job("basic-stale-ckpt").tier(BASIC).ranks(2).running(2).checkpoint(NOW - 3000))],
        make_job("premium").tier(PREMIUM).ranks(2),
        {"start": ["premium"], "preempt": ["basic-recent-ckpt"]}, id="least-lost-work-is-preempted"),
    pytest.param(
        [old(make_job("big-ckpt").tier(BASIC).ranks(2).running(2).checkpoint(NOW - 10, size_bytes=10**10)),
         old(make_job("small-ckpt").tier(BASIC).ranks(2).running(2).checkpoint(NOW - 10, size_bytes=10**6))],
        make_job("premium").tier(PREMIUM).ranks(2),
        {"start": ["premium"], "preempt": ["small-ckpt"]}, id="same-lost-work-smallest-checkpoint"),
    pytest.param(
        [old(make_job("rigid").tier(BASIC).ranks(2).running(2).checkpoint(NOW - 1)),
         old(make_job("elastic").tier(BASIC).ranks(2).elastic(1).running(2).checkpoint(NOW - 3000))],
        make_job("premium").tier(PREMIUM).ranks(1),
        {"start": ["premium"], "shrink": ["elastic"]}, id="shrink-before-preempt"),
    pytest.param(
        [old(make_job("standard").tier(STANDARD).ranks(2).running(2).attained(0.9)),
         old(make_job("basic").tier(BASIC).ranks(2).running(2).attained(0.1).checkpoint(NOW - 5000))],
        make_job("premium").tier(PREMIUM).ranks(2),
        {"start": ["premium"], "preempt": ["basic"]}, id="basic-goes-before-standard"),
    pytest.param(
        [old(make_job("premium-running").tier(PREMIUM).ranks(4).running(4))],
        make_job("premium").tier(PREMIUM).ranks(4),
        {}, id="premium-is-never-preempted-by-premium"),
    pytest.param(
        [old(make_job("premium-running").tier(PREMIUM).ranks(4).elastic(1).running(4))],
        make_job("standard").tier(STANDARD).ranks(2),
        {}, id="premium-is-never-shrunk"),
    pytest.param(
        [old(make_job("standard-ok").tier(STANDARD).ranks(4).running(4).attained(0.8))],
        make_job("premium").tier(PREMIUM).ranks(4),
        {"start": ["premium"], "preempt": ["standard-ok"]}, id="standard-above-floor-is-preempted"),
    pytest.param(
        [old(make_job("standard-low").tier(STANDARD).ranks(4).running(4).attained(0.5))],
        make_job("premium").tier(PREMIUM).ranks(4),
        {"approval": ["standard-low"]}, id="standard-below-floor-needs-approval"),
    pytest.param(
        [old(make_job("standard-low").tier(STANDARD).ranks(4).running(4).attained(0.5).approved())],
        make_job("premium").tier(PREMIUM).ranks(4),
        {"start": ["premium"], "preempt": ["standard-low"]}, id="approved-standard-is-preempted"),
    pytest.param(
        [old(make_job("standard-low").tier(STANDARD).ranks(4).running(4).attained(0.5).denied())],
        make_job("premium").tier(PREMIUM).ranks(4),
        {}, id="a-denied-job-is-not-asked-about-again"),
    pytest.param(
        [old(make_job("basic-denied").tier(BASIC).ranks(4).running(4).denied())],
        make_job("premium").tier(PREMIUM).ranks(4),
        {}, id="a-denied-job-is-not-preempted"),
    pytest.param(
        [make_job("basic-just-started").tier(BASIC).ranks(4).running(4).started(NOW - 60)],
        make_job("premium").tier(PREMIUM).ranks(4),
        {}, id="no-thrash-recently-started-is-not-preempted"),
    pytest.param(
        [old(make_job("basic").tier(BASIC).ranks(4).running(4))],
        make_job("basic-new").tier(BASIC).ranks(4),
        {}, id="basic-does-not-preempt-basic"),
    pytest.param(
        [old(make_job("basic").tier(BASIC).ranks(4).running(4))],
        make_job("standard").tier(STANDARD).ranks(4),
        {"start": ["standard"], "preempt": ["basic"]}, id="standard-preempts-basic"),
]


@pytest.mark.parametrize("running, job, expected", CASES)
def test_victims(running, job, expected):
    builder = one_node()
    for r in running:
        builder.job(r)
    got, _ = outcome(builder.job(job).build())
    want = {"start": [], "preempt": [], "approval": [], "shrink": []}
    want.update(expected)
    assert got == want


def test_the_preemptor_waits_for_approval_and_says_for_whom():
    snap = (one_node().job(old(make_job("std").tier(STANDARD).ranks(4).running(4).attained(0.5)))
            .job(make_job("prem").tier(PREMIUM).ranks(4)).build())
    _, plan = outcome(snap)
    approval = plan.decisions[0]
    assert approval.needs_approval and approval.released == ()
    assert approval.for_job == 1  # the Premium job that needs the devices
    assert "Standard at 50% of its ideal device-time, below the 70% floor" in approval.reason
    assert plan.wait_reason(1).code == "waiting for approval"
    assert "waiting for approval to preempt job std" in plan.wait_reason(1).reason


def test_a_preempted_job_is_back_in_line_with_its_reason():
    snap = (one_node().job(old(make_job("b").tier(BASIC).ranks(4).running(4).checkpoint(NOW - 5, step=420)))
            .job(make_job("p").tier(PREMIUM).ranks(4)).build())
    _, plan = outcome(snap)
    wait = plan.wait_reason(0)
    assert wait.code == "preempted for a higher tier"
    assert "resumes from step 420" in wait.reason


def test_victims_come_from_the_one_region_that_needs_fewest_preemptions():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4).region("us", nodes=1, devices=4))
            .now(NOW)
            .job(old(make_job("eu-1").ranks(2).running(2, node=0)))
            .job(old(make_job("eu-2").ranks(2).running(2, node=0)))
            .job(old(make_job("us-1").ranks(4).running(4, node=1).checkpoint(NOW - 10000)))
            .job(make_job("p").tier(PREMIUM).ranks(4)).build())
    got, plan = outcome(snap)
    assert got["preempt"] == ["us-1"]  # one victim beats two, even with more lost work
    start = plan.of_kind(Start)[0]
    assert {int(snap.accelerators.region[d]) for d in start.devices} == {1}


def test_borrowed_devices_are_reclaimed_first_by_a_team_within_quota():
    snap = (one_node()
            .team(make_team("A").quota("H100-80GB", 4)).team(make_team("B").quota("H100-80GB", 0))
            .job(old(make_job("b-borrowing").team("B").tier(STANDARD).ranks(4).running(4).attained(0.9)))
            .job(make_job("a").team("A").tier(BASIC).ranks(4)).build())
    got, plan = outcome(snap)
    assert got["preempt"] == ["b-borrowing"] and got["start"] == ["a"]
    assert plan.of_kind(Preempt)[0].code == "borrowed devices reclaimed"


def test_a_team_over_quota_may_not_preempt_to_borrow():
    snap = (one_node()
            .team(make_team("A").quota("H100-80GB", 0))
            .job(old(make_job("basic").team("A").tier(BASIC).ranks(4).running(4)))
            .job(make_job("p").team("A").tier(PREMIUM).ranks(4)).build())
    got, plan = outcome(snap)
    assert got["preempt"] == [] and got["start"] == []
    assert "may only borrow idle devices" in plan.wait_reason(1).reason


def test_the_per_tick_preemption_budget_holds():
    builder = one_node(devices=8).settings(max_preemptions_per_tick=2)
    for i in range(8):
        builder.job(old(make_job(f"b{i}").tier(BASIC).ranks(1).running(1)))
    for i in range(4):
        builder.job(make_job(f"p{i}").tier(PREMIUM).ranks(1))
    got, plan = outcome(builder.build())
    assert len(got["preempt"]) == 2 and len(got["start"]) == 2
    assert any(w.code == "preemption budget spent" for w in plan.waiting)


def two_nodes():
    """eu: 1 rack of 2 nodes x 4 devices (node 0: devices 0-3, node 1: devices 4-7)."""
    return make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(NOW)


def test_a_gang_gets_one_node_when_that_takes_no_more_preemptions():
    # node 0: a (1 device, little lost work), b (3, much); node 1: c (1, little), d (3, some)
    # cheapest two victims overall are a and c (two nodes); freeing one node also takes two: c, d
    snap = (two_nodes()
            .job(old(make_job("a").ranks(1).running(1, node=0).checkpoint(NOW - 1)))
            .job(old(make_job("b").ranks(3).running(3, node=0).checkpoint(NOW - 9000)))
            .job(old(make_job("c").ranks(1).running(1, node=1).checkpoint(NOW - 1)))
            .job(old(make_job("d").ranks(3).running(3, node=1).checkpoint(NOW - 100)))
            .job(make_job("p").tier(PREMIUM).ranks(2)).build())
    got, plan = outcome(snap)
    assert sorted(got["preempt"]) == ["c", "d"]
    start = plan.of_kind(Start)[0]
    assert {int(snap.accelerators.node[d]) for d in start.devices} == {1}


def test_a_job_pinned_to_one_node_preempts_on_one_node():
    snap = (two_nodes()
            .job(old(make_job("x").ranks(2).running(2, node=0)))
            .job(old(make_job("y").ranks(2).running(2, node=1).checkpoint(NOW - 1)))
            .job(make_job("p").tier(PREMIUM).ranks(4).spread(SPREAD_NODE)).build())
    got, plan = outcome(snap)
    assert got["preempt"] == ["y"] and got["start"] == ["p"]  # y lost less work than x
    start = plan.of_kind(Start)[0]
    assert {int(snap.accelerators.node[d]) for d in start.devices} == {1}


def test_victims_name_the_job_they_make_room_for():
    snap = (one_node().job(old(make_job("e").ranks(4).elastic(1).running(4)))
            .job(make_job("p").tier(PREMIUM).ranks(2).id(77)).build())
    _, plan = outcome(snap)
    shrink = plan.of_kind(Resize)[0]
    assert (shrink.for_job, shrink.for_job_id) == (1, 77)


def test_a_gang_of_a_rack_gets_one_rack_when_that_takes_no_more_preemptions():
    snap = (make_snapshot().fleet(make_fleet().region("eu", racks=2, nodes=2, devices=4)).now(NOW)
            .job(old(make_job("a").ranks(4).running(4, node=0).checkpoint(NOW - 1)))
            .job(old(make_job("b").ranks(4).running(4, node=1).checkpoint(NOW - 100)))
            .job(old(make_job("c").ranks(4).running(4, node=2).checkpoint(NOW - 2)))
            .job(old(make_job("d").ranks(4).running(4, node=3).checkpoint(NOW - 50)))
            .job(make_job("p").tier(PREMIUM).ranks(8)).build())
    got, plan = outcome(snap)
    assert sorted(got["preempt"]) == ["c", "d"]  # not the two cheapest (a, c) in two racks
    start = plan.of_kind(Start)[0]
    assert {int(snap.accelerators.rack[d]) for d in start.devices} == {1}


def test_a_job_pinned_to_a_rack_never_takes_victims_across_racks():
    snap = (make_snapshot().fleet(make_fleet().region("eu", racks=2, nodes=1, devices=4)).now(NOW)
            .job(old(make_job("a").ranks(2).running(2, node=0)))
            .job(make_job("keep").tier(PREMIUM).ranks(2).running(2, node=0))
            .job(old(make_job("c").ranks(2).running(2, node=1)))
            .job(make_job("keep2").tier(PREMIUM).ranks(2).running(2, node=1))
            .job(make_job("p").tier(PREMIUM).ranks(4).spread(SPREAD_RACK))
            .settings(packed_tiers=()).build())  # pinned by max_spread alone, not by tier policy
    got, plan = outcome(snap)
    assert got["preempt"] == [] and got["start"] == []  # a and c would free 4, but in two racks
    assert "preempting could not free 4 H100-80GB within one rack" in plan.wait_reason(4).reason


# --- a preemptor pinned to one node / rack shrinks elastic victims there before preempting ----
PINNED_CASES = [
    pytest.param(
        [old(make_job("elastic").ranks(4).elastic(1).running(4, node=0).checkpoint(NOW - 3000)),
         old(make_job("rigid").ranks(4).running(4, node=1).checkpoint(NOW - 1))],
        make_job("premium").tier(PREMIUM).ranks(2).spread(SPREAD_NODE),
        {"start": ["premium"], "shrink": ["elastic"]}, [0, 1, 2, 3], id="node-spread-shrinks-not-preempts"),
    pytest.param(
        [old(make_job("elastic").ranks(4).elastic(1).running(4, node=0).checkpoint(NOW - 3000)),
         old(make_job("rigid").ranks(4).running(4, node=1).checkpoint(NOW - 1))],
        make_job("premium").tier(PREMIUM).ranks(1).spread(SPREAD_NODE),
        {"start": ["premium"], "shrink": ["elastic"]}, [0, 1, 2, 3], id="w1-node-spread-shrinks-not-preempts"),
    pytest.param(
        [old(make_job("elastic").ranks(4).elastic(1).running(4, node=0).checkpoint(NOW - 3000)),
         old(make_job("rigid").ranks(4).running(4, node=1).checkpoint(NOW - 1))],
        make_job("premium").tier(PREMIUM).ranks(2).spread(SPREAD_RACK),
        {"start": ["premium"], "shrink": ["elastic"]}, [0, 1, 2, 3], id="rack-spread-shrinks-not-preempts"),
    pytest.param(
        # the elastic job spans both nodes: it gives up its devices on node 0 and keeps node 1's
        [old(make_job("elastic").ranks(4).elastic(2).on_devices(0, 1, 4, 5).checkpoint(NOW - 3000)),
         old(make_job("rigid-a").ranks(2).on_devices(2, 3).checkpoint(NOW - 1)),
         old(make_job("rigid-b").ranks(2).on_devices(6, 7).checkpoint(NOW - 1))],
        make_job("premium").tier(PREMIUM).ranks(2).spread(SPREAD_NODE),
        {"start": ["premium"], "shrink": ["elastic"]}, [0, 1], id="split-victim-frees-the-node-it-leaves"),
    pytest.param(
        # shrinking frees only 2 of the 4 needed on one node: preempting a whole job remains
        [old(make_job("elastic").ranks(4).elastic(2).running(4, node=0).checkpoint(NOW - 3000)),
         old(make_job("rigid").ranks(4).running(4, node=1).checkpoint(NOW - 1))],
        make_job("premium").tier(PREMIUM).ranks(4).spread(SPREAD_NODE),
        {"start": ["premium"], "preempt": ["rigid"]}, [4, 5, 6, 7], id="shrink-too-small-preempts"),
]


@pytest.mark.parametrize("running, job, expected, premium_node_devices", PINNED_CASES)
def test_a_pinned_preemptor_shrinks_elastic_victims_on_its_node_first(running, job, expected,
                                                                       premium_node_devices):
    builder = two_nodes()
    for r in running:
        builder.job(r)
    snap = builder.job(job).build()
    got, plan = outcome(snap)
    want = {"start": [], "preempt": [], "approval": [], "shrink": []}
    want.update(expected)
    assert got == want
    start = plan.of_kind(Start)[0]
    nodes = {int(snap.accelerators.node[d]) for d in start.devices}
    assert len(nodes) <= (1 if snap.jobs.max_spread[start.job] == SPREAD_NODE else 2)
    assert set(start.devices) <= set(premium_node_devices)


# --- which elastic victim is shrunk: the preemptor starts only when the victim's cut is done ---
SHRINK_ORDER_CASES = [
    pytest.param(PREMIUM, {}, "small-ckpt", id="premium-shrinks-the-smallest-checkpoint"),
    # Standard is in soonest_room_tiers by default: like Premium, it starts when the cut is done
    pytest.param(STANDARD, {}, "small-ckpt", id="standard-shrinks-the-smallest-checkpoint"),
    pytest.param(STANDARD, {"soonest_room_tiers": (PREMIUM,)}, "big-release",
                 id="standard-out-of-soonest-room-tiers-shrinks-the-biggest-release"),
]


@pytest.mark.parametrize("tier, knobs, shrunk", SHRINK_ORDER_CASES)
def test_which_elastic_victim_is_shrunk(tier, knobs, shrunk):
    # 8 devices: "big-release" (W=4, can give 3) and "small-ckpt" (W=4, min 2, can give 2) fill it
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW).settings(**knobs)
            .job(old(make_job("big-release").ranks(4).elastic(1).running(4).checkpoint(NOW - 10, size_bytes=8 * 10**9)))
            .job(old(make_job("small-ckpt").ranks(4).elastic(2).running(4).checkpoint(NOW - 10, size_bytes=10**9)))
            .job(make_job("new").tier(tier).ranks(1)).build())
    got, _ = outcome(snap)
    assert got["shrink"] == [shrunk] and got["start"] == ["new"]
