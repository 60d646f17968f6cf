"""Live logs end to end: real uvicorn, Celery, Redis, agents and runtime (framework engine).

The agent's disk buffer: the control plane's web server is killed while a job prints, then
started again: nothing printed meanwhile is lost up to the agent's backlog limit; beyond it
the drop is reported in the log ("N bytes ... dropped") and the newest output is there.
A log followed live with `meridian logs -f` across a preemption and a resume on another node is
part of the done-when test, tests/e2e/test_bundles_e2e.py.
"""
import re

import pytest
from live_stack import log_chunks, log_text, rank_log_file, start_agent, start_web, stop_web, submit_chatty
from polling import poll

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
LIMIT = 64 * 1024


def test_logs_printed_while_the_control_plane_is_down_arrive_when_it_is_back_up_to_the_backlog_limit(stack, tmp_path):
    # No node is counted lost (nor fences itself) while the web server is down for a few seconds.
    plane = stack(env={"MERIDIAN_NODE_LOST_AFTER_SECONDS": "300"})
    work_dir = start_agent(plane, "n1", extra=["--log-backlog-bytes", str(LIMIT)])
    control = tmp_path / "control"
    control.mkdir()
    job = submit_chatty(plane, name="chatty", control=control)
    poll("the first lines in the API", lambda: "step 5 rank 0" in log_text(plane, job), timeout=180,
         on_timeout=lambda: plane.diagnose(job))

    # 1. Down; the job prints 20 kB (below the limit) and goes on printing steps.
    stop_web(plane)
    (control / "burst-20000").touch()
    log = rank_log_file(work_dir, job)
    poll("the burst in the rank log", lambda: b"burst 20000 end" in log.read_bytes(), timeout=60)
    down_until = log.stat().st_size
    start_web(plane)
    poll("the burst in the API", lambda: "burst 20000 end" in log_text(plane, job), timeout=120,
         on_timeout=lambda: plane.logs("agent-n1"))
    text = log_text(plane, job)
    on_disk = log.read_bytes()[:down_until].decode()
    assert on_disk in text  # every byte written while the control plane was down, in order
    assert "dropped" not in text
    steps = [int(n) for n in re.findall(r"^step (\d+) rank 0$", text, re.M)]
    assert steps == list(range(1, steps[-1] + 1))

    # 2. Down again; the job prints 300 kB (beyond the limit): the oldest unsent is dropped, and said.
    stop_web(plane)
    (control / "burst-300000").touch()
    poll("the big burst in the rank log", lambda: b"burst 300000 end" in log.read_bytes(), timeout=60)
    start_web(plane)
    poll("the big burst's end in the API", lambda: "burst 300000 end" in log_text(plane, job), timeout=120,
         on_timeout=lambda: plane.logs("agent-n1"))
    chunks = log_chunks(plane, job)
    dropped = [c for c in chunks if c["kind"] == "dropped"]
    assert len(dropped) == 1, [c["text"] for c in dropped]
    count = int(re.search(r"(\d+) bytes", dropped[0]["text"]).group(1))
    assert 300000 - LIMIT <= count <= 300000 + 20000, count
    after = "".join(c["text"] for c in chunks[chunks.index(dropped[0]):])
    assert len(after.encode()) >= LIMIT - 100  # the newest `LIMIT` bytes came through
    plane.api("POST", f"jobs/{job}/cancel/")
