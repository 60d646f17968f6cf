"""Tier policy (PolicySettings.full_size_tiers): which tiers start only at their full world size W."""
import pytest

import scheduler
from scheduler import BASIC, PREMIUM, STANDARD, Preempt, Start
from scheduler.builders import make_fleet, make_job, make_snapshot

NOW = 10_000.0
DEFAULT = object()  # PolicySettings' own default: Premium only


def half_busy(tier, full_size_tiers, floor_speed_tiers=DEFAULT):
    """One node of 4; a Premium job (never a victim) holds 2; an elastic job of W=4 (min 1) of
    `tier` arrives: 2 devices are free, W is not."""
    builder = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(NOW)
               .job(make_job("holder").tier(PREMIUM).ranks(2).running(2).started(0.0))
               .job(make_job("new").tier(tier).ranks(4).elastic(1)))
    settings = {name: value for name, value in (("full_size_tiers", full_size_tiers),
                                                ("floor_speed_tiers", floor_speed_tiers)) if value is not DEFAULT}
    if settings:
        builder.settings(**settings)
    return builder.build()


TIER_CASES = [
    pytest.param(PREMIUM, DEFAULT, None, id="premium-waits-for-W-by-default"),
    # 2 of W=4 runs at 47.5%, under Standard's 70% floor (PolicySettings.floor_speed_tiers)
    pytest.param(STANDARD, DEFAULT, None, id="standard-waits-for-its-floor-speed-by-default"),
    pytest.param(STANDARD, DEFAULT, 2, (), id="standard-starts-shrunk-when-no-tier-keeps-its-floor-speed"),
    pytest.param(BASIC, DEFAULT, 2, id="basic-starts-shrunk-by-default"),
    pytest.param(PREMIUM, (), 2, DEFAULT, id="premium-starts-shrunk-when-no-tier-is-full-size"),
    pytest.param(STANDARD, (PREMIUM, STANDARD), None, (), id="standard-waits-when-its-tier-is-full-size"),
    pytest.param(BASIC, (PREMIUM, STANDARD), 2, DEFAULT, id="basic-still-starts-shrunk"),
]


@pytest.mark.parametrize("tier, full_size_tiers, started_on, floor_speed_tiers",
                         [p if len(p.values) == 4 else pytest.param(*p.values, DEFAULT, id=p.id) for p in TIER_CASES])
def test_which_tiers_start_only_at_full_size(tier, full_size_tiers, started_on, floor_speed_tiers):
    snap = half_busy(tier, full_size_tiers, floor_speed_tiers)
    plan = scheduler.schedule(snap)
    scheduler.apply_plan(snap, plan, NOW + 1).validate()
    starts = {snap.jobs.name(d.job): len(d.devices) for d in plan.of_kind(Start)}
    assert starts.get("new") == started_on
    if started_on is None:
        assert "needs 4 H100-80GB" in plan.wait_reason(snap.jobs.names.index("new")).reason


def test_a_full_size_premium_job_preempts_for_W_rather_than_starting_shrunk():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(NOW)
            .job(make_job("basic").tier(BASIC).ranks(2).running(2).started(0.0))
            .job(make_job("premium").tier(PREMIUM).ranks(4).elastic(1)).build())
    plan = scheduler.schedule(snap)
    scheduler.apply_plan(snap, plan, NOW + 1).validate()
    assert [snap.jobs.name(d.job) for d in plan.of_kind(Preempt)] == ["basic"]
    assert [len(d.devices) for d in plan.of_kind(Start)] == [4]


def test_an_unknown_tier_in_the_setting_is_refused():
    with pytest.raises(scheduler.SnapshotError, match="unknown tier"):
        scheduler.PolicySettings(full_size_tiers=(7,))


# --- PolicySettings.premium_reserve_devices: idle devices only Premium jobs may take ----------
def reserve_fleet(reserve, *jobs):
    """2 nodes x 4; a Basic job holds devices 0-2 of node 0, so node 0 has 1 free, node 1 has 4."""
    builder = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(NOW)
               .settings(premium_reserve_devices=reserve)
               .job(make_job("holder").tier(BASIC).ranks(3).on_devices(0, 1, 2).started(NOW - 60)))
    for job in jobs:
        builder.job(job)
    return builder.build()


