"""What every check of bench/gpu_checks.py shares: its rows, its time budget, its meridian-run jobs.

A GPU is lent for minutes at a time (one call of at most 10 minutes), so the checks must never
hang and never let one bug in the harness cost the whole lease:
- every check is a function that returns rows; run_check() turns an exception into an "error" row
  and the next check runs (a check's bug costs that check only);
- Budget skips a check whose estimate does not fit what is left of --budget-s, with a "skipped"
  row saying so, and caps every step's timeout at what is left;
- Watchdog ends the whole script past its budget (plus grace) even if a step is stuck inside a
  driver call that no timeout reaches: it kills the children, writes the rows it has (table and
  JSON) and exits.

A row's result: "ok" (it ran and showed what it checks: bit-exact where bit_exact is not None, or
the expected refusal), "failed" (it ran and did not), "timeout", "error" (the harness or the job
broke: read detail), "skipped" (why in detail). bench/gpu_checks.py --device cpu runs all of this
on CPU (tests/runtime/test_gpu_checks_dry_run.py asserts its rows in CI).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ("ok", "failed", "timeout", "error", "skipped")
# A fresh meridian-run job's start, rank processes importing torch (and CUDA) included, before the
# budget has measured one: a guess for a GPU node, never measured on one (no GPU was lent).
DEFAULT_LAUNCH_S = 25.0


@dataclass
class CheckRow:
    check: str
    seconds: float
    result: str
    bit_exact: bool | None
    detail: str

    def __post_init__(self):
        if self.result not in RESULTS:
            raise ValueError(f"row {self.check!r}: result {self.result!r} is not one of {RESULTS}")


class Budget:
    """The script's time budget: what is left of it, and the estimate of one job launch (measured
    by the first job that ran, else DEFAULT_LAUNCH_S)."""

    def __init__(self, total_s: float, *, clock=time.monotonic):
        self.total_s = float(total_s)
        self.clock = clock
        self.started = clock()
        self.launch_s = DEFAULT_LAUNCH_S
        self._launch_measured = False

    def left_s(self) -> float:
        return self.total_s - (self.clock() - self.started)

    def skip_reason(self, estimate_s: float) -> str | None:
        """Returns why a check estimated at estimate_s is skipped, or None when it fits."""
        left = self.left_s()
        if estimate_s <= left:
            return None
        return f"skipped: needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s left of --budget-s {self.total_s:g}"

    def timeout(self, limit_s: float) -> float:
        """A step's timeout: its own limit, or what is left of the budget when that is less."""
        return max(1.0, min(float(limit_s), self.left_s()))

    def note_launch(self, seconds: float) -> None:
        """The first job that ran to its end sets the launch estimate (a loaded node, a slow CUDA
        start: the rest of the estimates follow it)."""
        if not self._launch_measured:
            self.launch_s = max(seconds, 1.0)
            self._launch_measured = True


def run_check(rows: list, name: str, estimate_s: float, budget: Budget, check, *args, **kwargs) -> None:
    """Runs check(*args, **kwargs) -> list of CheckRow into rows, unless the budget has no room
    for estimate_s (one "skipped" row then); an exception becomes one "error" row."""
    reason = budget.skip_reason(estimate_s)
    if reason is not None:
        rows.append(CheckRow(name, 0.0, "skipped", None, reason))
        print(f"{name}: {reason}", flush=True)
        return
    started = time.monotonic()
    try:
        new_rows = check(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a check's bug costs that check, not the lease
        tail = traceback.format_exc()[-1200:]
        new_rows = [CheckRow(name, time.monotonic() - started, "error", None, f"{type(exc).__name__}: {exc}\n{tail}")]
    for row in new_rows:
        rows.append(row)
        print(format_row(row), flush=True)


def format_row(row: CheckRow) -> str:
    exact = "-" if row.bit_exact is None else str(row.bit_exact)
    detail = " ".join(row.detail.split())
    return f"{row.check:50} {row.seconds:8.1f}  {row.result:8} {exact:9} {detail}"


def print_table(rows: list, *, title: str) -> None:
    print()
    print(title)
    print(f"{'check':50} {'seconds':>8}  {'result':8} {'bit-exact':9} detail")
    for row in rows:
        print(format_row(row))
    sys.stdout.flush()


def exit_code(rows: list) -> int:
    """0 when every row is ok or skipped, else 1."""
    return 0 if all(row.result in ("ok", "skipped") for row in rows) else 1


def json_path(explicit: str | None) -> pathlib.Path | None:
    """Where the results go as JSON: --json, else $OUT/gpu_checks.json when $OUT is set (the lent
    machine's tool returns what is written under $OUT), else nowhere."""
    if explicit:
        return pathlib.Path(explicit)
    out = os.environ.get("OUT")
    return pathlib.Path(out) / "gpu_checks.json" if out else None


def write_json(path: pathlib.Path | None, rows: list, *, meta: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"meta": meta, "rows": [asdict(row) for row in rows]}, indent=1))
    os.replace(temporary, path)


class Watchdog:
    """Calls on_expire() from a thread once limit_s have passed, then exits the process (code 3):
    the last resort against a step stuck where no timeout reaches (a driver call)."""

    def __init__(self, limit_s: float, on_expire):
        self._timer = threading.Timer(limit_s, self._expire, args=(on_expire,))
        self._timer.daemon = True
        self.limit_s = limit_s

    def start(self) -> Watchdog:
        self._timer.start()
        return self

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self, on_expire) -> None:
        try:
            print(f"\nwatchdog: the checks ran past {self.limit_s:.0f} s; ending them", flush=True)
            on_expire()
        finally:
            os._exit(3)


