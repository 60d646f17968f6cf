"""Queue order: tier, then fair share (dominant share with decayed past usage), then age."""
import pytest

import scheduler
from scheduler import BASIC, PREMIUM, STANDARD, Policy
from scheduler.builders import make_fleet, make_job, make_snapshot, make_team

DAY = 86400.0


def line(snap, order="order.tier_fair_share"):
    """Returns the names of pending jobs in line order (on a fleet too small to start any)."""
    plan = scheduler.schedule(snap, Policy.from_names(order=order))
    return [snap.jobs.name(w.job) for w in sorted(plan.waiting, key=lambda w: w.place)]


def full_fleet():
    # one node of 1 device, held by a job of team C, so nothing pending can start
    return make_fleet().region("eu", nodes=1, devices=1)


CASES = [
    pytest.param(
        [make_job("basic-old").tier(BASIC).submitted(0), make_job("premium-new").tier(PREMIUM).submitted(50),
         make_job("standard").tier(STANDARD).submitted(10)],
        {}, ["premium-new", "standard", "basic-old"], id="tier-before-age"),
    pytest.param(
        [make_job("a1").team("A").submitted(0), make_job("b1").team("B").submitted(10)],
        {"A": 0.0, "B": 0.0}, ["a1", "b1"], id="equal-shares-older-first"),
    pytest.param(
        [make_job("a1").team("A").submitted(0), make_job("b1").team("B").submitted(10)],
        {"A": 7 * DAY * 1.0, "B": 0.0}, ["b1", "a1"], id="past-usage-puts-team-behind"),
    pytest.param(
        [make_job("a1").team("A").submitted(0), make_job("a2").team("A").submitted(1),
         make_job("a3").team("A").submitted(2), make_job("b1").team("B").submitted(3),
         make_job("b2").team("B").submitted(4)],
        {}, ["a1", "b1", "a2", "b2", "a3"], id="teams-take-turns"),
]


@pytest.mark.parametrize("jobs, past, expected", CASES)
def test_it_orders_the_line(jobs, past, expected):
    builder = make_snapshot().fleet(full_fleet()).now(100.0)
    for name in ("A", "B", "C"):
        team = make_team(name)
        if name in past:
            team.past_usage("H100-80GB", past[name])
        builder.team(team)
    builder.job(make_job("holder").team("C").tier(PREMIUM).running(1))
    for job in jobs:
        builder.job(job)
    assert line(builder.build()) == expected


def test_decayed_usage_stops_counting_once_it_has_decayed():
    # A burst a month ago (decayed by the caller to ~1/16) weighs less than B's steady use now
    builder = make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(100.0)
    builder.team(make_team("A").past_usage("H100-80GB", 4 * 7 * DAY / 0.693 / 16))
    builder.team(make_team("B"))
    builder.job(make_job("b-running").team("B").ranks(4).running(4))
    builder.job(make_job("a1").team("A").submitted(5)).job(make_job("b1").team("B").submitted(0))
    assert line(builder.build()) == ["a1", "b1"]


def test_weight_doubles_a_teams_entitlement():
    builder = make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4)).now(100.0)
    builder.team(make_team("A").weight(4.0)).team(make_team("B"))
    builder.job(make_job("a-running").team("A").ranks(2).running(2))
    builder.job(make_job("b-running").team("B").ranks(2).running(2))
    builder.job(make_job("b1").team("B").submitted(0)).job(make_job("a1").team("A").submitted(5))
    assert line(builder.build()) == ["a1", "b1"]


@pytest.mark.parametrize("order, expected", [
    pytest.param("order.fifo", ["old-basic", "new-premium"], id="fifo-ignores-tier"),
    pytest.param("order.least_attained", ["new-premium", "old-basic"], id="least-attained-first"),
])
def test_baseline_orders(order, expected):
    snap = (make_snapshot().fleet(full_fleet())
            .job(make_job("holder").tier(PREMIUM).running(1))
            .job(make_job("old-basic").tier(BASIC).submitted(0).attained(0.5, 1000))
            .job(make_job("new-premium").tier(PREMIUM).submitted(9).attained(0.1, 1000))
            .now(10).build())
    assert line(snap, order) == expected


def test_decay_usage_converges_to_the_devices_held():
    import math

    from scheduler.plugins.order import decay_usage
    usage = 0.0
    for _ in range(1000):  # 1000 h = ~42 half-lives
        usage = decay_usage([[usage]], [[8]], seconds=3600.0, half_life_seconds=DAY)[0, 0]
    assert usage * math.log(2) / DAY == pytest.approx(8.0, rel=1e-3)
    assert decay_usage([[100.0]], [[0]], seconds=DAY, half_life_seconds=DAY)[0, 0] == pytest.approx(50.0)
