"""The Meridian policy in the simulator is the production core (scheduler.schedule)."""
import numpy as np
import pytest
from sim_builders import HAND_COSTS, make_jobs

import scheduler
from scheduler.sim import fleet as fleet_module
from scheduler.sim import simulate
from scheduler.sim.baselines import Fifo
from scheduler.sim.engine import Engine
from scheduler.sim.meridian import Meridian
from scheduler.sim.trace import BASIC, PREMIUM


def tiered_trace():
    # Job 0 (Basic) takes both devices 0..100. Then Basic job 1 arrives at 10 and Premium job
    # 2 at 20, both wanting both devices. FIFO serves 1 before 2; the core puts the Premium
    # job first (and may even preempt job 0 for it): either way job 2 ends before job 1.
    return make_jobs([(0, 100, 2), (10, 30, 2), (20, 30, 2)], tiers=[BASIC, BASIC, PREMIUM])


def test_premium_job_is_served_before_an_earlier_basic_one_by_the_core():
    trace = tiered_trace()
    fleet = fleet_module.uniform(1, 2)
    meridian = Meridian()
    m = simulate(trace, fleet, meridian, costs=HAND_COSTS, tick_s=0.0)
    f = simulate(trace, fleet, Fifo(), costs=HAND_COSTS, tick_s=0.0)
    assert f.finish[1] < f.finish[2]
    assert m.finish[2] < m.finish[1]
    assert meridian.plans > 0
    assert isinstance(meridian.last_plan, scheduler.Plan)


def test_the_core_decides_every_start(monkeypatch):
    # Wrap (not replace) scheduler.schedule: every job the engine starts appears in a plan the
    # real core returned.
    calls = []
    real = scheduler.schedule

    def recording(snapshot, policy=None, **kw):
        plan = real(snapshot, policy, **kw)
        calls.append(plan)
        return plan

    monkeypatch.setattr(scheduler, "schedule", recording)
    trace = make_jobs([(i * 5.0, 50.0 + i, 1 + (i % 2)) for i in range(12)])
    result = simulate(trace, fleet_module.uniform(2, 2), Meridian(), costs=HAND_COSTS, tick_s=10.0)
    started_by_core = {d.job_id for plan in calls for d in plan.decisions if d.kind == "start"}
    assert calls
    assert started_by_core == set(range(12))
    assert not np.isnan(result.finish).any()


def test_the_snapshot_given_to_the_core_is_valid_mid_run():
    trace = make_jobs([(i * 3.0, 400.0, [1, 2, 4][i % 3], i % 2) for i in range(15)],
                      tiers=[i % 3 for i in range(15)])
    policy = Meridian()
    engine = Engine(trace, fleet_module.philly(servers_8=1, servers_2=2), policy, costs=HAND_COSTS,
                    tick_s=30.0, until=200.0)
    engine.run()
    snap = policy.snapshot(engine, engine.now)
    snap.validate()
    assert len(snap.jobs) == len(engine.running) + len(engine.pending)
    held = snap.accelerators.holder
    for row, job in enumerate(snap.jobs.ids.tolist()):
        assert (held == row).sum() == engine.ndev[job]
    assert snap.jobs.tier.tolist() == trace.tier[snap.jobs.ids].tolist()


def test_meridian_run_is_deterministic():
    trace = make_jobs([(i * 11.0, 300.0 + 7 * i, [1, 2, 4, 8][i % 4], i % 3) for i in range(40)])
    fleet = fleet_module.philly(servers_8=2, servers_2=2)
    a = simulate(trace, fleet, Meridian(), tick_s=30.0, seed=5)
    b = simulate(trace, fleet, Meridian(), tick_s=30.0, seed=5)
    assert np.array_equal(a.finish, b.finish)
    assert a.summary()["avg_jct_s"] == pytest.approx(b.summary()["avg_jct_s"])


def test_the_snapshot_carries_devices_still_checkpointing_and_the_last_resize():
    # Basic job 0 (W=4, elastic to 1) holds the 4 devices of one node; Premium job 1 (1 rank)
    # arrives at 1000 and the core shrinks job 0 to 2: two devices are released, busy for the
    # 5 s shrink checkpoint; the Premium job takes one, the other is still releasing at 1002.
    trace = make_jobs([(0, 100_000, 4), (1000, 30, 1)], tiers=[BASIC, PREMIUM])
    policy = Meridian()
    engine = Engine(trace, fleet_module.uniform(1, 4), policy, costs=HAND_COSTS, tick_s=0.0, until=1002.0)
    engine.run()
    snap = policy.snapshot(engine, 1002.0).validate()
    assert int(engine.ndev[0]) == 2 and int(engine.ndev[1]) == 1
    free = np.flatnonzero(snap.accelerators.holder < 0)
    assert free.size == 1 and snap.accelerators.releasing_until[free[0]] == pytest.approx(1005.0)
    assert snap.jobs.last_resize_time[snap.jobs.ids.tolist().index(0)] == pytest.approx(1000.0)


@pytest.mark.parametrize("reserve, premium_wait_s", [(0, 5.0), (1, 0.0)], ids=["no-reserve", "reserve-1"])
def test_a_premium_reserve_lets_a_short_premium_job_start_without_a_victims_checkpoint(reserve, premium_wait_s):
    # Basic job 0 (W=4, elastic) fills the node without a reserve; the 50 s Premium job 1
    # arriving at 1000 then waits for a shrink's 5 s checkpoint (and misses 95%); with one
    # device kept for Premium, job 0 runs on 2 and job 1 starts at once.
    trace = make_jobs([(0, 100_000, 4), (1000, 50, 1)], tiers=[BASIC, PREMIUM])
    policy = Meridian(settings=scheduler.PolicySettings(premium_reserve_devices=reserve))
    result = simulate(trace, fleet_module.uniform(1, 4), policy, costs=HAND_COSTS, tick_s=0.0, until=5000.0)
    assert result.finish[1] - trace.submit[1] == pytest.approx(50.0 + premium_wait_s)  # its JCT
    assert result.first_start[1] - result.first_placed[1] == pytest.approx(premium_wait_s)
