"""Helpers of the live-log tests on the e2e stack: agents with log flags, a web server to stop
and start again, a chatty job, and reading the log through the API."""
from __future__ import annotations

import os
import pathlib
import signal

from harness import BIN
from polling import poll

from portal.web_server import web_server_argv

CHATTY = "tests/logs/chatty_train.py"


def start_agent(plane, hostname, *, devices=1, extra=(), checkpoint_every=3.0):
    """harness.start_agent with the framework engine and sandbox off (the chatty job renames files in
    the test's folder, which a job uid could not); returns the agent's work dir."""
    plane.start_agent(hostname, devices=devices, checkpoint_every=checkpoint_every, extra=extra)
    return plane.agents[hostname][1]


def stop_web(plane):
    """Kills the control plane's web server (uvicorn) only: agents and jobs go on."""
    process = plane.processes["web"]
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    poll("the web server to be down", lambda: not plane._answers(), timeout=30)


def start_web(plane):
    plane._spawn("web", web_server_argv(bin_dir=BIN, port=plane.port))
    poll("the web server", plane._answers, timeout=90, on_timeout=plane.logs)


def submit_chatty(plane, *, name, tier="basic", steps=100000, step_sleep=0.1, control=None, user="alice"):
    args = ["--steps", str(steps), "--step-sleep", str(step_sleep)]
    if control:
        args += ["--control", str(control)]
    spec = {"name": name, "tier": tier, "accelerator_type": "CPU", "world_size": 1, "min_devices": 1,
            "entrypoint": CHATTY, "args": args}
    response = plane.api("POST", "jobs/", json=spec, user=user)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def log_chunks(plane, job_id, *, rank=None, user="alice"):
    """Returns every chunk of the job's log, through the API's cursor."""
    chunks, after = [], 0
    while True:
        query = f"jobs/{job_id}/logs/?limit=1000&after={after}" + (f"&rank={rank}" if rank is not None else "")
        response = plane.api("GET", query, user=user)
        assert response.status_code == 200, response.text
        body = response.json()
        chunks += body["chunks"]
        if len(body["chunks"]) < 1000:
            return chunks
        after = body["next"]


def log_text(plane, job_id, **kwargs):
    return "".join(c["text"] for c in log_chunks(plane, job_id, **kwargs))


def rank_log_file(work_dir: pathlib.Path, job_id) -> pathlib.Path:
    """Returns the newest attempt's rank 0 log of job `job_id` on an agent."""
    attempts = sorted((work_dir / "j").glob(f"{job_id}.*"), key=lambda p: int(p.suffix[1:]))
    return attempts[-1] / "logs" / "rank0.log"
