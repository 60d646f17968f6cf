"""bench/scheduler_tick.py runs from a clean clone (no trace file): a tiny fleet, no timing asserted."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("scheduler_tick_bench", ROOT / "bench" / "scheduler_tick.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_falls_back_to_its_labelled_histogram_and_prints_a_row(tmp_path, capsys):
    bench = load_bench()
    assert bench.main(["--sizes", "1000", "--no-contended", "--trace", str(tmp_path / "absent.csv")]) == 0
    out = capsys.readouterr().out
    assert "BUILT-IN HISTOGRAM derived from the Philly trace" in out
    row = next(line for line in out.splitlines() if line.startswith("mixed"))
    assert row.split()[1:4] == ["1,000", "150", "50"]


def test_the_bench_snapshot_is_valid_and_busy_when_asked():
    bench = load_bench()
    trace = bench.load_trace(None)
    snap = bench.build_snapshot(2000, trace, seed=1, busy=0.98).validate()
    busy = (snap.accelerators.holder >= 0).mean()
    assert 0.9 < busy <= 0.98


def test_the_replay_mode_times_the_simulators_core_calls_cold_and_warm(tmp_path, capsys):
    rows = [("2017-10-09 06:00:00", 600.0, 2), ("2017-10-09 06:01:00", 60.0, 1),
            ("2017-10-09 06:02:00", 1200.0, 8), ("2017-10-09 06:03:00", 30.0, 1)]
    csv_path = tmp_path / "jobs.csv"
    csv_path.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                        + "".join(f"{t},{d},{g},{d * g},team{i % 2}\n" for i, (t, d, g) in enumerate(rows)))
    bench = load_bench()
    assert bench.main(["--trace", str(csv_path), "--replay-days", "1", "--replay-start", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 jobs" in out
    calls = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()
             if line.startswith(("cold ", "warm ")) and line.split()[1].isdigit()}
    assert calls["cold"] == calls["warm"] > 0


def test_the_job_loss_bench_accounts_for_the_last_jobs_time(capsys):
    # bench/sim_job_loss.py on a synthetic quick-grid cell (no trace file needed): its waiting /
    # below W / spread split must not exceed the job's time lost under Meridian (a split that
    # double-counted would); the decisions listed are the ones the replay applied
    spec = importlib.util.spec_from_file_location("sim_job_loss_bench", ROOT / "bench" / "sim_job_loss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from scheduler.sim import goals
    fleet, workloads, _, _ = goals.quick_grid()
    trace = next(w for w in workloads if "multinode" in w.name).build(fleet, 0).scaled(1.0)
    engine, history, summary = bench.replay(trace, fleet, "meridian", 0)
    assert summary["finished"] == len(trace)
    for j in list(history)[:200]:
        waiting, below, spread = bench.losses(engine, history[j], j)
        lost = engine.finish[j] - engine.submit[j] - trace.duration[j]
        assert min(waiting, below, spread) >= 0.0
        assert waiting + below + spread <= lost + 1e-6
    assert bench.main(["multinode", "0.5", "0", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:2] == ["policy", "makespan"]
    assert "waiting / below W / spread" in out
