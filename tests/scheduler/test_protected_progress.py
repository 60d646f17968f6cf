"""The most-progressed jobs yield to Premium only (PolicySettings.protected_progress_share).

With heavy-tailed durations the job that has done the most work is the likeliest to run the
longest: it sets the makespan and the p99 JCT. 2D-LAS alone makes it every arrival's first
victim (it is in the most-served queue), so the jobs with the most work done, up to a share of
the type's devices, are neither shrunk nor preempted for Basic or Standard jobs.
"""
import pytest
from plans import decisions

from scheduler import BASIC, PREMIUM, STANDARD
from scheduler.builders import make_fleet, make_job, make_snapshot
from scheduler.snapshot import PolicySettings, SnapshotError

NOW = 1_000_000.0
HOUR = 3600.0


def _fleet(preemptor, share=0.25, old=True, young=True, **settings):
    # one node of 8 (a share of 0.25 = 2 devices): a Premium job (never a victim) on the devices the
    # others leave (none free); two Basic
    # jobs of 2 in the most-served queue: "old" has done 100 h of work and checkpointed a minute
    # ago (the least lost work: the cost order's first victim), "young" 6 h, an hour ago
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .settings(protected_progress_share=share, **settings)
            .job(make_job("p").tier(PREMIUM).ranks(4 if young else 6).running(4 if young else 6).started(0.0)))
    if old:
        snap = snap.job(make_job("old").ranks(2).running(2).started(0.0).submitted(0.0)
                        .attained(1.0, ideal_device_seconds=2 * 100 * HOUR).checkpoint(NOW - 60.0, 10, 10**9))
    if young:
        snap = snap.job(make_job("young").ranks(2).running(2).started(NOW - 7 * HOUR).submitted(NOW - 7 * HOUR)
                        .attained(1.0, ideal_device_seconds=2 * 6 * HOUR).checkpoint(NOW - HOUR, 10, 10**9))
    return snap.job(preemptor.submitted(NOW)).build()


@pytest.mark.parametrize("tier", [BASIC, STANDARD])
def test_a_basic_or_standard_arrival_takes_the_less_progressed_victim(tier):
    got, _ = decisions(_fleet(make_job("new").tier(tier).ranks(2)))
    assert ("preempt", "young") in got and ("preempt", "old") not in got, got
    # without the protection the cost order takes the job with the least lost work: old
    got, _ = decisions(_fleet(make_job("new").tier(tier).ranks(2), share=0.0))
    assert ("preempt", "old") in got and ("preempt", "young") not in got, got


def test_the_protected_job_waits_out_a_basic_arrival_but_yields_to_premium():
    # only the most progressed job is left to take: a Basic job waits, a Premium one preempts it
    got, plan = decisions(_fleet(make_job("new").tier(BASIC).ranks(2), young=False))
    assert got == [] and [w.job_id for w in plan.waiting] == [plan.waiting[0].job_id]
    got, _ = decisions(_fleet(make_job("new").tier(PREMIUM).ranks(2), young=False))
    assert ("preempt", "old") in got and ("start", "new") in got, got


def test_the_share_counts_devices_from_the_most_progressed_down():
    # a share of 0.25 of 8 devices protects old's 2 only; 0.5 protects both, so the arrival waits
    got, _ = decisions(_fleet(make_job("new").tier(BASIC).ranks(2), share=0.5))
    assert got == [], got


def test_the_share_is_validated():
    with pytest.raises(SnapshotError, match="protected_progress_share"):
        PolicySettings(protected_progress_share=1.5)
