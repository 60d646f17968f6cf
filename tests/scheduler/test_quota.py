"""Team quotas per type, and stated borrowing of idle capacity."""
import pytest

import scheduler
from scheduler import Start
from scheduler.builders import make_fleet, make_job, make_snapshot, make_team
from scheduler.plugins.quota import borrowing_jobs


def fleet(devices=8):
    return make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=devices)).now(1000.0)


@pytest.mark.parametrize("quota, borrow, expected", [
    pytest.param(8, True, ("placed", 0), id="within-quota"),
    pytest.param(2, True, ("borrowing idle capacity", 2), id="over-quota-borrows-idle"),
    pytest.param(2, False, None, id="over-quota-waits-when-borrowing-is-off"),
])
def test_admission_against_quota(quota, borrow, expected):
    snap = (fleet().settings(allow_borrowing=borrow).team(make_team("A").quota("H100-80GB", quota))
            .job(make_job("a").team("A").ranks(4)).build())
    plan = scheduler.schedule(snap)
    starts = plan.of_kind(Start)
    if expected is None:
        assert starts == []
        assert plan.waiting[0].code == "over quota"
        assert "holds 0 of its quota 2 H100-80GB; needs 4 more and borrowing is off" in plan.waiting[0].reason
    else:
        assert (starts[0].code, starts[0].borrowed) == expected
        if expected[1]:
            assert "2 of them borrowed over the team's quota (reclaimed first)" in starts[0].reason


def test_borrowers_are_the_youngest_jobs_covering_the_excess():
    snap = (fleet().team(make_team("A").quota("H100-80GB", 4))
            .job(make_job("oldest").team("A").ranks(2).running(2).started(10))
            .job(make_job("middle").team("A").ranks(2).running(2).started(20))
            .job(make_job("newest").team("A").ranks(2).running(2).started(30)).build())
    flags = borrowing_jobs(snap, snap.allocation_counts(), snap.team_usage())
    assert flags.tolist() == [False, False, True]  # 6 held, quota 4: the newest 2 are borrowed


def test_a_team_within_quota_never_counts_as_borrowing():
    snap = (fleet().team(make_team("A").quota("H100-80GB", 8))
            .job(make_job("a").team("A").ranks(8).running(8)).build())
    assert not borrowing_jobs(snap, snap.allocation_counts(), snap.team_usage()).any()