RESERVE_CASES = [
    # (reserve, arriving jobs, expected {name: devices started on}, a waiting job's reason part)
    pytest.param(0, [make_job("b1").ranks(1)], {"b1": (3,)}, None, id="no-reserve-basic-takes-the-hole"),
    pytest.param(1, [make_job("b1").ranks(1)], {"b1": (4,)}, None,
                 id="reserve-is-the-hole-basic-goes-elsewhere"),
    pytest.param(1, [make_job("p1").tier(PREMIUM).ranks(1)], {"p1": (3,)}, None, id="premium-takes-the-reserve"),
    pytest.param(1, [make_job("b4").ranks(4)], {"b4": (4, 5, 6, 7)}, None, id="a-gang-keeps-its-whole-node"),
    pytest.param(5, [make_job("b1").ranks(1), make_job("p1").tier(PREMIUM).ranks(1)], {"p1": (3,)},
                 "kept for Premium arrivals", id="all-idle-reserved-basic-waits-premium-starts"),
    # Premium jobs in a row share one opening of the reserve; the Basic job after them still waits.
    pytest.param(5, [make_job("b1").ranks(1), make_job("p1").tier(PREMIUM).ranks(1),
                     make_job("p2").tier(PREMIUM).ranks(1)], {"p1": (3,), "p2": (4,)},
                 "kept for Premium arrivals", id="premium-jobs-in-a-row-then-basic-waits"),
]


@pytest.mark.parametrize("reserve, arriving, expected, waits", RESERVE_CASES)
def test_idle_devices_kept_for_premium_arrivals(reserve, arriving, expected, waits):
    snap = reserve_fleet(reserve, *arriving)
    plan = scheduler.schedule(snap)
    scheduler.apply_plan(snap, plan, NOW + 1).validate()
    assert {snap.jobs.name(d.job): d.devices for d in plan.of_kind(Start)} == expected
    if waits:
        assert all(waits in w.reason for w in plan.waiting)


def test_growth_leaves_the_reserve_idle():
    from scheduler import Resize
    for reserve, grown in ((0, True), (2, False)):
        snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(NOW)
                .settings(premium_reserve_devices=reserve)
                .job(make_job("e").tier(BASIC).ranks(4).elastic(1).running(2).started(0.0)).build())
        assert bool(scheduler.schedule(snap).of_kind(Resize)) == grown


# --- PolicySettings.packed_tiers: start as packed as the fleet allows --------------------------
def scattered(tier, packed_tiers=DEFAULT, ranks=4):
    """2 nodes x 4 (one rack); just-started (not preemptible) Basic jobs hold 2 devices on each
    node: 4 are free in the region, 2 per node."""
    builder = (make_snapshot().fleet(make_fleet().region("eu", nodes=2, devices=4)).now(NOW)
               .job(make_job("a").tier(BASIC).ranks(2).on_devices(0, 1).started(NOW - 60))
               .job(make_job("b").tier(BASIC).ranks(2).on_devices(4, 5).started(NOW - 60))
               .job(make_job("new").tier(tier).ranks(ranks)))
    if packed_tiers is not DEFAULT:
        builder.settings(packed_tiers=packed_tiers)
    return builder.build()


PACKED_CASES = [
    pytest.param(PREMIUM, DEFAULT, 4, None, "needs 4 H100-80GB in one node", id="premium-waits-for-one-node"),
    pytest.param(PREMIUM, (), 4, (2, 3, 6, 7), None, id="premium-spreads-when-not-packed"),
    pytest.param(BASIC, DEFAULT, 4, (2, 3, 6, 7), None, id="basic-spreads-by-default"),
    pytest.param(PREMIUM, DEFAULT, 2, (2, 3), None, id="premium-fits-one-node"),
    # W=8 fits no node (4 each) but the rack (8): it packs to the rack, and 4 of the 8 are held
    pytest.param(PREMIUM, DEFAULT, 8, None, "needs 8 H100-80GB in one rack",
                 id="premium-larger-than-any-node-packs-to-the-rack"),
]


@pytest.mark.parametrize("tier, packed_tiers, ranks, devices, reason", PACKED_CASES)
def test_which_tiers_start_only_packed(tier, packed_tiers, ranks, devices, reason):
    snap = scattered(tier, packed_tiers, ranks)
    plan = scheduler.schedule(snap)
    scheduler.apply_plan(snap, plan, NOW + 1).validate()
    starts = {snap.jobs.name(d.job): d.devices for d in plan.of_kind(Start)}
    assert starts.get("new") == devices
    if reason:
        assert reason in plan.wait_reason(snap.jobs.names.index("new")).reason
