"""The public interface: snapshots from lists and arrays, schedule(), apply_plan()."""
import numpy as np
import pytest

import scheduler
from scheduler import BASIC, PREMIUM, Accelerators, JobRow, Jobs, Snapshot, SnapshotError, Teams
from scheduler.builders import make_fleet, make_job, make_snapshot


def test_it_builds_the_same_snapshot_from_lists_and_from_arrays():
    columns = dict(type_id=[0, 0, 0, 0], node=[0, 0, 1, 1], rack=[0, 0, 0, 0], cluster=[0] * 4,
                   region=[0] * 4)
    from_lists = Accelerators(**columns)
    from_arrays = Accelerators(**{k: np.asarray(v) for k, v in columns.items()})
    for name in ("type_id", "node", "rack", "cluster", "region", "healthy", "holder"):
        assert np.array_equal(getattr(from_lists, name), getattr(from_arrays, name))
    assert from_lists.holder.tolist() == [-1] * 4
    with pytest.raises(ValueError):
        from_lists.holder[0] = 3  # frozen: read-only views


def test_it_does_not_copy_arrays_of_the_right_dtype():
    node = np.zeros(4, np.int32)
    acc = Accelerators(type_id=np.zeros(4, np.int16), node=node, rack=node, cluster=node, region=node)
    assert np.shares_memory(acc.node, node)


def test_it_builds_jobs_from_rows():
    jobs = Jobs.from_rows([JobRow(id=11, team=0, tier=BASIC, type_id=0, world_size=8, min_devices=2),
                           JobRow(id=12, team=0, tier=PREMIUM, type_id=0, world_size=3, name="p")])
    assert jobs.ids.tolist() == [11, 12]
    assert jobs.allowed_counts(0) == (8, 4, 2)
    assert jobs.allowed_counts(1) == (3,)
    assert jobs.name(1) == "p"


def test_a_plan_starts_what_fits_and_explains_the_rest():
    snap = (make_snapshot()
            .fleet(make_fleet().region("eu", racks=1, nodes=1, devices=8))
            .job(make_job("a").ranks(8).build())
            .job(make_job("b").ranks(4).build())
            .build())
    plan = scheduler.schedule(snap)
    assert [(d.kind, d.job) for d in plan.decisions] == [("start", 0)]
    assert [(w.job, w.place) for w in plan.waiting] == [(1, 1)]
    assert plan.waiting[0].reason.startswith("needs 4 H100-80GB in one region; at most 0 free together")
    after = scheduler.apply_plan(snap, plan, now=30.0).validate()
    assert after.allocation_counts().tolist() == [8, 0]
    assert after.jobs.last_start_time[0] == 30.0


def test_validate_names_a_job_spanning_regions():
    acc = Accelerators(type_id=[0, 0], node=[0, 1], rack=[0, 1], cluster=[0, 1], region=[0, 1],
                       holder=[0, 0])
    jobs = Jobs(ids=[1], team=[0], tier=[BASIC], type_id=[0], world_size=[2], state=[1])
    snap = Snapshot(accelerators=acc, jobs=jobs, teams=Teams(names=["t"]), now=0, type_names=["X"])
    with pytest.raises(SnapshotError, match="spans regions"):
        snap.validate()


def test_apply_plan_refuses_a_device_given_twice():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=2))
            .job(make_job("a").ranks(2)).job(make_job("b").ranks(2)).build())
    bad = scheduler.Plan(decisions=(
        scheduler.Start(job=0, job_id=1, devices=(0, 1), code="x", reason="x"),
        scheduler.Start(job=1, job_id=2, devices=(0, 1), code="x", reason="x")))
    with pytest.raises(scheduler.PlanConflict, match="held by job index 0"):
        scheduler.apply_plan(snap, bad, now=1.0)


def test_apply_plan_refuses_part_of_a_gang():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=4))
            .job(make_job("a").ranks(4)).build())
    bad = scheduler.Plan(decisions=(scheduler.Start(job=0, job_id=1, devices=(0, 1, 2), code="x", reason="x"),))
    with pytest.raises(scheduler.PlanConflict, match="not an allowed count"):
        scheduler.apply_plan(snap, bad, now=1.0)


