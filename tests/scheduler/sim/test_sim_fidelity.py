"""Simulator fidelity (issue 16): start-up costs, approvals answered by a model, heterogeneous
fleets, and replays that always terminate (impossible jobs rejected, stranded jobs reported)."""
import dataclasses

import numpy as np
import pytest
from sim_builders import HAND_COSTS, make_jobs

from scheduler.sim import fleet as fleet_module
from scheduler.sim import make_policy
from scheduler.sim.baselines import Fifo, Tiresias
from scheduler.sim.engine import Engine, Policy
from scheduler.sim.fidelity import ApprovalModel, FidelityError, StartupCosts
from scheduler.sim.meridian import Meridian
from scheduler.sim.trace import PREMIUM, STANDARD

POLICIES = ("fifo", "tiresias", "gandiva", "meridian")


def run(trace, fleet, policy, tick_s=0.0, **kw):
    if isinstance(policy, str):
        policy = make_policy(policy)
    return Engine(trace, fleet, policy, costs=HAND_COSTS, tick_s=tick_s, **kw).run()


def rigid(trace):
    return dataclasses.replace(trace, min_devices=trace.ranks.copy())


# ----- termination -------------------------------------------------------------------------

@pytest.mark.parametrize("name", POLICIES)
def test_a_job_no_region_can_ever_hold_is_rejected_and_the_replay_ends(name):
    # 8 devices; job 1 asks for W=64 (elastic floor 16): it can never start under any policy.
    # Before: the baselines left it unfinished and Meridian woke every 600 s until `until`.
    trace = make_jobs([(0, 100, 2), (10, 50, 64), (20, 30, 1)])
    result = run(trace, fleet_module.uniform(2, 4), name, until=30 * 86400.0)
    assert result.rejected.tolist() == [False, True, False]
    assert not np.isnan(result.finish[[0, 2]]).any()
    assert result.end_time < 1000.0  # it ended when the other jobs did, not at `until`
    assert "one region of the fleet has at most 8" in result.rejections[0][1]
    summary = result.summary()
    assert summary["rejected"] == 1 and summary["finished"] == 2 and summary["stranded"] == 0


@pytest.mark.parametrize("name, rejected", [("fifo", True), ("tiresias", True), ("gandiva", True),
                                            ("meridian", False)])
def test_a_job_that_fits_only_spliced_is_rejected_by_the_full_size_baselines_only(name, rejected):
    # W=16 on 8 devices: Meridian runs it on 4 or 8 devices (floor 4); the baselines never can.
    trace = make_jobs([(0, 100, 16)])
    result = run(trace, fleet_module.uniform(2, 4), name)
    assert bool(result.rejected[0]) is rejected
    assert bool(np.isnan(result.finish[0])) is rejected
    if rejected:
        assert "full size" in result.rejections[0][1]


class NeverStarts(Policy):
    """A broken policy: wakes every 600 s and never starts anything."""

    name = "never"

    def schedule(self, engine, now):
        engine.wake_at(now + 600.0)
        return []


def test_a_policy_that_never_places_a_fitting_job_is_reported_not_waited_on():
    trace = make_jobs([(0, 100, 1)])
    engine = Engine(trace, fleet_module.uniform(1, 2), NeverStarts(), costs=HAND_COSTS, tick_s=0.0)
    result = engine.run()
    assert result.stranded.tolist() == [True]
    assert engine.passes <= 4
    assert result.summary()["stranded"] == 1


# ----- start-up ---------------------------------------------------------------------------

