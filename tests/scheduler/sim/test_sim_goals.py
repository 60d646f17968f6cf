"""The goals table runs on a small seeded grid and prints one row per goal (it does not assert
that the goals hold: that is what the table measures)."""
import importlib.util
import json
import pathlib

import numpy as np
import pytest
from sim_builders import make_jobs

from scheduler.sim import fleet as fleet_module
from scheduler.sim import goals
from scheduler.sim.trace import BASIC, PREMIUM

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench" / "sim_goals.py"


def bench_with_grid(monkeypatch, workload, loads):
    """Returns bench/sim_goals.py loaded as a module, its --quick grid replaced by one small
    workload on a 20-GPU Philly-shaped fleet, seed 0."""
    spec = importlib.util.spec_from_file_location("sim_goals", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = fleet_module.philly(servers_8=2, servers_2=2)
    monkeypatch.setattr(goals, "quick_grid", lambda: (small, [workload], loads, (0,)))
    return bench


def test_the_goals_table_prints_every_goal_for_every_workload_and_load(capsys, monkeypatch, tmp_path):
    bench = bench_with_grid(monkeypatch, goals.Workload("multinode 40 jobs", "multinode", n_jobs=40), (1.0, 2.0))
    out_json = tmp_path / "goals.json"
    assert bench.main(["--quick", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for goal in ("1 goodput", "1 makespan", "2 avg JCT", "2 p99 JCT", "3 Premium SLA", "3 Standard SLA",
                 "3 no tier inversion", "4 every replay terminates", "4 full Philly"):
        assert out.count(goal) == (1 if goal == "4 full Philly" else 2), goal
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["load"] for r in rows} == {"1x", "2x"}
    assert all(r["holds"] for r in rows)
    assert len(json.loads(out_json.read_text())["runs"]) == 2


def test_the_same_grid_gives_the_same_rows():
    tiny = [goals.Workload("heavy-tail 30 jobs", "heavy-tail", n_jobs=30)]
    fleet = fleet_module.philly(servers_8=2, servers_2=2)
    a, _ = goals.measure(fleet, tiny, (1.5,), (3,))
    b, _ = goals.measure(fleet, tiny, (1.5,), (3,))
    assert [r.__dict__ for r in a] == [r.__dict__ for r in b]


def test_premium_demand_fits_counts_concurrent_premium_devices():
    # Premium jobs of 4 devices at [0, 100) and [50, 150) overlap: 8 devices at once.
    trace = make_jobs([(0, 100, 4), (50, 100, 4), (60, 10, 8)], tiers=[PREMIUM, PREMIUM, BASIC])
    assert goals.premium_demand_fits(trace, 8)
    assert not goals.premium_demand_fits(trace, 7)
    back_to_back = make_jobs([(0, 100, 4), (100, 100, 4)], tiers=[PREMIUM, PREMIUM])
    assert goals.premium_demand_fits(back_to_back, 4)


def test_a_goal_that_misses_in_one_seed_does_not_hold():
    def cell(m, b):
        return {p: {"goodput_devices": v} for p, v in (("meridian", m), ("fifo", b), ("tiresias", b), ("gandiva", b))}

    text = goals._judge([cell(10, 9), cell(8, 9)], lambda c: c["meridian"]["goodput_devices"],
                        lambda c: max(c[b]["goodput_devices"] for b in goals.BASELINES),
                        lambda m, b: m >= b, str)
    assert text == ("9.0", "9.0", "no (1/2 seeds)")
    assert np.isfinite(float(text[0]))


def test_saved_runs_are_judged_again_without_a_replay(tmp_path, capsys, monkeypatch):
    bench = bench_with_grid(monkeypatch, goals.Workload("premium-heavy 30 jobs", "premium-heavy", n_jobs=30), (2.0,))
    saved = tmp_path / "g.json"
    assert bench.main(["--quick", "--json", str(saved)]) == 0
    first = capsys.readouterr().out
    assert bench.main(["--rows-from", str(saved)]) == 0
    again = capsys.readouterr().out
    for line in first.splitlines():
        if line.startswith(("1 ", "2 ", "3 ")):
            assert line in again


def test_baselines_from_an_earlier_run_give_the_same_rows_and_a_missing_cell_is_an_error(capsys, monkeypatch, tmp_path):
    # Iterating on the core replays only Meridian: the stored baselines must judge it exactly as
    # a full replay would, and a cell the stored run lacks must not become a partial row.
    bench = bench_with_grid(monkeypatch, goals.Workload("multinode 40 jobs", "multinode", n_jobs=40), (1.0,))
    full, reused = tmp_path / "full.json", tmp_path / "reused.json"
    assert bench.main(["--quick", "--json", str(full)]) == 0
    assert bench.main(["--quick", "--baselines-from", str(full), "--json", str(reused)]) == 0
    capsys.readouterr()
    assert json.loads(reused.read_text())["rows"] == json.loads(full.read_text())["rows"]
    with pytest.raises(ValueError, match="no stored baselines"):
        bench.main(["--quick", "--loads", "2", "--baselines-from", str(full)])