def test_apply_plan_skips_preemptions_waiting_for_approval():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=2))
            .job(make_job("a").ranks(2).running(2)).build())
    plan = scheduler.Plan(decisions=(scheduler.Preempt(job=0, job_id=1, code="x", reason="x", needs_approval=True),))
    assert scheduler.apply_plan(snap, plan, now=1.0).allocation_counts().tolist() == [2]


def test_a_timer_gives_seconds_per_phase_and_no_timer_gives_none():
    ticks = iter(range(1000))
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=2))
            .job(make_job("a").ranks(2)).build())
    timed = scheduler.schedule(snap, timer=lambda: float(next(ticks)))
    assert set(timed.phase_seconds) >= {"1. snapshot", "2. order", "3. place", "7. plan"}
    assert all(v > 0 for v in timed.phase_seconds.values())
    assert scheduler.schedule(snap).phase_seconds == {}


def test_policy_names_unknown_plugins_clearly():
    with pytest.raises(KeyError, match="known plugins"):
        scheduler.Policy.from_names(order="order.lottery")
    assert scheduler.Policy.from_names(preempt=None).preempt is None


def test_rank_layout_puts_ranks_sharing_a_device_next_to_each_other():
    assert scheduler.rank_layout((10, 11), 4) == (10, 10, 11, 11)
    with pytest.raises(ValueError, match="cannot evenly run"):
        scheduler.rank_layout((1, 2, 3), 4)


@pytest.mark.parametrize("change, message", [
    pytest.param(dict(holder=[0, -1]), "holds 1 devices, not one of its allowed counts", id="partial-gang"),
    pytest.param(dict(type_id=[0, 1]), "holds a device of another type", id="wrong-type"),
    pytest.param(dict(holder=[5, 5]), "outside the job table", id="unknown-job"),
])
def test_validate_names_what_is_wrong(change, message):
    columns = dict(type_id=[0, 0], node=[0, 0], rack=[0, 0], cluster=[0, 0], region=[0, 0], holder=[0, 0])
    columns.update(change)
    jobs = Jobs(ids=[1], team=[0], tier=[BASIC], type_id=[0], world_size=[2], state=[1])
    snap = Snapshot(accelerators=Accelerators(**columns), jobs=jobs, teams=Teams(names=["t"]), now=0,
                    type_names=["X", "Y"])
    with pytest.raises(SnapshotError, match=message):
        snap.validate()


def test_apply_plan_records_the_checkpoint_a_preemption_takes():
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=2)).now(5000.0)
            .job(make_job("b").ranks(2).running(2).started(0).checkpoint(100.0))
            .job(make_job("p").tier(PREMIUM).ranks(2)).build())
    after = scheduler.apply_plan(snap, scheduler.schedule(snap), now=5030.0).validate()
    assert after.jobs.last_checkpoint_time.tolist()[0] == 5030.0
    assert after.jobs.state.tolist() == [0, 1]


def test_it_builds_accelerators_from_rows_like_from_columns():
    from scheduler import AcceleratorRow
    rows = [AcceleratorRow(type_id=0, node=0, rack=0, cluster=0, region=0),
            AcceleratorRow(type_id=0, node=1, rack=0, cluster=0, region=0, healthy=False, holder=0)]
    acc = Accelerators.from_rows(rows)
    assert acc.node.tolist() == [0, 1] and acc.healthy.tolist() == [True, False]
    assert acc.holder.tolist() == [-1, 0]


def test_plan_records_are_plain_json():
    import json
    snap = (make_snapshot().fleet(make_fleet().region("eu", nodes=1, devices=2))
            .job(make_job("a").ranks(2)).job(make_job("b").ranks(2)).build())
    records = scheduler.schedule(snap).as_records()
    assert [r["kind"] for r in records] == ["start", "wait"]
    assert records[0]["devices"] == [0, 1] and records[1]["place"] == 1
    assert json.loads(json.dumps(records)) == records
