"""Gang placement: all devices at once, packed node > rack > cluster > region, never across regions."""
import pytest
from plans import nodes_of

import scheduler
from scheduler import NODE_DRAINING, PREMIUM, SPREAD_NODE, Start
from scheduler.builders import make_fleet, make_job, make_snapshot


def starts(snap):
    plan = scheduler.schedule(snap)
    return {snap.jobs.name(d.job): d for d in plan.decisions if isinstance(d, Start)}, plan


def regions_of(snap, devices):
    return sorted({int(snap.accelerators.region[d]) for d in devices})


# fleet "two racks": region eu, 1 cluster, 2 racks x 2 nodes x 4 devices: nodes 0,1 (rack 0), 2,3 (rack 1)
TWO_RACKS = dict(clusters=1, racks=2, nodes=2, devices=4)

CASES = [
    pytest.param([make_job("p").tier(PREMIUM).ranks(2).on_devices(0, 1)], make_job("g").ranks(2),
                 {"nodes": [0], "level": "node"}, id="best-fit-picks-the-fullest-node-that-fits"),
    pytest.param([], make_job("g").ranks(4), {"nodes": [0], "level": "node"}, id="one-node-when-it-fits"),
    pytest.param([make_job("p").tier(PREMIUM).ranks(1).on_devices(0)], make_job("g").ranks(8),
                 {"nodes": [2, 3], "level": "rack"}, id="one-rack-when-no-node-fits"),
    # W = 12 over 4 + 4 + 3 + 1 devices: hosts holding unequal shares run ranks in proportion
    # (3 per device: runtime/multihost.py host_block)
    pytest.param([make_job("p").tier(PREMIUM).ranks(1).on_devices(0),
                  make_job("q").tier(PREMIUM).ranks(1).on_devices(8)], make_job("g").ranks(12),
                 {"nodes": [0, 1, 2, 3], "level": "cluster"}, id="one-cluster-when-no-rack-fits"),
    pytest.param([make_job("p").tier(PREMIUM).ranks(8).on_devices(*range(8))],
                 make_job("g").ranks(8).elastic(2), {"nodes": [2, 3], "count": 8},
                 id="elastic-takes-its-largest-count-that-fits"),
    pytest.param([make_job("p").tier(PREMIUM).ranks(12).on_devices(*range(12))],
                 make_job("g").ranks(8).elastic(2), {"nodes": [3], "count": 4},
                 id="elastic-settles-for-a-smaller-divisor"),
]


@pytest.mark.parametrize("running, job, expected", CASES)
def test_it_places_gangs_tightly(running, job, expected):
    builder = make_snapshot().fleet(make_fleet().region("eu", **TWO_RACKS))
    for r in running:
        builder.job(r)
    snap = builder.job(job).build()
    found, plan = starts(snap)
    start = found["g"]
    assert nodes_of(snap, start.devices) == expected["nodes"]
    if "level" in expected:
        assert f"on one {expected['level']}" in start.reason
    if "count" in expected:
        assert len(start.devices) == expected["count"]


def test_it_never_spans_regions_and_says_how_much_is_free_together():
    snap = (make_snapshot()
            .fleet(make_fleet().region("eu", nodes=1, devices=4).region("us", nodes=1, devices=4))
            .job(make_job("g").ranks(8)).build())
    found, plan = starts(snap)
    assert found == {}
    assert plan.waiting[0].reason.startswith("needs 8 H100-80GB in one region; at most 4 free together")


def test_it_looks_at_every_region():
    snap = (make_snapshot()
            .fleet(make_fleet().region("eu", nodes=1, devices=4).region("us", nodes=2, devices=4))
            .job(make_job("p").tier(PREMIUM).ranks(4).on_devices(0, 1, 2, 3))
            .job(make_job("g").ranks(8)).build())
    found, _ = starts(snap)
    assert regions_of(snap, found["g"].devices) == [1]
    assert "in us" in found["g"].reason


def test_it_gives_a_gang_nothing_rather_than_part():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4))
            .job(make_job("g").ranks(8)).job(make_job("small").ranks(2)).build())
    found, plan = starts(snap)
    assert list(found) == ["small"]
    assert [snap.jobs.name(w.job) for w in plan.waiting] == ["g"]


def test_it_skips_unhealthy_devices_and_draining_nodes():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=3, devices=2))
            .unhealthy(0).node(1, NODE_DRAINING)
            .job(make_job("g").ranks(2)).build())
    found, _ = starts(snap)
    assert nodes_of(snap, found["g"].devices) == [2]


def test_a_job_pinned_to_one_node_waits_rather_than_spread():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4))
            .job(make_job("p").tier(PREMIUM).ranks(2).on_devices(0, 1))
            .job(make_job("q").tier(PREMIUM).ranks(2).on_devices(4, 5))
            .job(make_job("g").ranks(4).spread(SPREAD_NODE)).build())
    found, plan = starts(snap)
    assert "g" not in found
    assert plan.waiting[0].reason.startswith("needs 4 H100-80GB in one node; at most 2 free together")