def test_the_first_allocation_pays_its_class_start_up_and_a_restart_pays_the_restore():
    # Tiresias scenario of test_sim_engine with start-up single=0, node=20: A (2 ranks, 1000 s)
    # starts at 0, progresses from 20; it crosses 150 device-s at 95. B (2 ranks, 50 s) comes at
    # 100 and preempts A (checkpoint 5 s); B starts at 105, pays 20 s start-up, ends at 175.
    # A restarts at 175, restores 7 s (no second start-up), needs 1000 - 80 s: ends at 1102.
    trace = make_jobs([(0, 1000, 2), (100, 50, 2)])
    startup = StartupCosts(single=0.0, node=20.0, multinode=99.0)
    result = run(trace, fleet_module.uniform(1, 2), Tiresias(thresholds=(150.0,)), startup=startup)
    assert result.n_preempt.tolist() == [1, 0]
    assert result.finish[1] == pytest.approx(175.0)
    assert result.finish[0] == pytest.approx(1102.0)
    # Neither the job's own start-up nor the wait for its victim's checkpoint count against its
    # SLA: B was placed at 100, its devices were its own at 105 (its first start), so it
    # delivered 50 / (175 - 105 - 20); counted from the placement, 50 / (175 - 100 - 20).
    assert result.first_placed[1] == pytest.approx(100.0)
    assert result.first_start[1] == pytest.approx(105.0)
    assert result.delivered_fraction()[1] == pytest.approx(1.0)
    assert result.delivered_fraction(since=result.first_placed)[1] == pytest.approx(50 / 55)


def test_start_up_classes_follow_the_job_size():
    costs = StartupCosts(single=1.0, node=2.0, multinode=3.0)
    assert costs.per_job(np.array([1, 2, 8, 9, 64])).tolist() == [1.0, 2.0, 2.0, 3.0, 3.0]
    assert StartupCosts.parse("none").per_job(np.array([1, 64])).tolist() == [0.0, 0.0]
    assert StartupCosts.parse("node=30").node == 30.0 and StartupCosts.parse("node=30").single == 75.0


@pytest.mark.parametrize("spec, message", [("gpu=3", "unknown job class 'gpu'"), ("single=x", "number of seconds"),
                                           ("single=-1", ">= 0")])
def test_a_bad_start_up_spec_says_how_to_write_it(spec, message):
    with pytest.raises(FidelityError, match=message):
        StartupCosts.parse(spec)


# ----- approvals --------------------------------------------------------------------------

def approval_trace():
    # Premium A (W=2, 1000 s) then Standard B (W=2, 10,000 s) at 0: B starts at 1000. Premium C
    # arrives at 3000 when B has had 2/3 of its ideal device-time (< the 0.70 floor): taking
    # B's devices needs a capacity manager's approval. Without an answer the core waits until
    # B's share reaches 0.70 (t = 3,333 s; the next pass is its 600 s wake at 3600).
    return rigid(make_jobs([(0, 1000, 2), (0, 10000, 2), (3000, 100, 2)], tiers=[PREMIUM, STANDARD, PREMIUM]))


@pytest.mark.parametrize("model, c_starts, counts", [
    (None, 3600.0, {"requests": 1, "granted": 0, "denied": 0}),
    (ApprovalModel("fixed:100", 0.0), 3100.0, {"requests": 1, "granted": 1, "denied": 0}),
    (ApprovalModel("fixed:100", 1.0), 11000.0, {"requests": 1, "granted": 0, "denied": 1}),
], ids=["never-answered", "granted-after-100s", "denied"])
def test_an_approval_request_is_answered_by_the_model(model, c_starts, counts):
    result = run(approval_trace(), fleet_module.uniform(1, 2), Meridian(), approvals=model)
    assert result.first_placed[2] == pytest.approx(c_starts)  # placed; B's checkpoint takes 5 s more
    for key, value in counts.items():
        assert result.approvals[key] == value, key
    # A denial protects B for its run: it is never preempted and runs to its end at 11,000.
    assert result.n_preempt[1] == (0 if model is not None and model.denial_rate == 1.0 else 1)


def test_seeded_approval_delays_are_deterministic():
    model = ApprovalModel("lognormal:600,1.0", 0.3)
    a = [model.draw(np.random.default_rng([3, 7006])) for _ in range(3)]
    b = [model.draw(np.random.default_rng([3, 7006])) for _ in range(3)]
    assert a == b and all(d > 0 for d, _ in a)


