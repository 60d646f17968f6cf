"""A tick searches once for a crowd of alike jobs that cannot start (issue 16, goal 4).

On a full fleet most of a long line fails: no idle room, nothing it may preempt. A job alike a
failed one (tier, type, team as its quota sees it, size, spread, attained-service queue) in the
same state fails the same way, so `scheduler.schedule` gives it that reason without searching
again; a device given or taken, a decision or a budget spent in between and it searches again.
"""
import dataclasses

from scheduler import BASIC, PREMIUM, Policy, schedule
from scheduler.builders import make_fleet, make_job, make_snapshot, make_team
from scheduler.plugins.preemption import SlaPreemption

NOW = 50_000.0


class CountingPreemption(SlaPreemption):
    """The default preemption step, counting the jobs it is asked about."""

    def __init__(self):
        self.asked = []

    def run(self, tick, j):
        self.asked.append(tick.snapshot.jobs.name(j))
        return super().run(tick, j)


def _policy():
    counting = CountingPreemption()
    return dataclasses.replace(Policy.default(), preempt=counting), counting


def _crowd(n, free=0, teams=("a", "b", "c")):
    # one node of 8; a Premium job (never a victim) holds all but `free`; n Basic jobs of 4 wait
    snap = make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
    for team in teams:
        snap = snap.team(make_team(team))
    snap = snap.job(make_job("p").team(teams[0]).tier(PREMIUM).ranks(8 - free).running(8 - free).started(0.0))
    for i in range(n):
        snap = snap.job(make_job(f"w{i}").team(teams[i % len(teams)]).tier(BASIC).ranks(4).submitted(float(i)))
    return snap.build()


def test_alike_jobs_that_cannot_start_are_searched_once_and_told_the_same_reason():
    policy, counting = _policy()
    plan = schedule(_crowd(30), policy)
    assert plan.decisions == ()
    assert len(counting.asked) == 1  # the first of 30 alike jobs, of three teams without quotas
    reasons = {w.reason for w in plan.waiting}
    codes = {w.code for w in plan.waiting}
    assert len(plan.waiting) == 30 and len(reasons) == 1 and len(codes) == 1
    # exactly what a job alone in line is told
    alone = schedule(_crowd(1))
    assert (alone.waiting[0].code, alone.waiting[0].reason) == (plan.waiting[0].code, plan.waiting[0].reason)


def test_a_job_searches_again_once_a_device_was_given_since():
    # 2 free: w0 (4) fails, w1 (2) starts on the 2, w2 (4, alike w0) must see 0 free, not 2
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .team(make_team("a"))
            .job(make_job("p").tier(PREMIUM).ranks(6).running(6).started(0.0))
            .job(make_job("w0").ranks(4).submitted(1.0))
            .job(make_job("w1").ranks(2).submitted(2.0))
            .job(make_job("w2").ranks(4).submitted(3.0)).build())
    policy, counting = _policy()
    plan = schedule(snap, policy)
    assert [snap.jobs.name(d.job) for d in plan.decisions] == ["w1"]
    assert counting.asked == ["w0", "w2"]
    why = {snap.jobs.name(w.job): w.reason for w in plan.waiting}
    assert "at most 2 free" in why["w0"] and "at most 0 free" in why["w2"], why


def test_teams_whose_quota_binds_search_each_for_itself():
    # team b is held to 0 devices (borrowing off): its job is told so, not a's reason
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .settings(allow_borrowing=False)
            .team(make_team("a")).team(make_team("b").quota("H100-80GB", 0))
            .job(make_job("p").team("a").tier(PREMIUM).ranks(8).running(8).started(0.0))
            .job(make_job("a1").team("a").ranks(4).submitted(1.0))
            .job(make_job("b1").team("b").ranks(4).submitted(2.0))
            .job(make_job("a2").team("a").ranks(4).submitted(3.0)).build())
    policy, counting = _policy()
    plan = schedule(snap, policy)
    why = {snap.jobs.name(w.job): (w.code, w.reason) for w in plan.waiting}
    assert why["a1"] == why["a2"] and why["b1"] != why["a1"], why
    assert "quota" in why["b1"][1]
    assert counting.asked == ["b1", "a1"]  # b1 first (team b holds nothing); a2 is alike a1
