"""The engine's event logic on small traces whose outcomes are worked out by hand."""
import math

import numpy as np
import pytest
from sim_builders import HAND_COSTS, make_jobs

from scheduler.sim import costs as costs_module
from scheduler.sim import fleet as fleet_module
from scheduler.sim.baselines import Fifo, Tiresias
from scheduler.sim.engine import MIGRATE, RESIZE, START, Decision, Engine, Policy, SimulationError


class Script(Policy):
    """A policy that plays fixed decisions at given times (the engine is what is tested)."""

    name = "script"

    def __init__(self, steps):
        self.steps = sorted(steps, key=lambda s: s[0])  # (time, Decision)

    def schedule(self, engine, now):
        # each step is played once (an arrival and a wake-up at the same time are two passes)
        out = [d for t, d in self.steps if t == now]
        self.steps = [(t, d) for t, d in self.steps if t != now]
        later = [t for t, _ in self.steps if t > now]
        if later:
            engine.wake_at(min(later))
        return out


def run(trace, fleet, policy, tick_s=0.0, costs=HAND_COSTS, **kw):
    return Engine(trace, fleet, policy, costs=costs, tick_s=tick_s, **kw).run()


def test_fifo_two_jobs_on_four_devices_match_hand_computed_jcts():
    # A: 4 ranks, 100 s, at t=0 -> runs 0..100. B: 2 ranks, 50 s, at t=10 -> waits, runs 100..150.
    trace = make_jobs([(0, 100, 4), (10, 50, 2)])
    result = run(trace, fleet_module.uniform(1, 4), Fifo())
    assert result.first_start.tolist() == [0.0, 100.0]
    assert result.finish.tolist() == [100.0, 150.0]
    summary = result.summary()
    assert summary["avg_jct_s"] == pytest.approx((100 + 140) / 2)
    assert summary["avg_queue_s"] == pytest.approx((0 + 90) / 2)
    assert summary["makespan_s"] == pytest.approx(150)


def test_a_job_placed_on_devices_a_victim_still_checkpoints_starts_when_they_are_its_own():
    # A (Basic, 1 rank, 1000 s) runs from 0; B (Premium, 1 rank, 50 s) arrives at 10 and the
    # script preempts A and places B on A's device at 10. A's checkpoint takes 5 s, so B's device
    # is its own at 15: that is B's first start (the control plane's started_at comes from the
    # agent's running report), the 5 s before it are queueing. B runs 15..65 and so gets all of
    # its ideal device-time once started; counted from the placement it got 50/55 (< 0.95).
    from scheduler.sim.engine import PREEMPT
    from scheduler.sim.trace import BASIC, PREMIUM

    trace = make_jobs([(0, 1000, 1), (10, 50, 1)], tiers=[BASIC, PREMIUM])
    script = Script([(0.0, Decision(START, 0, np.array([0]))),
                     (10.0, Decision(PREEMPT, 0)), (10.0, Decision(START, 1, np.array([0])))])
    result = run(trace, fleet_module.uniform(1, 1), script, until=200.0)
    assert result.first_placed[1] == pytest.approx(10.0)
    assert result.first_start[1] == pytest.approx(15.0)
    assert result.finish[1] == pytest.approx(65.0)
    summary = result.summary()
    assert summary["sla_premium"] == 1.0
    assert summary["sla_premium_from_placement"] == 0.0
    assert summary["avg_queue_premium_s"] == pytest.approx(5.0)


def test_a_job_stopped_before_its_devices_were_its_own_has_not_started():
    # A (1 rank) runs from 0; B is placed on A's device at 10 (A's checkpoint: 5 s) and stopped
    # again at 12, before that device was ever B's: B's first start is its next start, at 20
    # (B restores: 7 s), not 15.
    from scheduler.sim.engine import PREEMPT

    trace = make_jobs([(0, 1000, 1), (10, 100, 1)])
    script = Script([(0.0, Decision(START, 0, np.array([0]))),
                     (10.0, Decision(PREEMPT, 0)), (10.0, Decision(START, 1, np.array([0]))),
                     (12.0, Decision(PREEMPT, 1)), (20.0, Decision(START, 1, np.array([0])))])
    result = run(trace, fleet_module.uniform(1, 1), script, until=30.0)
    assert result.first_placed[1] == pytest.approx(10.0)
    assert result.first_start[1] == pytest.approx(20.0)


def test_fifo_with_a_tick_starts_at_the_next_tick_boundary():
    # Same jobs, 60 s ticks: B's pass after A's completion at 100 runs at 120, so B ends at 170.
    trace = make_jobs([(0, 100, 4), (10, 50, 2)])
    result = run(trace, fleet_module.uniform(1, 4), Fifo(), tick_s=60.0)
    assert result.finish.tolist() == [100.0, 170.0]


