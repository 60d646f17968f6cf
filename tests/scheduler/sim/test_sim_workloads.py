"""Offered-load scaling (time-scaled arrivals) and the seeded synthetic mixes."""
import numpy as np
import pytest
from sim_builders import make_jobs

from scheduler.sim import trace as trace_module
from scheduler.sim.__main__ import main
from scheduler.sim.trace import PREMIUM, SYNTHETIC_MIXES, TraceError


def offered(trace, devices):
    return trace.gpu_seconds / (trace.submit[-1] * devices)


def test_scaling_divides_submit_times_and_keeps_the_jobs():
    trace = make_jobs([(0, 100, 1), (60, 50, 2), (300, 10, 4)])
    double = trace.scaled(2.0)
    assert double.submit.tolist() == [0.0, 30.0, 150.0]
    assert trace.scaled(0.5).submit.tolist() == [0.0, 120.0, 600.0]
    for field in ("duration", "ranks", "tier", "min_devices", "checkpoint_gb", "team"):
        assert np.array_equal(getattr(double, field), getattr(trace, field)), field
    assert double.name == "hand@2x"
    assert trace.scaled(1.0) is trace


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_scaling_refuses_a_load_that_is_not_a_positive_number(bad):
    with pytest.raises(TraceError, match="positive number"):
        make_jobs([(0, 100, 1)]).scaled(bad)


@pytest.mark.parametrize("mix", sorted(set(SYNTHETIC_MIXES) - {"philly"}))
def test_each_parametric_mix_offers_the_asked_load_and_is_seeded(mix):
    a = trace_module.synthetic(20000, devices=1000, load=0.5, seed=4, mix=mix)
    b = trace_module.synthetic(20000, devices=1000, load=0.5, seed=4, mix=mix)
    c = trace_module.synthetic(20000, devices=1000, load=0.5, seed=5, mix=mix)
    assert offered(a, 1000) == pytest.approx(0.5, rel=0.1)
    assert np.array_equal(a.submit, b.submit) and np.array_equal(a.tier, b.tier)
    assert not np.array_equal(a.duration, c.duration)
    assert (a.duration <= SYNTHETIC_MIXES[mix].max_duration_s).all()


# Measured on ../shared/traces/philly/philly_jobs.csv (82,247 jobs): p99 254,758 s / median
# 1,144 s; 0.34% of jobs ask for more than 8 GPUs. Constants, so the test needs no trace file
# (CI's checkout may have no ../shared).
PHILLY_P99_OVER_MEDIAN = 222.7
PHILLY_SHARE_OVER_8 = 0.0034


def test_the_mixes_differ_from_philly_as_documented():
    n = 40000
    heavy = trace_module.synthetic(n, devices=1000, mix="heavy-tail", seed=1)
    multi = trace_module.synthetic(n, devices=1000, mix="multinode", seed=1)
    premium = trace_module.synthetic(n, devices=1000, mix="premium-heavy", seed=1)
    # Heavier tail: the p99 / median ratio of durations is well above Philly's (~430 vs ~220).
    assert np.percentile(heavy.duration, 99) / np.median(heavy.duration) > 1.5 * PHILLY_P99_OVER_MEDIAN
    # More multi-node jobs (W > 8): 25% against Philly's 0.3%.
    assert (multi.ranks > 8).mean() == pytest.approx(0.25, abs=0.02)
    assert (heavy.ranks > 8).mean() == pytest.approx(PHILLY_SHARE_OVER_8, abs=0.002)  # Philly's sizes
    assert (premium.tier == PREMIUM).mean() == pytest.approx(0.45, abs=0.02)
    assert (heavy.tier == PREMIUM).mean() == pytest.approx(0.20, abs=0.02)


def test_an_unknown_mix_is_named():
    with pytest.raises(TraceError, match="unknown synthetic mix 'zipf'"):
        trace_module.synthetic(10, devices=10, mix="zipf")


def test_the_cli_runs_every_policy_at_every_load(capsys, tmp_path):
    summary = tmp_path / "s.json"
    code = main(["--synthetic", "60", "--mix", "multinode", "--fleet", "philly", "--policies", "fifo,tiresias",
                 "--load", "0.5,2", "--seed", "3", "--json", str(summary)])
    assert code == 0
    out = capsys.readouterr().out
    assert "offered load 0.5x: synthetic-multinode-60@0.5x" in out
    assert "offered load 2x: synthetic-multinode-60@2x" in out
    import json
    rows = json.loads(summary.read_text())["summaries"]
    assert [(r["load"], r["policy"]) for r in rows] == [(0.5, "fifo"), (0.5, "tiresias"), (2.0, "fifo"),
                                                         (2.0, "tiresias")]
    assert all(r["finished"] == 60 for r in rows)
    # The same jobs twice as fast: the makespan shrinks or the queue grows, never both unchanged.
    fast, slow = rows[2], rows[0]
    assert fast["makespan_s"] < slow["makespan_s"]


@pytest.mark.parametrize("bad", ["0", "1,-2", "x", ","])
def test_the_cli_refuses_a_bad_load_list(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--synthetic", "10", "--load", bad])
    assert exit_info.value.code == 2
    assert "--load" in capsys.readouterr().err


def test_every_keeps_one_job_in_stride_from_the_first():
    trace = make_jobs([(i * 10.0, 100 + i, 1 + i % 2) for i in range(7)])
    thinned = trace.every(3)
    assert thinned.submit.tolist() == [0.0, 30.0, 60.0]
    assert thinned.duration.tolist() == [100.0, 103.0, 106.0]
    assert trace.every(1) is trace
    with pytest.raises(TraceError, match="stride"):
        trace.every(0)
