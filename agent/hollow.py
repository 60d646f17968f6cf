"""Hollow nodes (like Kubemark): N simulated nodes in one process, for scale tests.

Each hollow node registers like a real one (its own token), leases or heartbeats with telemetry
as a real agent decides (agent/liveness.py), fetches its desired state and "runs" its jobs by a
model instead of processes: a job on d devices advances `steps_per_device_second * d` steps per
second, checkpoints every `checkpoint_every_s`, stops with a checkpoint when it is no longer
desired, and finishes at the job's total_steps (from its args `--steps N` when given). Everything
it sends goes through the same agent API as a real agent.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from agent.client import ControlPlaneClient, ControlPlaneError, TokenRejected
from agent.liveness import BeatPlanner, beat_once
from protocol.node import CheckpointReport, DesiredJob, DeviceDescription, JobReport, Registration, Telemetry
from protocol.states import CopyState, DesiredAction

log = logging.getLogger("agent.hollow")


def total_steps_of(entry: DesiredJob) -> int | None:
    """Returns the job's length from its args (`--steps N` / `--total-steps N`), or None."""
    args = [str(a) for a in entry.args]
    for flag in ("--steps", "--total-steps"):
        if flag in args and args.index(flag) + 1 < len(args):
            try:
                return int(args[args.index(flag) + 1])
            except ValueError:
                return None
    return None


class HollowJob:
    def __init__(self, entry: DesiredJob, now: float):
        self.job_id = entry.job_id
        self.generation = entry.generation
        self.store = entry.store or f"/hollow/job-{entry.job_id}"
        self.devices = entry.devices
        self.step = float(entry.last_checkpoint_step or 0)
        self.total_steps = total_steps_of(entry)
        self.checkpointed_at = now
        self.checkpoint: CheckpointReport | None = None
        self.state = CopyState.RUNNING


class HollowNode:
    def __init__(self, hostname, *, devices, device_type, client, steps_per_device_second=1.0,
                 checkpoint_every_s=60.0):
        self.hostname = hostname
        self.devices = devices
        self.device_type = device_type
        self.client = client
        self.rate = steps_per_device_second
        self.checkpoint_every_s = checkpoint_every_s
        self.jobs: dict[int, HollowJob] = {}
        self.last_beat = None
        self.planner = BeatPlanner()

    def register(self, enrollment_token, region, cluster):
        self.client.register(enrollment_token=enrollment_token, registration=Registration(
            hostname=self.hostname, region=region, cluster=cluster,
            devices=(DeviceDescription(type=self.device_type),) * self.devices, agent_version="meridian-agent/hollow"))

    def _advance(self, now):
        dt = 0.0 if self.last_beat is None else now - self.last_beat
        self.last_beat = now
        for job in self.jobs.values():
            if job.state != CopyState.RUNNING:
                continue
            job.step += self.rate * job.devices * dt
            if job.total_steps is not None and job.step >= job.total_steps:
                job.step = float(job.total_steps)
                job.state = CopyState.FINISHED
            elif now - job.checkpointed_at >= self.checkpoint_every_s:
                self._checkpoint(job, now)

    def _checkpoint(self, job, now):
        job.checkpointed_at = now
        step = int(job.step)
        # Nothing is written: a name in the copy's own store (the only place the control plane
        # accepts a checkpoint from) and the digest of a manifest that names it.
        name = f"ckpt-{step:012d}-{time.time_ns()}"
        digest = hashlib.sha256(f"hollow {self.hostname} {job.job_id} {name}".encode()).hexdigest()
        job.checkpoint = CheckpointReport(step=step, uri=f"{job.store.rstrip('/')}/{name}", bytes=1 << 20,
                                          engine="framework", sha256=digest)

    def observed(self) -> list[JobReport]:
        return [JobReport(job_id=job.job_id, state=job.state, step=int(job.step), devices=job.devices,
                          steps_per_s=self.rate * job.devices, generation=job.generation, checkpoint=job.checkpoint)
                for job in self.jobs.values()]

    def telemetry(self) -> Telemetry:
        busy = sum(j.devices for j in self.jobs.values() if j.state == CopyState.RUNNING)
        return Telemetry(utilization=min(1.0, busy / max(1, self.devices)))

    def beat(self, now=None):
        """One beat: advance the model; a lease when it suffices, else a full heartbeat (report,
        reconcile) as a real agent decides (agent/liveness.py). Returns the number of jobs
        reported (0 for a lease)."""
        now = time.monotonic() if now is None else now
        self._advance(now)
        observed = self.observed()
        answer = beat_once(client=self.client, planner=self.planner, reports=observed, now=now, alive=lambda sent: None,
                           full_heartbeat=lambda: self.client.heartbeat(telemetry=self.telemetry(), jobs=observed,
                                                                        retries=2))
        if answer is None:
            return 0
        accepted = set(answer.accepted)
        for job_id in list(self.jobs):
            if self.jobs[job_id].state in (CopyState.FINISHED, CopyState.STOPPED) and job_id in accepted:
                del self.jobs[job_id]
        for rejected in answer.rejected:
            if rejected.fence:  # a stale copy: killed without a checkpoint
                self.jobs.pop(rejected.job_id, None)
        # "stop" entries (a move's barrier) are stopped like jobs no longer listed, and so is a copy
        # of an older generation (a relaunch: a move to new hosts, a GPU job's resize), whose new
        # copy starts from the cut's checkpoint once this one's stop is heard, as a real agent does
        desired = {e.job_id: e for e in answer.desired.jobs if e.action != DesiredAction.STOP}
        for job_id, job in self.jobs.items():
            entry = desired.get(job_id)
            if job.state == CopyState.RUNNING and (entry is None or entry.generation not in (None, job.generation)):
                self._checkpoint(job, now)  # stop at a consistent cut
                job.state = CopyState.STOPPED
            elif job.state == CopyState.RUNNING and entry.devices != job.devices:
                job.devices = entry.devices  # resize in place
        for job_id, entry in desired.items():
            if job_id not in self.jobs and entry.action == DesiredAction.RUN:
                self.jobs[job_id] = HollowJob(entry, now)
        return len(observed)


