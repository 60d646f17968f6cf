"""Lint and types are part of the suite: `./meridian test` fails on what CI's reviewers would.

ruff checks the whole tree (pyproject.toml says which rules); mypy checks the Django-free
packages, whose types are the contract between processes.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    result = _run([str(BIN / "ruff"), "check", "."])
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing():
    result = _run([sys.executable, "-m", "mypy", "scheduler", "runtime", "agent", "protocol"])
    assert result.returncode == 0, "\n".join(
        line for line in (result.stdout + result.stderr).splitlines() if ": note:" not in line)
