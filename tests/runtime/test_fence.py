"""A launcher fences itself when its node agent falls silent past the lost-node limit (runtime/fence.py):
a frozen agent cannot fence its jobs, and their ranks would run on beside the copy the control plane
starts elsewhere (a double run, found by the chaos soak)."""
import json
import os
import time

import pytest
from runtime_helpers import COUNTER_SCRIPT, Job, unique_id

from runtime import fence
from runtime.exits import EXIT_FENCED

pytestmark = pytest.mark.runtime


def test_fence_due_only_past_the_deadline_and_its_grace(tmp_path):
    path = tmp_path / fence.FENCE_FILE
    assert fence.fence_due(path, now=100.0) is None  # no deadline yet: the agent has not heard from anyone
    path.write_text("not a number")
    assert fence.fence_due(path, now=100.0) is None
    fence.deadline_write(path, 50.0)
    assert fence.fence_due(path, now=50.0 + fence.FENCE_GRACE_S) is None
    why = fence.fence_due(path, now=60.0)
    assert why is not None and "self-fenced" in why and "10 s" in why
    assert [p.name for p in tmp_path.iterdir()] == [fence.FENCE_FILE]  # written in place, no leftovers


def _rank_pids(job_dir):
    progress = json.loads((job_dir / "progress.json").read_text())
    return [int(pid) for pid in progress.get("rank_pids") or []]


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] == "Z"
    except OSError:
        return True


def test_a_launcher_whose_agent_fell_silent_ends_its_ranks_and_says_why(tmp_path, jobs):
    deadline_file = tmp_path / fence.FENCE_FILE
    fence.deadline_write(deadline_file, time.monotonic() + 3600)  # an agent that heartbeats
    job = Job(tmp_path / "node", ranks=2, script=COUNTER_SCRIPT, out=tmp_path / "out.pt", engine="framework",
              script_args=["--steps", "100000"], job_id=unique_id("fence"),
              launcher_args=["--fence-file", str(deadline_file)])
    jobs.append(job)
    job.wait_ready()
    job.wait_step(3)
    pids = _rank_pids(job.job_dir)
    assert len(pids) == 2 and job.process.poll() is None

    fence.deadline_write(deadline_file, time.monotonic() - 1)  # the agent froze: nothing renews it

    assert job.wait() == EXIT_FENCED, job.output()
    why = (job.job_dir / fence.FENCED_FILE).read_text()
    assert "self-fenced" in why
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), [p for p in pids if not _gone(p)]


def test_without_a_fence_file_or_with_a_live_agent_the_job_runs_to_its_end(tmp_path, jobs):
    """The control: a deadline in the future fences nothing."""
    deadline_file = tmp_path / fence.FENCE_FILE
    fence.deadline_write(deadline_file, time.monotonic() + 3600)
    job = Job(tmp_path / "node", ranks=1, script=COUNTER_SCRIPT, out=tmp_path / "out.pt", engine="framework",
              script_args=["--steps", "20"], job_id=unique_id("nofence"),
              launcher_args=["--fence-file", str(deadline_file)])
    jobs.append(job)
    assert job.wait() == 0, job.output()
    assert not (job.job_dir / fence.FENCED_FILE).exists()
    assert os.path.exists(tmp_path / "out.pt")
