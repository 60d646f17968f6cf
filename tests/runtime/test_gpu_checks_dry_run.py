"""bench/gpu_checks.py, the one script a lent GPU runs (issue 17), proven on CPU: its dry run
(--device cpu) goes through the same harness, job command lines, timeouts, result parsers and
table rows, so a bug in the script cannot waste a GPU lease; its budget skips what would not fit
and says so. (The CRIU engine's CUDA bookkeeping: tests/runtime/test_criu_cuda.py.)"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from runtime import criu
from runtime.launcher import parse_args

pytestmark = pytest.mark.runtime
ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKS_SCRIPT = ROOT / "bench" / "gpu_checks.py"


def load_checks():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("gpu_checks_bench", CHECKS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_launcher_leaves_a_script_option_that_prefixes_its_own_to_the_script():
    # `--device` is a prefix of --devices and --device-indices: it used to fail the launch.
    options = parse_args(["--ranks", "1", "train.py", "out.pt", "--device", "cuda"])
    assert options.args == ["out.pt", "--device", "cuda"] and options.devices is None


@pytest.mark.parametrize("gpu_gib, host_gib, expected", [
    (80, 125, 42.0),      # an H100: two 42 GiB ranks do not fit on it at once, and fit in RAM parked
    (141, 125, None),     # an H200 with this RAM: no size exceeds half of it twice and fits the host
    (None, 125, None),    # NVML did not say
], ids=["h100", "h200-small-host", "unknown-gpu"])
def test_the_slice_size_exceeds_half_the_gpu_and_fits_the_host_or_is_skipped(gpu_gib, host_gib, expected):
    checks = load_checks()
    gib, why = checks.slice_size("auto", device="cuda", gpu_gib=gpu_gib, host_gib=host_gib)
    assert gib == expected
    assert (why == "") == (expected is not None)
    if expected is None:
        assert why.startswith("skipped: ")


def test_a_budget_that_fits_nothing_skips_every_check_saying_so_in_the_table_and_json(tmp_path, capsys):
    checks = load_checks()
    out = tmp_path / "rows.json"
    assert checks.main(["--device", "cpu", "--budget-s", "1", "--json", str(out),
                        "--work-dir", str(tmp_path / "work")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) >= 9
    assert all(row["result"] == "skipped" and "left of --budget-s 1" in row["detail"] for row in rows)
    table = capsys.readouterr().out
    assert table.count("skipped: needs ~") >= 2 * len(rows)  # as it goes, and in the table


def test_without_a_gpu_the_cuda_run_stops_at_once_saying_no_gpu(tmp_path, capsys):
    checks = load_checks()
    if checks.no_gpu_reason() is None:
        pytest.skip("a GPU is here: the cuda run would run")
    assert checks.main(["--device", "cuda", "--json", str(tmp_path / "rows.json")]) == 2
    assert capsys.readouterr().out.startswith("no GPU: ")
    assert not (tmp_path / "rows.json").exists()


def test_the_results_go_under_out_when_the_device_tool_sets_it(tmp_path, monkeypatch):
    from bench.gpu_harness import json_path
    monkeypatch.setenv("OUT", str(tmp_path))
    assert json_path(None) == tmp_path / "gpu_checks.json"
    assert json_path(str(tmp_path / "x.json")) == tmp_path / "x.json"
    monkeypatch.delenv("OUT")
    assert json_path(None) is None


def test_the_watchdog_writes_what_it_has_and_ends_a_stuck_run():
    # A step stuck inside a driver call is reached by no timeout: the watchdog ends the process.
    code = ("import time; from bench.gpu_harness import Watchdog; "
            "Watchdog(0.2, lambda: print('rows written', flush=True)).start(); time.sleep(30)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=25)
    assert run.returncode == 3 and "rows written" in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_cpu_dry_run_runs_every_check_end_to_end_bit_exact(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, MERIDIAN_SPOOL_ROOT=str(tmp_path / "spool"))
    env.pop("OUT", None)
    run = subprocess.run([sys.executable, str(CHECKS_SCRIPT), "--device", "cpu", "--budget-s", "1500",
                          "--json", str(out), "--work-dir", str(tmp_path / "work")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(out.read_text())["rows"]}
    criu_ok, criu_why = criu.check_available()
    skipped_allowed = set() if criu_ok else {"single job, CRIU engine (cpu)"}
    for name, row in rows.items():
        allowed = ("ok", "skipped") if name in skipped_allowed else ("ok",)
        assert row["result"] in allowed, f"{name}: {row}\n{run.stdout[-3000:]}"
        assert row["bit_exact"] is not False, name
    amp = "single job, framework engine, AMP bfloat16 + GradScaler, stop+resume (cpu)"
    expected = {"NVML telemetry (cpu)", "single job, framework engine, stop+resume (cpu)", amp,
                "single job, CRIU engine (cpu)", "fold: W=4 resized 4->2->1->4", "cost: meridian-run folded, W=4",
                "slice 2 x 0.02 GiB: A", "slice 2 x 0.02 GiB: B", "swap 0.01 GiB out and in",
                "fold: W=2 on 1 GPU, script on cuda:LOCAL_RANK (agent's GPU spec)"}
    expected |= {f"fold: W=4 on {d} logical device(s)" for d in (4, 2, 1)}
    expected |= {f"fold: W=2 on {d} logical device(s)" for d in (2, 1)}
    assert expected <= rows.keys(), sorted(rows)
    exact = [name for name, row in rows.items() if row["bit_exact"]]
    assert len(exact) >= 11 + (1 if criu_ok else 0), exact  # layouts, resize, by LOCAL_RANK, jobs, slice, swap
    assert "RNG (cpu) equal" in rows["single job, framework engine, stop+resume (cpu)"]["detail"]
    assert "GradScaler (scale" in rows[amp]["detail"]
    assert run.returncode == 0, run.stdout[-3000:]
