"""The acting half of the control loop: what each node should run (desired state) and what its
agent saw (observed state). The multi-step moves between placements (preemption, migration,
resize) are persisted workflows run by Celery: jobs/moves.py.

Desired state is derived from the database, including each job's active Move: the new node of a
migration is told "wait" until the move reaches its restore step, the old node is told "stop"
(a consistent cut, checkpoint, store commit) from the barrier on. Every entry carries the job's
placement generation; the agent passes it to the job's directory and reports it back.

Reports are applied here: checkpoints and progress are recorded, a scheduled job that runs
becomes running, a finished or failed job ends. A moving job's transitions are not made here:
the report is recorded on the job's Move and the move's task is enqueued (jobs/moves.py).
A report of a stale generation (a copy fenced off after its node was lost, or replaced) is
rejected with "fence": true and changes nothing; the agent kills that copy without a checkpoint.

Because agents act on the level (desired vs observed) a lost report is repeated by the next
heartbeat; a step that already happened is a no-op.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import OuterRef, Q, Subquery
from django.utils import timezone

from fleet.services import node_heartbeat_record
from jobs.models import Checkpoint, Job, Move, Replica
from jobs.moves import move_observe
from jobs.services import IllegalTransition, checkpoint_record, job_transition

logger = logging.getLogger(__name__)
S = Job.State

DESIRED_STATES = (S.SCHEDULED, S.RUNNING, S.MIGRATING, S.RESIZING)
MOVING_STATES = (S.PREEMPTING, S.MIGRATING, S.RESIZING)
OBSERVED_STATES = {"starting", "running", "stopped", "finished", "failed"}
# Steps of a migration from which the new node may restore (the old copy's checkpoint is stored).
RESTORE_STEPS = (Move.Step.RESTORE, Move.Step.RELEASE)
# Steps during which the old node is told to stop its copy.
STOP_STEPS = (Move.Step.BARRIER, Move.Step.CHECKPOINT, Move.Step.STORE, Move.Step.RESTORE, Move.Step.RELEASE)


def workflow_timeout():
    return timedelta(seconds=settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS)


def node_lost_after_seconds():
    return settings.MERIDIAN_NODE_LOST_AFTER_SECONDS


def checkpoint_store_root():
    """Returns the shared checkpoint store root: MERIDIAN_CHECKPOINT_STORE or <data dir>/checkpoints."""
    return str(settings.MERIDIAN_CHECKPOINT_STORE).rstrip("/")


def job_store_uri(job_id, *, generation=None):
    """Returns the job's checkpoint store folder: <root>/job-<id>, and within it one folder per
    placement generation (g<n>): a fenced copy writes only into its own generation's folder."""
    base = f"{checkpoint_store_root()}/job-{job_id}"
    return base if generation is None else f"{base}/g{int(generation)}"


# --- desired state -------------------------------------------------------------------------------


