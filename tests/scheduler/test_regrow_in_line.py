"""Issue 16, session 20: a running job below W grows at its place in line, not only into the
devices no pending job took.

On a busy fleet the old rule left a long job shrunk for an arrival at W/4 for days: every device
that freed went to the next pending job, even one of its own tier and attained-service queue that
came after it in line (the Philly makespan job ran 1.35 d on one of its four devices). Its
missing devices are demand at its place in line, as a pending job's are; a pending job ahead of
it in line (a higher tier, a less-served queue) still goes first.
"""
from plans import decisions

from scheduler import STANDARD, Resize, Start
from scheduler.builders import make_fleet, make_job, make_snapshot

NOW = 100_000.0
SERVED = 50_000.0  # device-seconds: past both default attained-service thresholds (queue 2)


def _shrunk_and_waiting(waiting):
    # one 8-device node: "long" (Basic, W=4, elastic) runs shrunk on 2 devices; a rigid 4-device
    # job holds 4 more; 2 devices are free; `waiting` is the pending job that wants them
    return (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=8)).now(NOW)
            .job(make_job("long").ranks(4).elastic(1).running(2).submitted(0.0).started(10.0)
                 .attained(1.0, ideal_device_seconds=SERVED))
            .job(make_job("busy").ranks(4).running(4).submitted(0.0).started(10.0)
                 .attained(1.0, ideal_device_seconds=SERVED))
            .job(waiting).build())


def test_a_shrunk_job_grows_before_a_younger_pending_job_of_its_own_tier_and_queue():
    # "back" was preempted earlier (same tier, same queue) and was submitted after "long": it
    # comes after "long" in line, so "long" gets its devices back and "back" waits
    back = make_job("back").ranks(2).submitted(5_000.0).attained(1.0, ideal_device_seconds=SERVED)
    got, plan = decisions(_shrunk_and_waiting(back))
    assert got == [("resize", "long")]
    resize = plan.of_kind(Resize)[0]
    assert len(resize.devices) == 4
    assert "place in line" in resize.reason
    assert [w.job_id for w in plan.waiting] == [3]


def test_a_pending_job_ahead_in_line_still_takes_the_free_devices_first():
    # a fresh Basic job (least-served queue) and a Standard job come before "long" in line
    for ahead in (make_job("fresh").ranks(2).submitted(NOW - 60.0),
                  make_job("fresh").tier(STANDARD).ranks(2).submitted(NOW - 60.0)):
        got, plan = decisions(_shrunk_and_waiting(ahead))
        assert got == [("start", "fresh")]
        assert len(plan.of_kind(Start)[0].devices) == 2