class HollowFleet:
    """N hollow nodes heartbeating through a thread pool. run() loops until stop_event."""

    def __init__(self, options, stop_event, *, nodes_per_cluster=64, clusters_per_region=4):
        self.options = options
        self.stop_event = stop_event
        self.interval = options.interval or 10.0
        self.local = threading.local()
        self.nodes = []
        for i in range(options.hollow):
            client = ControlPlaneClient(options.control_plane, session=requests.Session(), retries=3)
            node = HollowNode(f"{options.hollow_prefix}-{i:06d}", devices=options.hollow_devices,
                              device_type=options.hollow_type, client=client,
                              checkpoint_every_s=options.checkpoint_every)
            cluster = i // nodes_per_cluster
            node.region = f"{options.hollow_prefix}-r{cluster // clusters_per_region}"
            node.cluster = f"{options.hollow_prefix}-c{cluster}"
            self.nodes.append(node)
        self.stats = {"heartbeats": 0, "failures": 0, "jobs_reported": 0}

    def register_all(self, threads=None):
        with ThreadPoolExecutor(threads or self.options.hollow_threads) as pool:
            list(pool.map(lambda n: n.register(self.options.enroll_token, n.region, n.cluster), self.nodes))

    def beat_all(self, threads=None):
        """One heartbeat from every node; returns (seconds, failures)."""
        began = time.perf_counter()
        failures = 0

        def one(node):
            try:
                return node.beat()
            except (TokenRejected, ControlPlaneError) as exc:
                log.warning("%s: heartbeat failed: %s", node.hostname, exc)
                return None

        with ThreadPoolExecutor(threads or self.options.hollow_threads) as pool:
            for result in pool.map(one, self.nodes):
                if result is None:
                    failures += 1
                else:
                    self.stats["jobs_reported"] += result
        self.stats["heartbeats"] += len(self.nodes) - failures
        self.stats["failures"] += failures
        return time.perf_counter() - began, failures

    def run(self):
        self.register_all()
        log.info("%d hollow nodes registered", len(self.nodes))
        while not self.stop_event.is_set():
            seconds, failures = self.beat_all()
            log.info("%d heartbeats in %.2f s (%d failed)", len(self.nodes), seconds, failures)
            self.stop_event.wait(max(0.0, self.interval - seconds))
        return 0
