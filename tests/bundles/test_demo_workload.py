"""The demo workload: seeded arrivals of every tier, bounded by ./meridian run --demo-workload=N."""
import importlib.util
import pathlib

import pytest

from agent.embedded import embedded_processes
from portal.launch import main as launch_main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("demo_workload", ROOT / "examples" / "demo_workload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arrivals_are_seeded_and_cover_every_tier():
    demo = _demo()
    first = [a for _, a in zip(range(60), demo.arrivals(7, 30.0))]
    again = [a for _, a in zip(range(60), demo.arrivals(7, 30.0))]
    other = [a for _, a in zip(range(60), demo.arrivals(8, 30.0))]
    assert first == again and first != other
    assert {a[2] for a in first} == {"basic", "standard", "premium"}
    assert 10 < sum(a[0] for a in first) / len(first) < 60  # mean gap near --every


def test_demo_workload_n_bounds_the_stream(tmp_path):
    def demo_argv(value):
        processes = embedded_processes(python="py", url="http://x", root=ROOT, data_dir=tmp_path,
                                       enrollment_token="t", demo_workload=value)
        return next((p.argv for p in processes if p.name == "demo"), None)

    assert demo_argv(None) is None
    assert "--jobs" not in demo_argv(0)
    assert demo_argv(5)[-2:] == ["--jobs", "5"]
    agents = [p.argv for p in embedded_processes(python="py", url="http://x", root=ROOT, data_dir=tmp_path,
                                                 enrollment_token="t", demo_workload=None)]
    assert {a[a.index("--workspace-root") + 1] for a in agents} == {str(tmp_path / "workspaces")}


def test_demo_workload_zero_is_refused_with_a_reason(capsys):
    with pytest.raises(SystemExit):
        launch_main(["run", "--demo-workload=0"])
    assert "at least 1 job" in capsys.readouterr().err
