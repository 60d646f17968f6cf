"""The acting half of the control loop: what each node should run (desired state), what its
agent saw (observed state), and the multi-step moves between them.

A move is a sequence of idempotent steps, each leaving a JobEvent, each with a timeout:

  preemption  tick: running -> preempting, devices released
              agent (old node): not in its desired state -> `stop` at a consistent cut
              (barrier + checkpoint + store commit) -> reports "stopped" with the checkpoint
              here: checkpoint recorded, preempting -> preempted (back in line)
  migration   tick: running -> migrating, replicas on the new devices
              agent (old node): stop with a checkpoint -> "stopped"; here: migrating -> running
              agent (new node): its desired state said "wait" while migrating, now "run": it
              restores the newest checkpoint of the job's store (release = the old node's
              processes are gone before the new ones start)
  resize      tick: running -> resizing, replicas re-laid; agent: JobControl.resize(d) (splicing)
              -> reports the new device count; here: resizing -> running

Because agents act on the level (desired vs observed) a lost report is repeated by the next
heartbeat; a step that already happened is a no-op. A move that makes no progress within
MERIDIAN_WORKFLOW_TIMEOUT_SECONDS (default 300) is ended by workflow_timeouts_sweep: the job
goes back in line and restarts from its last checkpoint.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from fleet.services import node_heartbeat_record
from jobs.models import Checkpoint, Job, JobEvent, Replica
from jobs.services import IllegalTransition, checkpoint_record, job_event_add, job_transition

logger = logging.getLogger(__name__)
S = Job.State

DESIRED_STATES = (S.SCHEDULED, S.RUNNING, S.MIGRATING, S.RESIZING)
MOVING_STATES = (S.PREEMPTING, S.MIGRATING, S.RESIZING)
OBSERVED_STATES = {"starting", "running", "stopped", "finished", "failed"}


def workflow_timeout():
    return timedelta(seconds=float(os.environ.get("MERIDIAN_WORKFLOW_TIMEOUT_SECONDS", "300")))


def checkpoint_store_root():
    """Returns the shared checkpoint store root: MERIDIAN_CHECKPOINT_STORE or <data dir>/checkpoints."""
    root = os.environ.get("MERIDIAN_CHECKPOINT_STORE") or str(settings.DATA_DIR / "checkpoints")
    return root.rstrip("/")


def job_store_uri(job_id):
    return f"{checkpoint_store_root()}/job-{job_id}"


# --- desired state -------------------------------------------------------------------------------


def node_desired_state(*, node):
    """Returns {"node_id", "hostname", "jobs": [...]} : what `node`'s agent should run now.

    One entry per job with replicas on this node's devices: action "run" (launch, restore, or
    resize to `devices`) or "wait" (migrating: the old copy has not stopped yet). A job the agent
    runs that is not listed must be stopped with a checkpoint. Two queries.
    """
    rows = (
        Replica.objects.filter(device__node_id=node.pk, job__state__in=DESIRED_STATES)
        .values_list("job_id", "device_id", "device__index")
    )
    devices = defaultdict(set)
    for job_id, device_id, index in rows:
        devices[job_id].add(index)
    jobs = Job.objects.filter(pk__in=list(devices)).only(
        "id", "name", "state", "world_size", "min_devices", "entrypoint", "args", "env", "tier",
        "total_steps", "last_checkpoint_step",
    )
    entries = []
    for job in jobs.order_by("id"):
        entries.append({
            "job_id": job.pk, "name": job.name, "tier": job.tier, "state": job.state,
            "action": "wait" if job.state == S.MIGRATING else "run",
            "world_size": job.world_size, "devices": len(devices[job.pk]),
            "device_indices": sorted(devices[job.pk]), "entrypoint": job.entrypoint,
            "args": list(job.args), "env": dict(job.env), "store": job_store_uri(job.pk),
            "last_checkpoint_step": job.last_checkpoint_step,
        })
    return {"node_id": node.pk, "hostname": node.hostname, "state": node.state, "jobs": entries}


# --- observed state -----------------------------------------------------------------------------


def _placed_on(node_id, job_ids):
    return set(
        Replica.objects.filter(device__node_id=node_id, job_id__in=job_ids).values_list("job_id", flat=True)
    )


def node_report_apply(*, node, report, now=None):
    """Applies one agent report (heartbeat, telemetry, observed jobs); returns {"accepted", "rejected"}.

    `report` = {"telemetry": {"utilization", "memory_used_gb", "devices": [{"index",
    "utilization", "memory_used_gb"}]}, "jobs": [{"job_id", "state", "step", "steps_per_s",
    "devices", "checkpoint": {"step", "uri", "bytes", "engine", "sha256"}, "exit_code",
    "error"}]}. A node may report only on jobs placed on it, or being moved off it; other
    job ids are rejected (listed) and change nothing. Idempotent: a repeated report is a no-op.
    """
    now = now or timezone.now()
    accepted, rejected = [], []
    with transaction.atomic():
        if connection.vendor == "postgresql":
            # A heartbeat lost in a database crash is repeated by the next one (level-triggered):
            # no need to wait for its WAL flush (the biggest cost of a heartbeat at scale).
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit = off")
        node_heartbeat_record(node=node, telemetry=report.get("telemetry") or {}, now=now)
        observed = [j for j in report.get("jobs") or [] if isinstance(j, dict) and "job_id" in j]
        ids = [int(j["job_id"]) for j in observed]
        jobs = Job.objects.in_bulk(ids)
        placed = _placed_on(node.pk, ids)
        for entry in observed:
            job = jobs.get(int(entry["job_id"]))
            if job is None:
                rejected.append({"job_id": entry["job_id"], "error": "no such job"})
                continue
            here = job.pk in placed
            # A node may also report the final checkpoint of a job just moved off it.
            leaving = not here and job.state in (S.PREEMPTING, S.MIGRATING, S.PREEMPTED, S.CANCELLED,
                                                 S.PENDING, S.RUNNING, S.SCHEDULED) \
                and entry.get("state") == "stopped"
            if not (here or leaving):
                rejected.append({"job_id": job.pk, "error": "this job is not placed on your node"})
                continue
            _observed_apply(job=job, entry=entry, here=here, node=node, now=now)
            accepted.append(job.pk)
    return {"accepted": accepted, "rejected": rejected}


def _observed_apply(*, job, entry, here, node, now):
    state = entry.get("state")
    checkpoint = entry.get("checkpoint") or {}
    if checkpoint.get("uri") and checkpoint.get("step") is not None:
        step = int(checkpoint["step"])
        if not Checkpoint.objects.filter(job=job, uri=checkpoint["uri"]).exists():
            checkpoint_record(job=job, step=step, engine=checkpoint.get("engine") or "framework",
                              uri=checkpoint["uri"], size_bytes=int(checkpoint.get("bytes") or 0),
                              sha256=checkpoint.get("sha256") or "", now=now)
            job.refresh_from_db()
    if here and entry.get("step") is not None:
        step = int(entry["step"])
        updates = {"steps_per_second": entry.get("steps_per_s")}
        if step >= job.progress_step or state in ("starting", "running"):
            updates["progress_step"] = step
        Job.objects.filter(pk=job.pk).update(**updates)
    try:
        if state == "running" and here:
            if job.state == S.SCHEDULED:
                job_transition(job=job, to=S.RUNNING, reason=f"running on {node.hostname}", now=now,
                               extra={"node": node.hostname, "devices": entry.get("devices")})
            elif job.state == S.RESIZING and int(entry.get("devices") or 0) == job.device_count:
                job = job_transition(job=job, to=S.RUNNING, reason=f"resized to {job.device_count} device(s)",
                                     now=now)
                job_event_add(job=job, type=JobEvent.Type.RESIZED,
                              reason=f"{job.world_size} ranks on {job.device_count} device(s) on {node.hostname}",
                              extra={"devices": job.device_count, "step": entry.get("step")})
        elif state == "stopped":
            step = (checkpoint or {}).get("step")
            if job.state == S.PREEMPTING:
                job_transition(job=job, to=S.PREEMPTED, now=now,
                               reason=f"checkpointed at step {step} on {node.hostname} and stopped")
            elif job.state == S.MIGRATING and not here:
                job = job_transition(job=job, to=S.RUNNING, now=now,
                                     reason=f"checkpointed at step {step} on {node.hostname}; restoring on the new devices")
                job_event_add(job=job, type=JobEvent.Type.RESTORED, reason="restore handed to the new node",
                              extra={"step": step, "from_node": node.hostname})
        elif state == "finished" and here and job.state in (S.SCHEDULED, S.RUNNING, S.RESIZING):
            if job.state == S.RESIZING and int(entry.get("devices") or 0) == job.device_count:
                job_event_add(job=job, type=JobEvent.Type.RESIZED,
                              reason=f"{job.world_size} ranks on {job.device_count} device(s) on {node.hostname}",
                              extra={"devices": job.device_count, "step": entry.get("step")})
            if job.state == S.SCHEDULED:
                job = job_transition(job=job, to=S.RUNNING, now=now, reason=f"ran on {node.hostname}")
            Job.objects.filter(pk=job.pk).update(exit_code=0)
            job_transition(job=job, to=S.SUCCEEDED, now=now, reason=f"finished on {node.hostname}",
                           extra={"step": entry.get("step")})
        elif state == "failed" and here and job.state in (S.SCHEDULED, S.RUNNING, S.RESIZING):
            error = str(entry.get("error") or "the job's launcher failed")
            Job.objects.filter(pk=job.pk).update(exit_code=entry.get("exit_code"), failure_reason=error[:4000])
            job_transition(job=job, to=S.FAILED, now=now, reason=error[:500])
    except IllegalTransition as exc:
        logger.info("report from %s on job %s: %s", node.hostname, job.pk, exc)


# --- timeouts ------------------------------------------------------------------------------------


def workflow_timeouts_sweep(*, now=None):
    """Ends moves (preempting, migrating, resizing) stuck longer than workflow_timeout(): the job
    goes back in line (preempted) and restarts from its last checkpoint. Returns how many."""
    now = now or timezone.now()
    cutoff = now - workflow_timeout()
    ended = 0
    for job in Job.objects.filter(state__in=MOVING_STATES, state_changed_at__lt=cutoff):
        try:
            job_transition(
                job=job, to=S.PREEMPTED, now=now,
                reason=f"{job.state} made no progress within {workflow_timeout().total_seconds():.0f} s; "
                       f"back in line, resuming from checkpoint step {job.last_checkpoint_step}",
                extra={"timed_out": job.state},
            )
            ended += 1
        except IllegalTransition:
            continue
    return ended


# --- retention ------------------------------------------------------------------------------------

CHECKPOINT_ROWS_KEPT = 3  # per job, as the runtime's store keeps 3 checkpoints (--keep)


def checkpoint_rows_prune(*, keep=CHECKPOINT_ROWS_KEPT, batch=5000):
    """Deletes Checkpoint rows beyond the newest `keep` per job; returns how many it deleted.

    Agents report a checkpoint every interval for every running job; the store itself keeps only
    the newest few, so older rows point at nothing. (Telemetry needs no pruning: it is stored as
    the latest value per node and device.)
    """
    from django.db.models import F, Window
    from django.db.models.functions import RowNumber

    ranked = Checkpoint.objects.annotate(
        newest=Window(RowNumber(), partition_by=[F("job_id")], order_by=[F("step").desc(), F("id").desc()]))
    deleted = 0
    while True:
        ids = list(ranked.filter(newest__gt=keep).values_list("id", flat=True)[:batch])
        if not ids:
            return deleted
        deleted += Checkpoint.objects.filter(pk__in=ids).delete()[0]
