"""A node that really ships logs, for the live-tail browser test and bench/log_latency.py.

`LogNode` places a job on one of the portal's devices (as the control loop would), issues that
node's agent token, and runs the agent's own LogShipper (agent/logs.py, over agent/client.py's
HTTP client, against the portal's POST /api/agent/logs/) on a job directory laid out as the
launcher lays one out (logs.json, logs/rank<r>.log, agent.json). `print_line` appends one line
to a rank's log with a write(2), which is what a rank's line-buffered print does to the file its
stdout is (runtime/rank.py): no training process is started, so the figure is the log path's
own (file -> agent -> control plane -> push -> browser).
"""
from __future__ import annotations

import json
import os
import pathlib
import threading

from browser_harness import free_devices, place_job


def _place_and_token(world_size):
    from django.contrib.auth import get_user_model

    from fleet.services import node_token_issue
    from jobs.logs import log_grant
    from jobs.models import Team
    from jobs.services import job_submit

    alice = get_user_model().objects.get(username="alice")
    job = job_submit(team=Team.objects.get(slug="team-a"), submitted_by=alice,
                     spec={"name": "log-tail", "entrypoint": "train.py", "accelerator_type": "CPU",
                           "world_size": world_size, "min_devices": world_size, "tier": "basic"})
    devices = free_devices(world_size)
    node_ids = {d.node_id for d in devices}
    devices = [d for d in devices if d.node_id == min(node_ids)] or devices
    while len(devices) < world_size:
        devices.append(devices[0])  # spliced: several ranks on one device
    place_job(job, devices[:world_size])
    job.refresh_from_db()
    grant = log_grant(job_id=job.pk, generation=job.generation, node_id=devices[0].node_id)  # as desired/ names it
    return job.pk, job.generation, grant, node_token_issue(node=devices[0].node)


class LogNode:
    def __init__(self, portal, work_dir, *, world_size=2, poll_s=None):
        from agent.client import ControlPlaneClient
        from agent.logs import POLL_S, LogShipper

        self.job_id, generation, grant, token = portal.call(_place_and_token, world_size)
        self.job_dir = pathlib.Path(work_dir) / "j" / f"{self.job_id}.1"
        (self.job_dir / "logs").mkdir(parents=True)
        ranks = []
        for rank in range(world_size):
            path = self.job_dir / "logs" / f"rank{rank}.log"
            path.touch()
            ranks.append({"rank": rank, "path": str(path), "start": 0})
        (self.job_dir / "logs.json").write_text(json.dumps({"ranks": ranks}))
        (self.job_dir / "agent.json").write_text(json.dumps({"job_id": self.job_id, "generation": generation,
                                                             "pid": os.getpid(), "log_grant": grant}))
        self.client = ControlPlaneClient(portal.url, token=token)
        self.shipper = LogShipper(self.job_dir.parent, self.client, poll_s=POLL_S if poll_s is None else poll_s)
        self.stop_event = threading.Event()
        self.thread = self.shipper.start(self.stop_event)

    def print_line(self, rank, text):
        fd = os.open(self.job_dir / "logs" / f"rank{rank}.log", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (text + "\n").encode())
        finally:
            os.close(fd)

    def close(self):
        self.stop_event.set()
        self.thread.join(timeout=10)