def test_fifo_blocks_the_line_behind_a_job_that_does_not_fit():
    # A holds all 4 devices; B needs 4 and waits; C needs 1 and could run but FIFO keeps order.
    trace = make_jobs([(0, 100, 4), (1, 10, 4), (2, 10, 1)])
    result = run(trace, fleet_module.uniform(1, 4), Fifo())
    assert result.first_start.tolist() == [0.0, 100.0, 110.0]


def test_tiresias_preempts_the_job_with_more_attained_service_and_charges_checkpoint_and_restore():
    # A (2 ranks, 1000 s) passes 150 device-s at t=75 and drops to queue 1. B arrives at 100 in
    # queue 0: A is checkpointed (its devices are busy 5 s more), B runs 105..155. A restarts
    # at 155, restores for 7 s and needs its remaining 900 s: it ends at 1062.
    trace = make_jobs([(0, 1000, 2), (100, 50, 2)])
    result = run(trace, fleet_module.uniform(1, 2), Tiresias(thresholds=(150.0,)))
    assert result.n_preempt.tolist() == [1, 0]
    assert result.finish[1] == pytest.approx(155.0)
    assert result.finish[0] == pytest.approx(1062.0)


def test_fifo_never_preempts_the_same_jobs():
    trace = make_jobs([(0, 1000, 2), (100, 50, 2)])
    result = run(trace, fleet_module.uniform(1, 2), Fifo())
    assert result.n_preempt.tolist() == [0, 0]
    assert result.finish.tolist() == [1000.0, 1050.0]


def test_a_spliced_job_runs_at_d_over_w_times_the_splice_efficiency():
    # 4 ranks on 2 devices: 2/4 x 0.95 = 0.475 of full speed; 95 s of work take 200 s.
    trace = make_jobs([(0, 95, 4)])
    policy = Script([(0.0, Decision(START, 0, np.array([0, 1])))])
    result = run(trace, fleet_module.uniform(1, 4), policy)
    assert result.finish[0] == pytest.approx(200.0)
    assert result.summary()["util_allocated"] == pytest.approx(2 / 4)
    assert result.summary()["util_useful"] == pytest.approx(0.475 * 4 / 4)


def test_rate_formula():
    costs = costs_module.CostModel(splice_efficiency=0.9, time_slice_efficiency=0.8)
    assert costs.rate(8, 8) == 1.0
    assert costs.rate(2, 8) == pytest.approx(0.25 * 0.9)
    assert costs.rate(4, 4, share=2) == pytest.approx(0.8 / 2)


def test_a_resize_pays_the_state_move_and_then_runs_faster():
    # 4 ranks on 2 devices (0.475 speed) from 0; grown to 4 devices at t=100 with 47.5 s done.
    # The move of half the ranks' state costs 0.05 s fixed (inf bandwidths): the remaining
    # 52.5 s of work at full speed end at 100.05 + 52.5.
    trace = make_jobs([(0, 100, 4)])
    policy = Script([(0.0, Decision(START, 0, np.array([0, 1]))),
                     (100.0, Decision(RESIZE, 0, np.array([0, 1, 2, 3])))])
    costs = costs_module.CostModel(checkpoint_gb_per_s=float("inf"), restore_gb_per_s=float("inf"),
                                   checkpoint_fixed_s=0.05, splice_efficiency=0.95)
    result = run(trace, fleet_module.uniform(1, 4), policy, costs=costs)
    assert result.n_resize[0] == 1
    assert result.finish[0] == pytest.approx(100.05 + 52.5)


def test_a_migration_pays_checkpoint_transfer_and_restore():
    # 1 rank, 100 s; moved to the other node at t=50: 5 + 0 + 7 = 12 s lost, ends at 112.
    trace = make_jobs([(0, 100, 1)])
    policy = Script([(0.0, Decision(START, 0, np.array([0]))),
                     (50.0, Decision(MIGRATE, 0, np.array([1])))])
    result = run(trace, fleet_module.uniform(2, 1), policy)
    assert result.n_migrate[0] == 1
    assert result.finish[0] == pytest.approx(112.0)


def test_a_node_failure_restarts_the_job_from_its_last_periodic_checkpoint():
    # 1 rank, 5000 s, checkpoints every 1000 s of run time. Node 0 fails at 2500: the job
    # falls back to 2000 s of work (500 s lost), restarts at once on node 1, restores 7 s
    # and finishes its 3000 s left at 2507 + 3000.
    trace = make_jobs([(0, 5000, 1)])
    costs = costs_module.CostModel(**{**HAND_COSTS.__dict__, "periodic_checkpoint_s": 1000.0})
    result = run(trace, fleet_module.uniform(2, 1), Fifo(), costs=costs, failures=[(2500.0, 0)])
    assert result.n_fail[0] == 1
    assert result.lost_work[0] == pytest.approx(500.0)
    assert result.finish[0] == pytest.approx(5507.0)
    assert result.failures == 1