def test_a_type_with_no_devices_says_so():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=2))
            .types("H100-80GB", "MI300X").job(make_job("g").type("MI300X")).build())
    _, plan = starts(snap)
    assert plan.waiting[0].reason.startswith("no usable MI300X in the fleet")


# --- devices still being released (Accelerators.releasing_until) -------------------------
RELEASING_CASES = [
    # (releasing devices, until, ranks, expected nodes, expected starts_at - NOW)
    pytest.param((0, 1, 2, 3), 90.0, 2, [1], 0.0, id="free-now-devices-first"),
    pytest.param((0, 1, 2, 3), -5.0, 2, [0], 0.0, id="released-in-the-past-is-free-now"),
    pytest.param((0, 1, 2, 3, 4, 5, 6, 7), 90.0, 2, [0], 90.0, id="only-releasing-room-starts-after-it"),
    pytest.param((0, 1, 2, 3), 90.0, 8, [0, 1], 90.0, id="a-gang-that-needs-them-waits-for-them"),
]


@pytest.mark.parametrize("releasing, until, ranks, want_nodes, want_delay", RELEASING_CASES)
def test_devices_still_being_released_are_used_last_and_delay_the_start(releasing, until, ranks,
                                                                         want_nodes, want_delay):
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(1000.0)
            .releasing(*releasing, until=1000.0 + until).job(make_job("g").ranks(ranks)).build())
    got, _ = starts(snap)
    assert nodes_of(snap, got["g"].devices) == want_nodes
    assert got["g"].starts_at == 1000.0 + want_delay
    assert ("starting after the previous holder's checkpoint, in 90 s" in got["g"].reason) == (want_delay > 0)


def test_releasing_devices_are_taken_before_preempting_and_never_grown_into():
    from scheduler import BASIC, Preempt, Resize
    # node of 4: a Basic job holds 0-1; 2-3 are still being released by an earlier victim
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(1000.0)
            .releasing(2, 3, until=1030.0)
            .job(make_job("basic").tier(BASIC).ranks(2).running(2).started(0.0))
            .job(make_job("premium").tier(PREMIUM).ranks(2)).build())
    got, plan = starts(snap)
    assert got["premium"].devices == (2, 3) and got["premium"].starts_at == 1030.0
    assert not plan.of_kind(Preempt)
    # an elastic job does not grow into devices that are not free yet (it would pause for them)
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(1000.0)
            .releasing(2, 3, until=1030.0)
            .job(make_job("e").tier(BASIC).ranks(4).elastic(1).running(2).started(0.0)).build())
    assert not scheduler.schedule(snap).of_kind(Resize)


# fleet "uneven holes": 3 nodes x 2 devices, one device taken on nodes 0 and 1: free 1 + 1 + 2
def _uneven_holes(job):
    return (make_snapshot().fleet(make_fleet().region("eu", nodes=3, devices=2))
            .job(make_job("p").tier(PREMIUM).ranks(1).on_devices(0))
            .job(make_job("q").tier(PREMIUM).ranks(1).on_devices(2))
            .job(job).build())


def test_a_gang_is_placed_over_hosts_holding_unequal_shares():
    # 4 devices are free only as 2 + 1 + 1 over three hosts. Each host runs ranks in proportion to
    # its devices (W/d per device: runtime/multihost.py host_block), so the gang starts there; from
    # session 23 to 24 the core refused such shares (State.even_across_nodes) and the job waited.
    snap = _uneven_holes(make_job("g").ranks(4))
    found, plan = starts(snap)
    assert sorted(int(snap.accelerators.node[d]) for d in found["g"].devices) == [0, 1, 2, 2]
    assert not plan.waiting


def test_an_elastic_job_takes_its_largest_count_over_unequal_shares():
    snap = _uneven_holes(make_job("g").ranks(4).elastic(2))
    found, _ = starts(snap)
    assert len(found["g"].devices) == 4 and nodes_of(snap, found["g"].devices) == [0, 1, 2]


def test_a_gang_fills_the_fullest_nodes_first_even_when_that_splits_it_unequally():
    # free: node 0 has 3, nodes 1 and 2 have 2 each: W = 4 as 3 + 1 over two hosts (ranks 0..2 and
    # 3), the fewest hosts and the fullest first, not 2 + 2.
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=3, devices=4))
            .job(make_job("p").tier(PREMIUM).ranks(1).on_devices(0))
            .job(make_job("q").tier(PREMIUM).ranks(2).on_devices(4, 5))
            .job(make_job("r").tier(PREMIUM).ranks(2).on_devices(8, 9))
            .job(make_job("g").ranks(4)).build())
    found, _ = starts(snap)
    assert sorted(int(snap.accelerators.node[d]) for d in found["g"].devices) == [0, 0, 0, 1]
