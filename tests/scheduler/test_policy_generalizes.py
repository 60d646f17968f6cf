"""Issue 16's structural changes: attained-service queues, the shared placement cost, Premium
starts that do not wait for a victim's checkpoint. Each case fails on the policy before them."""
import numpy as np
import pytest
from plans import decisions

import scheduler
from scheduler import BASIC, PREMIUM, STANDARD, Preempt, Start, placement_cost
from scheduler.builders import make_fleet, make_job, make_snapshot

NOW = 100_000.0


# --- attained-service queues (2D-LAS) within a tier ---------------------------------------
def test_a_short_basic_job_is_not_starved_behind_a_long_large_one():
    # one 8-device node, all held by a Basic job that already ran 8 devices x 40,000 s
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .job(make_job("long").tier(BASIC).ranks(8).running(8).started(0.0).checkpoint(NOW - 60)
                 .attained(1.0, ideal_device_seconds=8 * 40_000.0))
            .job(make_job("short").tier(BASIC).ranks(1).submitted(NOW - 10)).build())
    got, plan = decisions(snap)
    assert got == [("preempt", "long"), ("start", "short")]
    assert plan.of_kind(Preempt)[0].code == "preempted for a less-served job"


def test_a_job_within_its_no_thrash_window_is_not_preempted_for_a_less_served_one():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .job(make_job("long").tier(BASIC).ranks(8).running(8).started(NOW - 60)
                 .attained(1.0, ideal_device_seconds=8 * 40_000.0))
            .job(make_job("short").tier(BASIC).ranks(1)).build())
    assert decisions(snap)[0] == []


@pytest.mark.parametrize("victim_tier, preemptor_tier", [(BASIC, STANDARD), (STANDARD, STANDARD)])
def test_attained_service_preempts_only_within_basic(victim_tier, preemptor_tier):
    # a Standard preemptor takes a Basic victim for its tier (as before), never a Standard one for service
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .job(make_job("long").tier(victim_tier).ranks(8).running(8).started(0.0)
                 .attained(1.0, ideal_device_seconds=8 * 40_000.0))
            .job(make_job("short").tier(preemptor_tier).ranks(1)).build())
    got, _ = decisions(snap)
    assert (("preempt", "long") in got) == (victim_tier == BASIC)


def test_within_a_tier_the_less_served_job_is_first_in_line():
    # nothing can start (the node is held by a Premium job); a long-served requeued Basic job
    # submitted first stands behind a new one
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=1)).now(NOW)
            .job(make_job("p").tier(PREMIUM).running(1).started(0.0))
            .job(make_job("served").tier(BASIC).submitted(0.0).attained(1.0, ideal_device_seconds=50_000.0))
            .job(make_job("new").tier(BASIC).submitted(NOW - 5)).build())
    plan = scheduler.schedule(snap)
    assert [snap.jobs.name(w.job) for w in sorted(plan.waiting, key=lambda w: w.place)] == ["new", "served"]


# --- Premium starts that do not wait for a victim's checkpoint -------------------------------
def _busy_fleet():
    # 25 nodes x 4 = 100 devices: 99 held by 1-device Basic jobs, device 99 free
    b = make_snapshot().fleet(make_fleet().region("eu", nodes=25, devices=4)).now(NOW)
    for i in range(99):
        b = b.job(make_job(f"b{i}").tier(BASIC).on_devices(i).started(0.0).checkpoint(NOW - 60))
    return b


def test_a_premium_arrival_starts_on_a_device_free_now_not_on_a_victims():
    # the reserve (1% of 100 devices) keeps device 99 from a Basic arrival ...
    snap = _busy_fleet().job(make_job("basic-new").tier(BASIC)).build()
    got, plan = decisions(snap)
    assert got == []
    assert "kept for Premium arrivals" in plan.waiting[0].reason
    # ... so a Premium arrival starts on it at once: no victim, no checkpoint to wait for
    snap = _busy_fleet().job(make_job("premium").tier(PREMIUM)).build()
    got, plan = decisions(snap)
    assert got == [("start", "premium")]
    start = plan.of_kind(Start)[0]
    assert start.devices == (99,) and start.starts_at == NOW


def test_a_premium_preemptor_takes_the_victim_whose_checkpoint_is_written_first():
    # both victims are eligible; "stale" lost more work, but "big" takes 30x longer to checkpoint
    def snap(tier):
        return (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=2)).now(NOW)
                .job(make_job("big").tier(BASIC).running(1).started(0.0).checkpoint(NOW - 10, size_bytes=30 * 10**9))
                .job(make_job("stale").tier(BASIC).running(1).started(0.0).checkpoint(NOW - 1500, size_bytes=10**9))
                .job(make_job("new").tier(tier)).build())
    assert decisions(snap(PREMIUM))[0] == [("preempt", "stale"), ("start", "new")]
    # a Standard preemptor does not wait on an SLA clock: least lost work, as before
    assert decisions(snap(STANDARD))[0] == [("preempt", "big"), ("start", "new")]