def node_desired_state(*, node):
    """Returns {"node_id", "hostname", "state", "lost_after_seconds", "jobs": [...]}: what `node`'s
    agent should run now.

    One entry per job with replicas on this node's devices: action "run" (launch, restore, or
    resize to `devices`) or "wait" (a migration that has not reached its restore step), with the
    generation's own `store` folder and `restore_from`, the newest checkpoint the control plane
    accepted (the agent seeds the new store with it; None: start afresh), plus one
    entry with action "stop" per job whose active move takes its old copy off this node. Every
    entry has the placement `generation` the agent must run (or stop). A job the agent runs that
    is not listed must be stopped with a checkpoint. Three queries.
    """
    rows = (
        Replica.objects.filter(device__node_id=node.pk, job__state__in=DESIRED_STATES)
        .values_list("job_id", "device_id", "device__index")
    )
    devices = defaultdict(set)
    for job_id, device_id, index in rows:
        devices[job_id].add(index)
    moves = {m.job_id: m for m in Move.objects.filter(
        Q(job_id__in=list(devices)) | Q(from_node_id=node.pk), state=Move.State.ACTIVE).only(
        "job_id", "kind", "step", "from_node_id", "from_generation")}
    newest_checkpoint = Checkpoint.objects.filter(job_id=OuterRef("pk")).order_by("-step", "-id").values("uri")[:1]
    jobs = Job.objects.filter(pk__in=list(devices)).only(
        "id", "name", "state", "world_size", "min_devices", "entrypoint", "args", "env", "tier",
        "total_steps", "last_checkpoint_step", "generation",
    ).annotate(restore_from=Subquery(newest_checkpoint))
    entries = []
    for job in jobs.order_by("id"):
        move = moves.get(job.pk)
        waiting = job.state == S.MIGRATING and not (move and move.step in RESTORE_STEPS)
        entries.append({
            "job_id": job.pk, "name": job.name, "tier": job.tier, "state": job.state,
            "action": "wait" if waiting else "run", "generation": job.generation,
            "world_size": job.world_size, "devices": len(devices[job.pk]),
            "device_indices": sorted(devices[job.pk]), "entrypoint": job.entrypoint,
            "args": list(job.args), "env": dict(job.env),
            "store": job_store_uri(job.pk, generation=job.generation), "restore_from": job.restore_from,
            "last_checkpoint_step": job.last_checkpoint_step,
        })
    listed = {e["job_id"] for e in entries}
    for move in moves.values():
        if (move.from_node_id == node.pk and move.kind != Move.Kind.RESIZE and move.step in STOP_STEPS
                and move.job_id not in listed):
            entries.append({"job_id": move.job_id, "action": "stop", "generation": move.from_generation,
                            "move": move.kind, "step": move.step})
    return {"node_id": node.pk, "hostname": node.hostname, "state": node.state,
            "lost_after_seconds": node_lost_after_seconds(), "jobs": entries}


# --- observed state -----------------------------------------------------------------------------


def _placed_on(node_id, job_ids):
    return set(
        Replica.objects.filter(device__node_id=node_id, job_id__in=job_ids).values_list("job_id", flat=True)
    )


def node_report_apply(*, node, report, now=None):
    """Applies one agent report (heartbeat, telemetry, observed jobs); returns {"accepted",
    "rejected", "deferred"}.

    `report` = {"telemetry": {"utilization", "memory_used_gb", "devices": [{"index",
    "utilization", "memory_used_gb"}]}, "jobs": [{"job_id", "generation", "state", "step",
    "steps_per_s", "devices", "cut": {"action", "step", "devices"}, "restored_step",
    "checkpoint": {"step", "uri", "bytes", "engine", "sha256"}, "exit_code", "error"}]}.
    A node may report only on jobs placed on it, or whose active move takes them off it (or a
    final "stopped" of a job just moved off it); other job ids are rejected (listed) and change
    nothing. A report naming a generation other than the job's current one (or, during a move,
    the old copy's) is rejected with "fence": true; a running copy of a cancelled job with
    "cancel": true (the agent kills it without a checkpoint and removes its store). A finished
    report of a job still in the middle of a migration is deferred (neither accepted nor
    rejected: the agent reports it again).
    Idempotent: a repeated report is a no-op.
    """
    now = now or timezone.now()
    accepted, rejected, deferred = [], [], []
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
        moves = {m.job_id: m for m in Move.objects.filter(job_id__in=ids, state=Move.State.ACTIVE)} if ids else {}
        for entry in observed:
            job = jobs.get(int(entry["job_id"]))
            if job is None:
                rejected.append({"job_id": entry["job_id"], "error": "no such job"})
                continue
            here = job.pk in placed
            move = moves.get(job.pk)
            said = entry.get("generation")
            if said is None:  # an agent that does not say (hollow nodes, older agents)
                old_node = move is not None and move.from_node_id == node.pk
                generation = move.from_generation if old_node and not here else job.generation
            else:
                try:
                    generation = int(said)
                except (TypeError, ValueError):
                    rejected.append({"job_id": job.pk, "error": f"generation must be a whole number, got {said!r}"})
                    continue
            old_copy = move is not None and move.from_node_id == node.pk and generation == move.from_generation
            if generation != job.generation and not old_copy:
                rejected.append({"job_id": job.pk, "fence": True,
                                 "error": f"stale copy: generation {generation}, the job now runs as generation "
                                          f"{job.generation}; kill it without a checkpoint"})
                continue
            # A node may also report on the copy a move takes off it, and the final checkpoint of
            # a job just moved off it.
            leaving = not here and (old_copy or (
                job.state in (S.PREEMPTING, S.MIGRATING, S.PREEMPTED, S.CANCELLED, S.PENDING, S.RUNNING,
                              S.SCHEDULED) and entry.get("state") == "stopped"))
            if not (here or leaving):
                if job.state == S.CANCELLED and entry.get("state") in ("starting", "running"):
                    rejected.append({"job_id": job.pk, "cancel": True,
                                     "error": "the job was cancelled; kill it without a checkpoint"})
                    continue
                rejected.append({"job_id": job.pk, "error": "this job is not placed on your node"})
                continue
            current = here and generation == job.generation
            result = _observed_apply(job=job, entry=entry, current=current, node=node, now=now)
            if move is not None and (old_copy or current):
                move_observe(move=move, generation=generation, node=node, entry=entry, now=now)
            (deferred if result == "deferred" else accepted).append(job.pk)
    return {"accepted": accepted, "rejected": rejected, "deferred": deferred}


