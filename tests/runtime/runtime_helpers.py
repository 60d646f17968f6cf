"""Helpers for the runtime proofs (imported by the tests as runtime_helpers): launch meridian-run
jobs and compare their final states."""
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from runtime import criu
from runtime.control import JobControl, JobControlError

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = pathlib.Path(__file__).resolve().parent / "scripts"
DDP_SCRIPT = SCRIPTS / "ddp_mlp.py"
SINGLE_SCRIPT = SCRIPTS / "single_mlp.py"
COUNTER_SCRIPT = SCRIPTS / "counter_loop.py"
DDP_ARGS = ["--epochs", "10"]       # W=4: 4 batches per epoch and rank -> 40 optimizer steps
SINGLE_ARGS = ["--epochs", "3"]     # 12 batches per epoch -> 36 optimizer steps
JOB_TIMEOUT_S = 240

CRIU_OK, CRIU_DETAIL = criu.check_available()
needs_criu = pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")


class Job:
    """One meridian-run launcher process (one "node")."""

    def __init__(self, job_dir, *, ranks, script, out, script_args=(), engine="auto",
                 devices=None, device_indices=None, store=None, job_id=None, resume=False, keep=2,
                 launcher_args=()):
        self.job_dir = pathlib.Path(job_dir)
        command = [sys.executable, "-m", "runtime.launcher", "--ranks", str(ranks),
                   "--engine", engine, "--job-dir", str(job_dir), "--keep", str(keep)]
        if devices:
            command += ["--devices", str(devices)]
        if device_indices is not None:
            command += ["--device-indices", ",".join(map(str, device_indices))]
        if store:
            command += ["--store", str(store)]
        if job_id:
            command += ["--job-id", job_id]
        if resume:
            command.append("--resume")
        command += list(launcher_args)
        command += [str(script), str(out)] + list(script_args)
        self.stderr_path = self.job_dir.parent / f"{self.job_dir.name}-launcher.err"
        self.job_dir.parent.mkdir(parents=True, exist_ok=True)
        self._stderr = open(self.stderr_path, "wb")
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self._stderr,
                                        stderr=subprocess.STDOUT)
        self.control = JobControl(job_dir)

    def wait_ready(self):
        """Polls the control socket until the launcher answers (or fails if it exited)."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"launcher exited with {self.process.returncode} before "
                                     f"it was ready:\n{self.output()}")
            try:
                return self.control.progress()
            except (JobControlError, OSError):
                time.sleep(0.05)
        raise AssertionError("launcher never answered on its control socket")

    def wait_step(self, step):
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            progress = self.control.progress()
            if progress["step"] >= step:
                return progress
            time.sleep(0.02)
        raise AssertionError(f"job never reached step {step}")

    def wait(self):
        try:
            code = self.process.wait(timeout=JOB_TIMEOUT_S)
        finally:
            self._stderr.close()
        return code

    def output(self):
        text = self.stderr_path.read_text(errors="replace")
        logs = self.job_dir / "logs"
        if logs.is_dir():
            for log in sorted(logs.iterdir()):
                text += f"\n--- {log.name} ---\n" + log.read_text(errors="replace")[-2000:]
        return text

    def finish(self, expect=0):
        code = self.wait()
        assert code == expect, f"launcher exit {code}, expected {expect}:\n{self.output()}"

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


def load_state(path):
    return torch.load(path, weights_only=False)


def assert_same_bits(expected, actual, path="state"):
    """Tensors torch.equal with the same dtype, dicts with the same keys, sequences of the same
    length, anything else ==, all the way down; a failure names the path that differs."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: a tensor became {type(actual).__name__}"
        assert expected.dtype == actual.dtype and torch.equal(expected, actual), \
            f"{path} differs (max abs diff {(expected.double() - actual.double()).abs().max()})"
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), path
        for key in expected:
            assert_same_bits(expected[key], actual[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same_bits(e, a, f"{path}/{i}")
    else:
        assert expected == actual, f"{path}: {expected!r} != {actual!r}"


def assert_same_state(expected_path, actual_path):
    """The saved parameters and optimizer state (every tensor, every setting) are the same bits."""
    expected, actual = load_state(expected_path), load_state(actual_path)
    assert_same_bits({"params": expected["params"], "optimizer": expected["optimizer"]},
                     {"params": actual["params"], "optimizer": actual["optimizer"]})


_references = {}


def reference_state(kind, reference_tmp):
    """Returns the path of the final state of an uninterrupted run (computed once per session)."""
    if kind not in _references:
        os.environ.setdefault("MERIDIAN_SPOOL_ROOT", str(reference_tmp / "spool"))
        out = reference_tmp / f"{kind}.pt"
        script, ranks, args = ((DDP_SCRIPT, 4, DDP_ARGS) if kind == "ddp"
                               else (SINGLE_SCRIPT, 1, SINGLE_ARGS))
        job = Job(reference_tmp / f"job-{kind}", ranks=ranks, script=script, out=out,
                  script_args=args, engine="framework", job_id=f"ref-{uuid.uuid4().hex[:8]}")
        job.finish(0)
        _references[kind] = out
    return _references[kind]


def kill_ranks(pids):
    """SIGKILL every rank (a PID-namespace init ignores SIGTERM)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def unique_id(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