# --- one placement cost, shared by the core and the simulator -----------------------------
def _scattered_racks():
    # rack 0: 4 nodes of 8, each with 4 free (16 free, scattered); rack 1: 3 nodes of 8, two
    # of them whole and free (16 free on 2 nodes) and one with 2 free
    b = make_snapshot().fleet(make_fleet().region("eu", racks=2, nodes=4, devices=8)).now(NOW)
    for node in range(4):
        b = b.job(make_job(f"half{node}").ranks(4).running(4, node=node).started(0.0))
    b = b.job(make_job("rest").ranks(6).running(6, node=6).started(0.0))
    b = b.job(make_job("full7").ranks(8).running(8, node=7).started(0.0))
    return b


@pytest.mark.parametrize("tier", [BASIC, PREMIUM])
def test_a_gang_gets_the_fewest_nodes_not_the_best_fitting_rack(tier):
    snap = _scattered_racks().job(make_job("g").tier(tier).ranks(16)).build()
    got, plan = decisions(snap)
    start = plan.of_kind(Start)[0]
    nodes = sorted(set(snap.accelerators.node[list(start.devices)].tolist()))
    assert nodes == [4, 5]
    assert placement_cost.speed(16, 16, len(nodes), 8) == 1.0


def test_a_gang_spreads_out_only_when_no_packed_place_exists():
    # 16 devices free, but 4 per node (nodes 0-3, half held by Premium jobs); nodes 4-5 are held
    # by two 8-device Premium jobs. A Basic gang takes the scattered 16 (at 0.9)
    def snap(tier, basic_victims=True, **settings):
        b = make_snapshot().fleet(make_fleet().region("eu", racks=1, nodes=6, devices=8)).now(NOW)
        if settings:
            b = b.settings(**settings)
        for node in range(4):
            b = b.job(make_job(f"p{node}").tier(PREMIUM).ranks(4).running(4, node=node).started(0.0))
        for node in (4, 5):
            b = b.job(make_job(f"v{node}").tier(BASIC if basic_victims else PREMIUM).ranks(8)
                      .running(8, node=node).started(0.0))
        return b.job(make_job("g").tier(tier).ranks(16)).build()

    def nodes_of_start(s, plan):
        return sorted(set(s.accelerators.node[list(plan.of_kind(Start)[0].devices)].tolist()))

    s = snap(BASIC)
    got, plan = decisions(s)
    assert got == [("start", "g")] and nodes_of_start(s, plan) == [0, 1, 2, 3]
    # a Premium gang: no packed place is free and preempting cannot make one (every holder is
    # Premium). Spread out it would run at 0.9 and miss its 95% from the first second: it waits,
    # and says why and which setting would let it spread
    s = snap(PREMIUM, basic_victims=False)
    got, plan = decisions(s)
    assert got == []
    (waiting,) = plan.waiting
    assert "waits for a packed place" in waiting.reason and "MERIDIAN_PACKED_TIERS_MAY_SPREAD" in waiting.reason
    # where the operator prefers an early start to the SLA, it runs spread out rather than wait
    s = snap(PREMIUM, basic_victims=False, packed_tiers_may_spread=True)
    got, plan = decisions(s)
    assert got == [("start", "g")] and nodes_of_start(s, plan) == [0, 1, 2, 3]


@pytest.mark.parametrize("ranks, devices_on_nodes", [
    (16, (8, 8)), (16, (8, 4, 4)), (4, (2, 2)), (4, (4,)), (8, (2, 2, 2, 2)), (2, (1, 1)), (8, (4,)),
])
def test_the_core_and_the_simulator_charge_a_placement_the_same(ranks, devices_on_nodes):
    """The engine's rate of a job started on a placement equals scheduler.placement_cost's."""
    from scheduler.sim.costs import CostModel
    from scheduler.sim.engine import START, Decision, Engine, Policy
    from scheduler.sim.fleet import philly
    from scheduler.sim.trace import make_trace

    fleet = philly(servers_8=4, servers_2=4)  # nodes 0-3 have 8 devices, 4-7 have 2
    first = fleet.node_first_device
    devices = []
    eights = iter(range(4))
    twos = iter(range(4, 8))
    for take in devices_on_nodes:
        node = next(eights) if take > 2 else next(twos)
        devices.extend(range(int(first[node]), int(first[node]) + take))
    trace = make_trace("one", [0.0], [3600.0], [ranks], [0], ["t"], seed=0)
    trace = trace.__class__(**{**trace.__dict__, "min_devices": np.array([1], np.int32)})

    class Once(Policy):
        name = "once"

        def schedule(self, engine, now):
            if engine.pending:
                return [Decision(START, 0, np.asarray(devices, np.int64), "test")]
            return []

    engine = Engine(trace, fleet, Once(), costs=CostModel(), tick_s=60.0, seed=0, until=60.0)
    engine.run()
    d = len(devices)
    want = placement_cost.speed(d, ranks, len(devices_on_nodes), int(fleet.node_devices.max()))
    assert engine.rate[0] == pytest.approx(want)
    assert CostModel().placement_speed(d, ranks, len(devices_on_nodes), int(fleet.node_devices.max())) \
        == pytest.approx(want)
