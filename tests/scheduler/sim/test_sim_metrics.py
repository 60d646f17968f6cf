"""Metrics on a hand-made schedule, trace loading and the seeded tier rule."""
import numpy as np
import pytest

from scheduler.sim import trace as trace_module
from scheduler.sim.metrics import SimResult, format_table
from scheduler.sim.trace import BASIC, PREMIUM, STANDARD, TraceError


def hand_result():
    # Four jobs on 4 devices over 0..100 s:
    #   job  tier      submit start finish duration W
    #   0    premium     0      0     10     10     1   delivered 1.0  -> met
    #   1    premium     0     20     40     19     2   delivered 0.95 -> met (at the bar)
    #   2    standard    5      5     65     30     1   delivered 0.5  -> missed
    #   3    basic      10     60    100     40     4   delivered 1.0  -> met
    n = 4
    return SimResult(
        policy="hand", trace="hand", fleet="4", n_devices=4,
        submit=np.array([0.0, 0.0, 5.0, 10.0]), duration=np.array([10.0, 19.0, 30.0, 40.0]),
        ranks=np.array([1, 2, 1, 4]), tier=np.array([PREMIUM, PREMIUM, STANDARD, BASIC], np.int8),
        first_start=np.array([0.0, 20.0, 5.0, 60.0]), finish=np.array([10.0, 40.0, 65.0, 100.0]),
        n_preempt=np.array([0, 1, 2, 0]), n_migrate=np.array([0, 0, 1, 0]),
        n_resize=np.array([0, 0, 0, 3]), n_fail=np.zeros(n, np.int32), lost_work=np.zeros(n),
        alloc_integral=200.0, useful_integral=150.0, end_time=100.0,
        samples={k: np.zeros(1) for k in ("t", "allocated", "useful", "pending", "running")},
        wall_s=0.0, passes=0, decisions=0, policy_s=0.0, failures=0,
    )


def test_summary_of_a_hand_made_schedule():
    s = hand_result().summary()
    jct = [10, 40, 60, 90]
    assert s["avg_jct_s"] == pytest.approx(np.mean(jct))
    assert s["median_jct_s"] == pytest.approx(50.0)
    assert s["p99_jct_s"] == pytest.approx(np.percentile(jct, 99))
    assert s["avg_queue_s"] == pytest.approx((0 + 20 + 0 + 50) / 4)
    assert s["makespan_s"] == pytest.approx(100.0)
    assert s["util_allocated"] == pytest.approx(200 / 400)
    assert s["util_useful"] == pytest.approx(150 / 400)
    assert s["goodput_devices"] == pytest.approx((10 + 38 + 30 + 160) / 100)
    assert s["preemptions_per_job"] == pytest.approx(3 / 4)
    assert s["migrations_per_job"] == pytest.approx(1 / 4)
    assert s["resizes_per_job"] == pytest.approx(3 / 4)
    assert s["sla_premium"] == pytest.approx(1.0)
    assert s["sla_standard"] == pytest.approx(0.0)
    assert s["sla_basic"] == pytest.approx(1.0)


def test_unfinished_jobs_are_counted_but_left_out_of_jct():
    r = hand_result()
    r.finish = r.finish.copy()
    r.finish[3] = np.nan
    s = r.summary()
    assert s["finished"] == 3
    assert s["avg_jct_s"] == pytest.approx((10 + 40 + 60) / 3)


def test_table_has_one_row_per_policy_and_a_markdown_form():
    s = hand_result().summary()
    text = format_table([s, {**s, "policy": "other"}])
    assert len(text.splitlines()) == 4
    md = format_table([s], markdown=True)
    assert md.startswith("| policy |") and "| hand |" in md


def test_tier_rule_is_seeded_and_close_to_its_shares():
    a = trace_module.assign_tiers(20000, seed=1)
    b = trace_module.assign_tiers(20000, seed=1)
    c = trace_module.assign_tiers(20000, seed=2)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    shares = np.bincount(a, minlength=3) / a.size
    assert shares == pytest.approx(trace_module.TIER_SHARES, abs=0.02)


def test_elastic_floor_is_a_divisor_of_w():
    ranks = np.array([1, 2, 4, 8, 12, 16, 24, 128])
    floor = trace_module.elastic_floor(ranks)
    assert floor.tolist() == [1, 1, 1, 2, 3, 4, 6, 32]
    assert (ranks % floor == 0).all()


def test_philly_format_csv_loads_sorted_by_submit(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                    "2017-10-09 07:01:55,66.0,1,66.0,aa\n"
                    "2017-10-09 06:00:00,100.0,8,800.0,bb\n"
                    "2017-10-09 06:00:00,5.0,2,10.0,aa\n")
    trace = trace_module.load_philly(path, seed=0)
    assert len(trace) == 3
    assert trace.submit.tolist() == [0.0, 0.0, 3715.0]
    assert trace.duration.tolist() == [100.0, 5.0, 66.0]  # ties keep file order
    assert trace.ranks.tolist() == [8, 2, 1]
    assert [trace.team_names[t] for t in trace.team] == ["bb", "aa", "aa"]
    window = trace.window(start_s=1.0)
    assert len(window) == 1 and window.submit.tolist() == [0.0]


def test_a_bad_row_is_named(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09 07:01:55,abc,1,66.0,aa\n")
    with pytest.raises(TraceError, match=":2: bad row"):
        trace_module.load_philly(path)


def test_a_missing_trace_says_how_to_point_at_one(tmp_path):
    with pytest.raises(TraceError, match="--trace"):
        trace_module.load_philly(tmp_path / "nope.csv")


def test_synthetic_trace_offers_the_asked_load():
    source = trace_module.make_trace("src", [0, 1, 2, 3], [100.0, 200.0, 300.0, 400.0], [1, 2, 4, 8],
                                     [0, 0, 0, 0], ["t"], 0)
    trace = trace_module.synthetic(20000, devices=1000, load=0.5, seed=0, source=source)
    offered = trace.gpu_seconds / (trace.submit[-1] * 1000)
    assert offered == pytest.approx(0.5, rel=0.05)