def test_a_failed_node_gets_nothing_until_it_is_repaired():
    # One node of 1 device fails at 10 with the job on it; repair takes 100 s: the job
    # restarts at 110 from its start (no checkpoint yet), restores 7 s, ends at 117 + 50.
    trace = make_jobs([(0, 50, 1)])
    costs = costs_module.CostModel(**{**HAND_COSTS.__dict__, "node_repair_s": 100.0})
    result = run(trace, fleet_module.uniform(1, 1), Fifo(), costs=costs, failures=[(10.0, 0)])
    assert result.lost_work[0] == pytest.approx(10.0)
    assert result.finish[0] == pytest.approx(167.0)


def test_seeded_failures_are_deterministic_and_depend_on_the_seed():
    trace = make_jobs([(i * 30.0, 2000.0 + 37 * i, 1 + (i % 2)) for i in range(40)])
    costs = costs_module.CostModel(node_mtbf_s=5000.0, node_repair_s=300.0)
    fleet = fleet_module.uniform(4, 2)
    first = run(trace, fleet, Tiresias(), tick_s=60.0, costs=costs, seed=3)
    again = run(trace, fleet, Tiresias(), tick_s=60.0, costs=costs, seed=3)
    other = run(trace, fleet, Tiresias(), tick_s=60.0, costs=costs, seed=4)
    assert first.failures > 0
    assert np.array_equal(first.finish, again.finish)
    assert np.array_equal(first.n_fail, again.n_fail)
    assert not np.array_equal(first.finish, other.finish)


def test_a_decision_that_gives_a_held_device_twice_is_a_policy_bug():
    trace = make_jobs([(0, 100, 1), (0, 100, 1)])
    policy = Script([(0.0, Decision(START, 0, np.array([0]))), (0.0, Decision(START, 1, np.array([0])))])
    with pytest.raises(SimulationError, match="held by jobs"):
        run(trace, fleet_module.uniform(1, 2), policy)


def test_a_device_count_that_does_not_divide_w_is_refused():
    trace = make_jobs([(0, 100, 4)])
    policy = Script([(0.0, Decision(START, 0, np.array([0, 1, 2])))])
    with pytest.raises(SimulationError, match="not an allowed size"):
        run(trace, fleet_module.uniform(1, 4), policy)


def test_every_job_of_a_busy_trace_finishes_under_every_baseline():
    trace = make_jobs([(i * 7.0, 100.0 + 13 * (i % 11), [1, 2, 4, 8][i % 4]) for i in range(120)])
    from scheduler.sim.baselines import Gandiva

    for policy in (Fifo(), Tiresias(), Gandiva()):
        result = run(trace, fleet_module.philly(servers_8=2, servers_2=2), policy, tick_s=30.0,
                     costs=costs_module.CostModel())
        assert not np.isnan(result.finish).any(), policy.name
        # Nobody finishes faster than alone at full size.
        assert (result.finish - result.first_start >= trace.duration - 1e-6).all(), policy.name
        s = result.summary()
        assert s["util_useful"] <= s["util_allocated"] + 1e-9
        assert math.isfinite(s["p99_jct_s"])


def test_gandiva_time_slices_two_jobs_at_half_speed_times_slicing_efficiency():
    # A (2 ranks, 100 s) runs alone 0..10; B (2 ranks, 100 s) then shares its devices: both run
    # at 0.5 x 0.97 = 0.485. A's last 90 s take 90 / 0.485 s; B has done 90 s by then and
    # finishes its last 10 s alone.
    from scheduler.sim.baselines import Gandiva

    trace = make_jobs([(0, 100, 2), (10, 100, 2)])
    result = run(trace, fleet_module.uniform(1, 2), Gandiva())
    a_end = 10 + 90 / 0.485
    assert result.first_start.tolist() == [0.0, 10.0]
    assert result.finish[0] == pytest.approx(a_end)
    assert result.finish[1] == pytest.approx(a_end + 10)


def test_gandiva_moves_a_time_sliced_job_onto_devices_that_free_up():
    # A on node 0, C on node 1, B time-slices A from t=2. C ends at 51: B migrates to node 1
    # (checkpoint 5 + restore 7 = 12 s) and runs alone from 63; A runs alone from 51.
    from scheduler.sim.baselines import Gandiva

    trace = make_jobs([(0, 1000, 2), (1, 50, 2), (2, 1000, 2)])
    result = run(trace, fleet_module.uniform(2, 2), Gandiva())
    shared = 49 * 0.485
    assert result.n_migrate.tolist() == [0, 0, 1]
    assert result.finish[1] == pytest.approx(51.0)
    assert result.finish[0] == pytest.approx(51 + (1000 - 2 - shared))
    assert result.finish[2] == pytest.approx(63 + (1000 - shared))