@pytest.mark.parametrize("delay, rate", [("exp", 0.1), ("fixed:-1", 0.1), ("soon:5", 0.1), ("exp:60", 1.5)])
def test_a_bad_approval_model_is_refused(delay, rate):
    with pytest.raises(FidelityError):
        ApprovalModel(delay, rate)


# ----- heterogeneous fleets ---------------------------------------------------------------

def two_type_fleet():
    base = fleet_module.uniform(2, 4)
    return dataclasses.replace(base, node_type=np.array([0, 1], dtype=np.int16), type_names=("A100", "T4"))


def typed(trace, types):
    return dataclasses.replace(trace, type_id=np.asarray(types, dtype=np.int16), type_names=("A100", "T4", "TPU"))


@pytest.mark.parametrize("policy", [Fifo(), Tiresias()], ids=["fifo", "tiresias"])
def test_a_job_waits_for_its_own_type_while_the_other_type_idles(policy):
    # Two 4-rank A100 jobs and one 4-rank T4 job at 0 on one A100 node and one T4 node: the
    # second A100 job waits for the first (200 s), though the T4 node is idle after 50 s; the
    # T4 job does not wait behind it (FIFO keeps one line per type).
    trace = typed(make_jobs([(0, 100, 4), (0, 100, 4), (0, 50, 4)]), [0, 0, 1])
    result = run(trace, two_type_fleet(), policy)
    assert result.finish.tolist() == [100.0, 200.0, 50.0]


def test_meridian_places_every_job_on_devices_of_its_type():
    trace = typed(make_jobs([(i * 5.0, 200.0 + 10 * i, [1, 2, 4][i % 3]) for i in range(12)]),
                  [i % 2 for i in range(12)])
    fleet = two_type_fleet()
    engine = Engine(trace, fleet, Meridian(), costs=HAND_COSTS, tick_s=10.0)
    placed = []
    apply = engine.apply

    def recording(decision):
        if decision.devices is not None:
            placed.append((decision.job, set(engine.dev_type[decision.devices].tolist())))
        return apply(decision)

    engine.apply = recording
    result = engine.run()
    assert not np.isnan(result.finish).any()
    assert placed and all(types == {int(trace.type_id[j])} for j, types in placed)


def test_a_job_asking_for_a_type_the_fleet_lacks_is_rejected_with_the_reason():
    trace = typed(make_jobs([(0, 100, 1), (0, 100, 1)]), [0, 2])
    result = run(trace, two_type_fleet(), "fifo")
    assert result.rejected.tolist() == [False, True]
    assert "'TPU'" in result.rejections[0][1] and "A100, T4" in result.rejections[0][1]


def test_jobs_draw_types_the_fleet_can_hold():
    fleet = fleet_module.by_name("philly-hetero")
    trace = make_jobs([(i, 100, [1, 8, 32, 64][i % 4]) for i in range(400)]).with_types(fleet, seed=2)
    capacity = fleet.region_capacity()
    assert (trace.min_devices <= capacity[trace.type_id]).all()
    assert set(trace.type_id.tolist()) == {0, 1, 2}
    assert len(trace.type_names) == 3


def test_a_job_spread_only_as_its_types_nodes_force_pays_no_spread_penalty():
    # A100 nodes hold 4, T4 nodes 1: a 2-rank T4 job must span 2 nodes; it runs at full speed.
    base = fleet_module.Fleet(name="mixed", node_devices=np.array([4, 1, 1], np.int32),
                              node_rack=np.zeros(3, np.int32), node_cluster=np.zeros(3, np.int32),
                              node_region=np.zeros(3, np.int32), node_type=np.array([0, 1, 1], np.int16),
                              type_names=("A100", "T4"))
    trace = typed(make_jobs([(0, 100, 2)]), [1])
    costs = dataclasses.replace(HAND_COSTS, spread_efficiency=0.5)
    result = Engine(trace, base, Fifo(), costs=costs, tick_s=0.0).run()
    assert result.finish[0] == pytest.approx(100.0)
