"""Live logs end to end: real daphne, Celery, Redis, agents and runtime (framework engine).

1. The agent's disk buffer: the control plane's web server is killed while a job prints, then
   started again: nothing printed meanwhile is lost up to the agent's backlog limit; beyond it
   the drop is reported in the log ("N bytes ... dropped") and the newest output is there.
2. A job's log followed live (cli.logs.follow_logs, what `meridian logs -f` runs) across a
   preemption and its resume (on whichever node the tick picks): one log, a marker at the preemption, the resumed
   copy's output after it, counting on from the checkpoint.
"""
import re
import subprocess
import sys
import threading
import time

import pytest
from harness import ROOT
from live_stack import log_chunks, log_text, rank_log_file, start_agent, start_web, stop_web, submit_chatty
from polling import poll

from cli.client import Client
from cli.logs import follow_logs

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


def test_a_log_followed_live_goes_on_across_a_preemption_with_a_marker(stack):
    plane = stack()
    start_agent(plane, "n1")
    start_agent(plane, "n2")
    basic = [submit_chatty(plane, name=f"basic-{i}", steps=140, step_sleep=0.1) for i in (1, 2)]
    client = Client(plane.url, plane.token("alice"))  # the meridian CLI's own client
    followed = {job: [] for job in basic}

    def follow(job):  # what `meridian logs -f JOB --rank 0` runs
        for chunk in follow_logs(client, job, rank=0, follow=True, poll_s=0.3, deadline=time.monotonic() + 500):
            followed[job].append(chunk)

    followers = [threading.Thread(target=follow, args=(job,), daemon=True) for job in basic]
    for follower in followers:
        follower.start()
    for job in basic:
        poll(f"job {job} to print", lambda j=job: any("step 20 rank 0" in c["text"] for c in followed[j]),
             timeout=180, on_timeout=lambda: plane.diagnose(*basic))
    # The premium job takes one of the two devices: one basic job is preempted, and resumes on
    # the other node once the other basic job is done.
    premium = submit_chatty(plane, name="premium", tier="premium", steps=40, step_sleep=0.05)
    plane.wait_state(premium, "running", timeout=180)
    victims = [j for j in basic if plane.job(j)["preemption_count"] >= 1]
    assert len(victims) == 1, plane.diagnose(premium, *basic)
    victim = victims[0]
    for job in basic:
        plane.wait_state(job, "succeeded", timeout=400)
    for follower in followers:
        follower.join(timeout=60)
        assert not follower.is_alive()

    chunks = followed[victim]
    text = "".join(c["text"] for c in chunks)
    assert "meridian: preempting" in text and "rank 0 done" in text, text[-2000:]
    marker = next(i for i, c in enumerate(chunks) if c["kind"] == "marker" and "preempting" in c["text"])
    before = [c for c in chunks[:marker] if c["kind"] == "output"]
    after = [c for c in chunks[marker:] if c["kind"] == "output"]
    assert before and after
    assert {c["generation"] for c in after} - {c["generation"] for c in before}  # a new copy printed after it
    steps_before = [int(n) for n in re.findall(r"^step (\d+) rank 0$", "".join(c["text"] for c in before), re.M)]
    steps_after = [int(n) for n in re.findall(r"^step (\d+) rank 0$", "".join(c["text"] for c in after), re.M)]
    # The resumed copy counts on from its checkpoint (not from 1) and reaches the end.
    assert 1 < steps_after[0] <= steps_before[-1] + 1 and steps_after[-1] == 140, (steps_before, steps_after)
    assert len(plane.nodes_of(victim)) == 2, plane.diagnose(victim)  # two placements (same node or not)
    # The job that was not preempted has no marker but its start and end.
    assert not [c for c in followed[next(j for j in basic if j != victim)] if c["kind"] == "marker"]
    # `meridian logs JOB --rank 0` prints the same log, marker included; a job that is not there
    # is an error naming the 404. (Standalone, `python -m cli.logs` does the same.)
    cli = subprocess.run([sys.executable, "-m", "cli.main", "logs", "--url", plane.url, "--token", plane.token("alice"),
                          str(victim), "--rank", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == text
    missing = subprocess.run([sys.executable, "-m", "cli.main", "logs", "--url", plane.url, "--token",
                              plane.token("alice"), "99999"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert missing.returncode == 1 and "404" in missing.stderr
    print(f"followed {len(chunks)} chunks of job {victim}; the preemption marker is chunk {marker}", file=sys.stderr)