# Processes the harness started, killed by kill_started() at the end or when the watchdog fires,
# so no paused worker or job outlives the script.
STARTED: list[subprocess.Popen] = []


def kill_started() -> None:
    for process in STARTED:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the launcher and its ranks (own group)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.kill()
            except ProcessLookupError:
                pass


def pid_namespace_wrapper() -> tuple[list[str], str]:
    """Returns (command prefix, what it gives): `unshare --pid --fork --mount-proc` where it works
    here (root and a kernel that allows it), else no prefix and why not."""
    if os.geteuid() != 0:
        return [], "no new PID namespace (not root)"
    prefix = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        probe = subprocess.run(prefix + ["true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"no new PID namespace (unshare: {exc})"
    if probe.returncode != 0:
        return [], f"no new PID namespace (unshare: {(probe.stderr or '').strip()[-200:]})"
    return prefix, "in a new PID namespace (unshare --pid --mount-proc)"


class BenchJob:
    """One meridian-run launcher started by the harness, in a process group of its own (so it
    and its ranks can be killed together), its output in <job_dir>.log."""

    def __init__(self, job_dir, *, ranks, script, script_args, engine="framework", devices=None,
                 fold=False, resume=False, job_id=None, prefix=(), launcher_args=()):
        self.job_dir = pathlib.Path(job_dir)
        self.job_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = self.job_dir.with_suffix(".log")
        command = list(prefix) + [sys.executable, "-m", "runtime.launcher", "--ranks", str(ranks),
                                  "--engine", engine, "--job-dir", str(self.job_dir),
                                  "--job-id", job_id or f"gpu-check-{uuid.uuid4().hex[:8]}"]
        if devices:
            command += ["--devices", str(devices)]
        if fold:
            command.append("--fold")
        if resume:
            command.append("--resume")
        command += [str(arg) for arg in launcher_args]
        command += [str(script)] + [str(arg) for arg in script_args]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        STARTED.append(self.process)

    def control(self):
        from runtime.control import JobControl
        return JobControl(self.job_dir)

    def wait_ready(self, timeout_s: float) -> dict:
        """Returns the first progress answer; raises RuntimeError when the launcher exits first or
        does not answer within timeout_s."""
        from runtime.control import JobControlError
        control = self.control()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.process.returncode} before it answered: "
                                   f"{self.output()[-600:]}")
            try:
                return control.progress()
            except (JobControlError, OSError, ValueError):
                time.sleep(0.1)
        raise RuntimeError(f"launcher did not answer on its control socket within {timeout_s:.0f} s")

    def wait(self, timeout_s: float):
        """Returns the launcher's exit code, or "timeout" (it and its ranks are killed then)."""
        try:
            return self.process.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.kill()
            return "timeout"

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def output(self) -> str:
        """The launcher's output and every rank log's, in one text."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        logs = self.job_dir / "logs"
        for log in sorted(logs.iterdir()) if logs.is_dir() else []:
            if log.is_file():
                text += f"\n--- {log.name} ---\n" + log.read_text(errors="replace")
        return text


def run_job(job_dir, *, timeout_s: float, budget: Budget | None = None, **job_args):
    """Runs one meridian-run job to its end; returns (exit code or "timeout", output, seconds)."""
    job = BenchJob(job_dir, **job_args)
    rc = job.wait(timeout_s)
    seconds = job.seconds()
    if rc == 0 and budget is not None:
        budget.note_launch(seconds)
    return rc, job.output(), seconds


def same_final_state(expected_path, actual_path) -> tuple[bool, str]:
    """Returns (bit-exact, what was compared or where it differs): the files' "params",
    "optimizer" and, where the expected file has them, "rng" and "scaler" entries compared tensor by tensor
    with torch.equal (dtype too), loaded on the CPU."""
    import torch

    expected = torch.load(expected_path, weights_only=False, map_location="cpu")
    actual = torch.load(actual_path, weights_only=False, map_location="cpu")
    differences: list[str] = []

    def compare(a, b, path):
        if isinstance(a, torch.Tensor):
            if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
                differences.append(path)
        elif isinstance(a, dict):
            if not isinstance(b, dict) or a.keys() != b.keys():
                differences.append(f"{path} (keys)")
                return
            for key in a:
                compare(a[key], b[key], f"{path}/{key}")
        elif isinstance(a, (list, tuple)):
            if not isinstance(b, (list, tuple)) or len(a) != len(b):
                differences.append(f"{path} (length)")
                return
            for index, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{path}/{index}")
        elif a != b:
            differences.append(path)

    keys = [key for key in ("params", "optimizer", "rng", "scaler") if key in expected]
    compare({key: expected[key] for key in keys}, {key: actual.get(key) for key in keys}, "state")
    compared = "parameters, optimizer state" + (f", RNG ({'+'.join(sorted(expected['rng']))})"
                                                if "rng" in expected else "") \
        + (f", GradScaler (scale {expected['scaler'].get('scale')})" if "scaler" in expected else "")
    return not differences, (f"{compared} equal" if not differences else "differ at " + ", ".join(differences[:5]))