def _observed_apply(*, job, entry, current, node, now):
    """Records one accepted report on `job`; `current`: it comes from the job's current copy on
    its placed node. Returns "deferred" when a final state must wait (see node_report_apply)."""
    state = entry.get("state")
    checkpoint = entry.get("checkpoint") or {}
    if checkpoint.get("uri") and checkpoint.get("step") is not None:
        step = int(checkpoint["step"])
        if not Checkpoint.objects.filter(job=job, uri=checkpoint["uri"]).exists():
            checkpoint_record(job=job, step=step, engine=checkpoint.get("engine") or "framework",
                              uri=checkpoint["uri"], size_bytes=int(checkpoint.get("bytes") or 0),
                              sha256=checkpoint.get("sha256") or "", now=now)
            job.refresh_from_db()
    if current and entry.get("step") is not None:
        step = int(entry["step"])
        updates = {"steps_per_second": entry.get("steps_per_s")}
        if step >= job.progress_step or state in ("starting", "running"):
            updates["progress_step"] = step
        Job.objects.filter(pk=job.pk).update(**updates)
    if not current:
        return None
    try:
        if state == "running" and job.state == S.SCHEDULED:
            job_transition(job=job, to=S.RUNNING, reason=f"running on {node.hostname}", now=now,
                           extra={"node": node.hostname, "devices": entry.get("devices")})
        elif state == "finished" and job.state == S.MIGRATING:
            return "deferred"  # the move's restore/release steps run first; reported again then
        elif state == "finished" and job.state in (S.SCHEDULED, S.RUNNING, S.RESIZING):
            if job.state == S.SCHEDULED:
                job = job_transition(job=job, to=S.RUNNING, now=now, reason=f"ran on {node.hostname}")
            Job.objects.filter(pk=job.pk).update(exit_code=0)
            job_transition(job=job, to=S.SUCCEEDED, now=now, reason=f"finished on {node.hostname}",
                           extra={"step": entry.get("step")})
        elif state == "failed" and job.state in (S.SCHEDULED, S.RUNNING, S.RESIZING):
            error = str(entry.get("error") or "the job's launcher failed")
            Job.objects.filter(pk=job.pk).update(exit_code=entry.get("exit_code"), failure_reason=error[:4000])
            job_transition(job=job, to=S.FAILED, now=now, reason=error[:500])
    except IllegalTransition as exc:
        logger.info("report from %s on job %s: %s", node.hostname, job.pk, exc)
    return None


# --- timeouts ------------------------------------------------------------------------------------


def workflow_timeouts_sweep(*, now=None):
    """Ends jobs stuck in a moving state (preempting, migrating, resizing) with no active Move
    longer than workflow_timeout() (moves time out by their steps: jobs.moves.moves_sweep): the
    job goes back in line (preempted) and restarts from its last checkpoint. Returns how many."""
    now = now or timezone.now()
    cutoff = now - workflow_timeout()
    ended = 0
    stuck = Job.objects.filter(state__in=MOVING_STATES, state_changed_at__lt=cutoff).exclude(
        moves__state=Move.State.ACTIVE)
    for job in stuck:
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
