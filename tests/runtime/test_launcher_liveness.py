"""A SIGKILLed meridian-run leaves no rank behind: every rank probes the launcher's lock on
<spool>/launcher.lock (runtime/rank.py LauncherWatch) and ends itself once nobody holds it, also
after a CRIU restore (where no parent-death signal can work) and while blocked in a collective."""
import os
import signal
import time

import pytest
from runtime_helpers import DDP_SCRIPT, Job, kill_ranks, needs_criu, unique_id

from runtime import rank as rank_module

pytestmark = pytest.mark.runtime

GONE_DEADLINE_S = 20  # the probe runs every 0.25 s; the rest is slack for a loaded 2-core box
LONG_ARGS = ["--epochs", "100000", "--step-sleep", "0.02"]  # never finishes on its own


def _alive(pid):
    """True while pid is a live process (a zombie holds no core, memory or device: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids, deadline_s=GONE_DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _alive(pid)]
        if not left:
            return
        time.sleep(0.02)
    kill_ranks(left)  # leave nothing running behind a failed test
    raise AssertionError(f"rank processes {left} still run {deadline_s} s after their launcher "
                         f"was SIGKILLed")


def _start(tmp_path, jobs, engine, *, job_id=None, resume=False, name="node"):
    job = Job(tmp_path / name, ranks=2, script=DDP_SCRIPT, out=tmp_path / "out.pt",
              script_args=LONG_ARGS, engine=engine, job_id=job_id or unique_id("liveness"),
              resume=resume, store=tmp_path / "store")
    jobs.append(job)
    job.wait_ready()
    return job


def _sigkill_launcher(job):
    job.process.send_signal(signal.SIGKILL)
    job.process.wait(timeout=30)


@pytest.mark.parametrize("engine", [pytest.param("criu", marks=[pytest.mark.criu, needs_criu]),
                                    "framework"])
def test_ranks_end_when_their_launcher_is_sigkilled(engine, tmp_path, jobs):
    job = _start(tmp_path, jobs, engine)
    pids = job.wait_step(3)["rank_pids"]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    _sigkill_launcher(job)
    _wait_gone(pids)


@pytest.mark.criu
@needs_criu
def test_restored_criu_ranks_end_when_their_new_launcher_is_sigkilled(tmp_path, jobs):
    job_id = unique_id("liveness-restore")
    first = _start(tmp_path, jobs, "criu", job_id=job_id)
    first.wait_step(3)
    first.control.stop()
    first.finish(75)
    second = _start(tmp_path, jobs, "criu", job_id=job_id, resume=True)
    progress = second.wait_step(second.control.progress()["step"] + 2)
    pids = progress["rank_pids"]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    _sigkill_launcher(second)
    _wait_gone(pids)


@pytest.mark.criu
@needs_criu
def test_a_criu_rank_blocked_in_a_collective_ends_when_its_launcher_is_sigkilled(tmp_path, jobs):
    job = _start(tmp_path, jobs, "criu")
    rank0, rank1 = job.wait_step(3)["rank_pids"]
    # Rank 1 frozen with its sockets open: rank 0 blocks in its next all-reduce (gloo would wait
    # for minutes); only the watch thread can notice the launcher is gone.
    os.kill(rank1, signal.SIGSTOP)
    try:
        _sigkill_launcher(job)
        _wait_gone([rank0])
    finally:
        os.kill(rank1, signal.SIGCONT)
    _wait_gone([rank1])


def test_liveness_probe_follows_the_lock_holder(tmp_path):
    spool = tmp_path / "spool"
    assert not rank_module.launcher_alive(spool)  # no spool: the job was torn down
    fd = rank_module.hold_launcher_lock(spool)
    try:
        assert rank_module.launcher_alive(spool)
        with pytest.raises(BlockingIOError):
            rank_module.hold_launcher_lock(spool, wait_s=0.1)  # a second launcher is refused
    finally:
        os.close(fd)
    assert not rank_module.launcher_alive(spool)
    assert (spool / rank_module.LAUNCHER_LOCK).stat().st_size == 0  # CRIU restores same size


def test_a_launcher_refused_a_held_spool_says_the_job_is_not_at_fault(tmp_path):
    """The second launcher of one job id on a node neither wipes the first one's spool nor fails
    the job as if its code had: its failed event is a host failure (restarted from its checkpoint)."""
    import json
    import subprocess
    import sys

    from runtime_helpers import ROOT

    job_id = unique_id("held")
    fd = rank_module.hold_launcher_lock(tmp_path / "spool" / job_id)
    try:
        (tmp_path / "spool" / job_id / "keep").write_text("the first launcher's")
        env = {**os.environ, "MERIDIAN_SPOOL_ROOT": str(tmp_path / "spool"), "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "runtime.launcher", "--ranks", "1", "--engine", "framework",
                               "--job-dir", str(tmp_path / "job"), "--job-id", job_id, str(DDP_SCRIPT)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        os.close(fd)
    assert done.returncode == 2 and "another meridian-run is running job" in done.stderr, done.stderr
    failed = [json.loads(line) for line in (tmp_path / "job" / "events.jsonl").read_text().splitlines()][-1]
    assert failed["event"] == "failed" and failed["host_failure"] is True
    assert (tmp_path / "spool" / job_id / "keep").read_text() == "the first launcher's"
