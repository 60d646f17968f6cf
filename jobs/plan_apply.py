"""Applying a Plan: the tick's write half (services), inside the caller's transaction.

    plan_apply(index=..., plan=..., now=...) -> {"rows": n, "counts": {...}}

Every new placement bumps the job's generation (agents' reports of older copies are then
rejected: fencing). Preempt, Migrate and Resize of a running job create a Move (jobs/moves.py)
whose Celery chain runs its steps. One applier per decision type (APPLIERS):
  Start        pending/preempted -> scheduled, replicas on the devices (rank_layout), generation+1;
               all of a plan's starts together, through jobs_transition_bulk
  Preempt      running -> preempting, replicas released, Move(preemption): barrier, checkpoint,
               store, release (-> preempted); scheduled -> pending; a job on a lost node ->
               preempted at once, generation+1 (it restarts from its last checkpoint)
  Preempt needing approval: preemption_request_create (idempotent; nothing else happens)
  Migrate      running -> migrating, replicas on the new devices, generation+1, Move(migration):
               live: barrier, checkpoint, store (old node), restore (new node), release (->
               running). From a checkpoint (lost node): restore, release. A partial one
               (decision.kept: only a leaving node's devices are replaced) is the same move; the
               hosts it keeps are both source and destination: their agent stops the old
               generation's copy, then runs the new one on the same devices (all W ranks relaunch
               from the cut: no rank process survives the move, not even on a staying host)
  Resize       running -> resizing, replicas re-laid on the new devices, Move(resize): barrier,
               resize (the agent splices), release (-> running). A resize across hosts (the job
               spans several before or after, or changes host), and any resize of a GPU job, is a
               new generation: barrier, checkpoint, store, restore, release (jobs/moves.py,
               RELAUNCH_RESIZE_STEPS)
  waiting      wait_reason and queue_position written to every waiting job
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import datetime
from datetime import timezone as dt_timezone

import numpy as np

import scheduler
from fleet.accelerator_types import is_gpu
from jobs.bulk import EventRow, RowWrites, instances_loaded, rows_update
from jobs.models import Job, JobEvent, Move, Replica
from jobs.moves import move_create
from jobs.services import (
    IllegalTransition,
    job_event_add,
    job_generation_bump,
    job_transition,
    jobs_transition_bulk,
    preemption_request_create,
)
from jobs.snapshot import WAITING_STATES, SnapshotIndex
from protocol.layout import rank_devices
from scheduler.plugins.drain import REASON_LOST_REQUEUED

logger = logging.getLogger(__name__)
S = Job.State

LIVE_PUSH_MAX_STARTS = 50  # above this many starts in one tick, pages catch up on their next poll
# (the counter in plan_apply's counts the decision adds to, rows written)
Applied = tuple[str, int]


def plan_apply(*, index: SnapshotIndex, plan: scheduler.Plan, now: datetime) -> dict:
    """Applies `plan` (made from `index`) to the database; returns {"rows": n, "counts": {...}}.

    Call inside a transaction. A decision whose job moved meanwhile (StaleJobState) is skipped
    and logged: the next tick decides again from fresh state (level-triggered). A decision whose
    job was deleted since the snapshot is dropped.
    """
    rows = 0
    counts = {"start": 0, "preempt": 0, "approval": 0, "migrate": 0, "resize": 0, "skipped": 0}
    starts = plan.of_kind(scheduler.Start)
    others = [d for d in plan.decisions if not isinstance(d, scheduler.Start)]
    jobs = Job.objects.in_bulk([d.job_id for d in others])
    for decision in others:
        job = jobs.get(decision.job_id)
        if job is None:
            continue
        try:
            counter, written = APPLIERS[type(decision)](job=job, decision=decision, index=index, now=now)
        except IllegalTransition as exc:
            logger.info("tick: skipped %s of job %s: %s", decision.kind, decision.job_id, exc)
            counts["skipped"] += 1
            continue
        counts[counter] += 1
        rows += written
    # Starts go last and together: a placement tick may start thousands of jobs. The devices they
    # take were released above (Replica rows are per job, so the order in the database is free).
    started, start_rows = _start_many(index=index, starts=starts, now=now)
    counts["start"] += started
    counts["skipped"] += len(starts) - started
    rows += start_rows
    rows += _write_waiting(plan=plan)
    return {"rows": rows, "counts": counts}


# --- one applier per decision type ---------------------------------------------------------------


def _preempt_apply(*, job: Job, decision: scheduler.Preempt, index: SnapshotIndex, now: datetime) -> Applied:
    if decision.needs_approval:
        return _preemption_request_file(job=job, decision=decision, index=index, now=now)
    return "preempt", _preempt(job=job, decision=decision, now=now)


def _preemption_request_file(*, job: Job, decision: scheduler.Preempt, index: SnapshotIndex,
                             now: datetime) -> Applied:
    """Files (idempotently) the request a capacity manager decides; the job itself is untouched."""
    snap = index.snapshot
    held = snap.allocation_counts()[decision.job]
    since = snap.now - max(snap.jobs.last_checkpoint_time[decision.job], snap.jobs.last_start_time[decision.job])
    lost = float(held * since) if np.isfinite(since) else 0.0
    preemption_request_create(job=job, reason=decision.reason, lost_work_seconds=lost,
                              extra={"code": decision.code}, now=now)
    return "approval", 2


def _migrate_apply(*, job: Job, decision: scheduler.Migrate, index: SnapshotIndex, now: datetime) -> Applied:
    devices = _accelerators_by_host(index, decision.devices)
    region = index.region_ids[int(index.snapshot.accelerators.region[decision.devices[0]])]
    return "migrate", _migrate(job=job, decision=decision, devices=devices, region=region,
                               nodes=_nodes_of(index, decision.devices), now=now)


def _resize_apply(*, job: Job, decision: scheduler.Resize, index: SnapshotIndex, now: datetime) -> Applied:
    devices = _accelerators_by_host(index, decision.devices)
    if job.state == S.SCHEDULED:
        # Not reported running yet: just lay it out anew. Its agent may have launched it already on
        # the old layout, though: when the hosts change (a 4-device copy on one host grown onto two),
        # that copy must not run on as if nothing had changed (it would never meet the new host's
        # share), so the layout is a new generation (the old copy is fenced) and a new placement.
        # A GPU job's too, on its host: that copy's ranks cannot move to the new GPUs in place.
        relaunch = _node_ids_held(job.pk) != _node_ids_of(index, decision.devices) or is_gpu(job.accelerator_type)
        if relaunch:
            job_generation_bump(job)
        rows = _place_replicas(job=job, device_ids=devices)
        Job.objects.filter(pk=job.pk).update(device_count=len(devices))
        if relaunch:
            job_event_add(job=job, type=JobEvent.Type.PLACED, reason=decision.reason,
                          extra={"devices": devices, "nodes": _nodes_of(index, decision.devices),
                                 "generation": job.generation,
                                 "code": decision.code})
        return "resize", rows + (4 if relaunch else 2)
    from_devices = job.device_count
    dropped = sorted(set(_device_ids_held(job.pk)) - set(devices))  # a shrink's; none on growth
    from_node, from_nodes = _rank0_node(job.pk), _node_ids_held(job.pk)
    to_nodes = _nodes_of(index, decision.devices)
    # Across hosts (it spans several before or after, or lands on another host): the launchers of
    # one placement cannot re-splice their ranks onto another set of hosts in place, so the resize
    # is a cut + checkpoint + relaunch on the new hosts, as a new generation (jobs/moves.py). A GPU
    # job's too, on one host: its ranks' GPUs were fixed when they started (runtime/launcher.py
    # GPU_RESIZE_REFUSAL), so they are relaunched on the new ones with LOCAL_RANK naming them.
    across_hosts = len(from_nodes) > 1 or len(to_nodes) > 1 or from_nodes != _node_ids_of(index, decision.devices)
    relaunch = across_hosts or is_gpu(job.accelerator_type)
    job = job_transition(job=job, to=S.RESIZING, reason=decision.reason, now=now,
                         extra={"code": decision.code, "from_devices": from_devices,
                                "to_devices": len(devices), "released_devices": dropped, "nodes": to_nodes,
                                "across_hosts": across_hosts, "relaunch": relaunch})
    from_generation = job.generation
    if relaunch:
        job_generation_bump(job)  # the new copy; the old one is fenced once the move is over
    rows = _place_replicas(job=job, device_ids=devices)
    Job.objects.filter(pk=job.pk).update(device_count=len(devices))
    move_create(job=job, kind=Move.Kind.RESIZE, reason=decision.reason, now=now,
                from_node_id=from_node, to_node_id=_rank0_node(job.pk), from_devices=from_devices,
                to_devices=len(devices), from_generation=from_generation, to_generation=job.generation,
                from_nodes=from_nodes if relaunch else ())
    return "resize", rows + 4


# Start is not here: plan_apply applies all of a plan's starts at once (_start_many).
APPLIERS: dict[type, Callable[..., Applied]] = {
    scheduler.Preempt: _preempt_apply,
    scheduler.Migrate: _migrate_apply,
    scheduler.Resize: _resize_apply,
}


# --- the writes behind them ----------------------------------------------------------------------


# rank_layout's rule (scheduler.rank_layout) as device positions, one tuple per (W, d): a placement
# tick lays out ~30k jobs of a handful of shapes. An illegal shape raises each time (not cached).
_rank_devices = functools.lru_cache(maxsize=1024)(rank_devices)


def _accelerators_by_host(index: SnapshotIndex, devices) -> list[int]:
    """Returns the Accelerator pks of the snapshot's `devices`, each host's together (by Node.pk,
    then Accelerator.pk). Ranks go to them in this order in blocks (rank_layout), and a job spanning
    hosts runs one contiguous block of ranks per host (runtime/multihost.py host_block): a host whose
    accelerator pks interleave with another's (devices registered after another node's) would
    otherwise get two blocks, and the job would fail by name at its launch."""
    if len(devices) == 1:  # most jobs: a placement tick lays out ~30k
        return [int(index.accelerator_ids[devices[0]])]
    devices = np.asarray(devices, np.int64)
    order = np.lexsort((index.accelerator_ids[devices], index.accelerator_node_ids[devices]))
    return [int(x) for x in index.accelerator_ids[devices[order]]]


def _place_replicas(*, job: Job, device_ids: list[int]) -> int:
    """Points the job's W replicas at `device_ids` (accelerator pks) by rank_layout; returns rows written."""
    layout = scheduler.rank_layout(device_ids, job.world_size)
    replicas = list(Replica.objects.filter(job_id=job.pk).order_by("rank"))
    for replica in replicas:
        replica.device_id = layout[replica.rank]
    Replica.objects.bulk_update(replicas, ["device"], batch_size=1000)
    return len(replicas)


def _device_ids_held(job_id: int) -> list[int]:
    """Returns the Accelerator pks the job's replicas point at now, ascending."""
    return sorted(set(Replica.objects.filter(job_id=job_id, device__isnull=False).values_list("device_id", flat=True)))


def _nodes_of(index: SnapshotIndex, devices: tuple) -> list[str]:
    """Returns the hostnames of the nodes holding snapshot devices `devices`."""
    return _hostnames(index, _node_ids_of(index, devices))


def _hostnames(index: SnapshotIndex, node_ids: list[int]) -> list[str]:
    """Returns the hostnames of Node.pks `node_ids`, sorted."""
    return sorted(index.hostnames[node_id] for node_id in node_ids)


def _node_ids_of(index: SnapshotIndex, devices: tuple) -> list[int]:
    """Returns the Node.pks of the nodes holding snapshot devices `devices`, ascending (as
    _node_ids_held lists the nodes a job holds)."""
    return sorted({int(index.accelerator_node_ids[d]) for d in devices})


def _node_ids_held(job_id: int) -> list[int]:
    """Returns the Node.pks the job's replicas lie on (several: a job that spans hosts)."""
    return sorted(set(Replica.objects.filter(job_id=job_id, device__isnull=False)
                      .values_list("device__node_id", flat=True)))


def _rank0_node(job_id: int) -> int | None:
    """Returns the Node.pk holding rank 0 of the job (where its launcher runs), or None."""
    return Replica.objects.filter(job_id=job_id, rank=0).values_list("device__node_id", flat=True).first()


def _preempt(*, job: Job, decision: scheduler.Preempt, now: datetime) -> int:
    if job.state == S.SCHEDULED:
        job_generation_bump(job)  # its copy, if launched meanwhile, is fenced off
        job_transition(job=job, to=S.PENDING, reason=decision.reason, now=now, extra={"code": decision.code})
        return 2
    if decision.code == REASON_LOST_REQUEUED:
        # Its processes died with the node (or are cut off with it: fenced by the new generation):
        # nothing to checkpoint; it resumes from the last one.
        job_generation_bump(job)
        job_transition(job=job, to=S.PREEMPTED, reason=decision.reason, now=now, extra={"code": decision.code})
        return 2
    from_node, from_nodes = _rank0_node(job.pk), _node_ids_held(job.pk)
    job = job_transition(job=job, to=S.PREEMPTING, reason=decision.reason, now=now,
                         extra={"code": decision.code, "released_devices": _device_ids_held(job.pk)})
    released = Replica.objects.filter(job_id=job.pk, device__isnull=False).update(device=None)
    Job.objects.filter(pk=job.pk).update(device_count=0)
    job_event_add(job=job, type=JobEvent.Type.RELEASED, reason=decision.reason,
                  extra={"replicas": released, "checkpoint": "the agent stops it at a consistent cut"})
    move_create(job=job, kind=Move.Kind.PREEMPTION, reason=decision.reason, now=now, from_node_id=from_node,
                from_devices=job.device_count, from_nodes=from_nodes)
    return released + 4


def _migrate(*, job: Job, decision: scheduler.Migrate, devices: list[int], region: int, nodes: list[str],
             now: datetime) -> int:
    from_node, from_nodes = _rank0_node(job.pk), _node_ids_held(job.pk)
    from_generation = job.generation
    if job.state == S.SCHEDULED:
        job_transition(job=job, to=S.PENDING, reason=decision.reason, now=now)
        job = job_transition(job=job, to=S.SCHEDULED, reason=decision.reason, now=now)
    else:
        old_devices = set(_device_ids_held(job.pk))
        job = job_transition(job=job, to=S.MIGRATING, reason=decision.reason, now=now,
                             extra={"code": decision.code, "from_checkpoint": decision.from_checkpoint,
                                    "released_devices": sorted(old_devices - set(devices))})
    # A partial move: the hosts it keeps (both source and destination of the move). Their devices
    # stay the job's throughout (never free to another job); the new generation fences the old
    # copy there too, which their agent stops before it runs the new one.
    from_devices = job.device_count
    job_generation_bump(job)  # the copy on the new devices
    rows = _place_replicas(job=job, device_ids=devices)
    Job.objects.filter(pk=job.pk).update(device_count=len(devices), region_id=region)
    kept = sorted(set(Replica.objects.filter(job_id=job.pk, device__node_id__in=from_nodes).values_list(
        "device__node__hostname", flat=True))) if decision.kept else []
    job_event_add(job=job, type=JobEvent.Type.MIGRATED, reason=decision.reason,
                  extra={"devices": devices, "nodes": nodes, "from_checkpoint": decision.from_checkpoint,
                         "restart_step": decision.restart_step, "generation": job.generation,
                         "partial": bool(kept), "kept_nodes": kept, "kept_devices": decision.kept})
    if job.state == S.MIGRATING:
        common = dict(job=job, kind=Move.Kind.MIGRATION, reason=decision.reason, now=now, from_node_id=from_node,
                      to_node_id=_rank0_node(job.pk), from_generation=from_generation,
                      to_generation=job.generation, from_devices=from_devices, to_devices=len(devices),
                      from_nodes=from_nodes)
        if kept:  # said in the move's reason: a partial move relaunches every rank all the same
            common["reason"] = (f"{decision.reason}; partial: keeps its devices on {', '.join(kept)}, every rank "
                                f"(theirs too) relaunched as generation {job.generation}, no in-place re-splice")
        if decision.from_checkpoint:
            # Its old processes are gone, or cut off with their node: nothing to cut; the new node
            # restores the last checkpoint right away. No from_node: the old copy is not part of the
            # move, so its reports (generation from_generation) are rejected and it is fenced.
            common["from_node_id"] = None
            move_create(**common, first_step=Move.Step.RESTORE, cut_step=job.last_checkpoint_step,
                        note=f"barrier, checkpoint, store skipped: restarting from checkpoint step "
                             f"{job.last_checkpoint_step} (the old copy's node is lost)")
        else:
            move_create(**common)
    return rows + 5


def _write_waiting(*, plan: scheduler.Plan) -> int:
    """Writes wait_reason / queue_position of every waiting job; clears them on the others."""
    waiting = {w.job_id: w for w in plan.waiting}
    changed = []
    for job in Job.objects.filter(state__in=WAITING_STATES).only("id", "wait_reason", "queue_position"):
        w = waiting.get(job.pk)
        reason, place = (w.reason[:500], w.place) if w else ("", None)
        if job.wait_reason != reason or job.queue_position != place:
            job.wait_reason, job.queue_position = reason, place
            changed.append(job)
    if changed:
        Job.objects.bulk_update(changed, ["wait_reason", "queue_position"], batch_size=1000)
    return len(changed)


def _start_many(*, index: SnapshotIndex, starts: list[scheduler.Start], now: datetime) -> tuple[int, int]:
    """Applies Start decisions in bulk: waiting -> scheduled (jobs_transition_bulk), replicas laid
    out, PLACED events written with the transitions' events.

    Returns (jobs started, rows written), in a constant number of statements per batch (a per-job
    path costs ~10 queries per job). A job no longer waiting (a cancel won the race) is left out.
    """
    if not starts:
        return 0, 0
    snap = index.snapshot
    by_id = {d.job_id: d for d in starts}
    # Lock the rows, then keep only jobs still waiting (a cancel may have won the race).
    # As values, made instances by instances_loaded: from_db's own instances cost ~1 s at 30k starts.
    fields = ("id", "team_id", "world_size", "device_count", "region_id", "last_checkpoint_step", "progress_step",
              "state")
    jobs = instances_loaded(Job, fields, Job.objects.select_for_update()
                            .filter(pk__any_of=list(by_id), state__in=WAITING_STATES).values_list(*fields))
    if not jobs:
        return 0, 0
    ready = [job.pk for job in jobs]
    # Each rank's replica row, named by (job, rank): its new device (rank_layout's rule).
    replica_jobs, replica_ranks, replica_devices = [], [], []
    placed_events, placed_nodes = [], {}
    for job in jobs:
        decision = by_id[job.pk]
        devices = _accelerators_by_host(index, decision.devices)
        replica_jobs.extend([job.pk] * job.world_size)
        replica_ranks.extend(range(job.world_size))
        replica_devices.extend([devices[k] for k in _rank_devices(job.world_size, len(devices))])
        # set before the transition: its live push carries the new placement
        job.device_count = len(devices)
        job.region_id = index.region_ids[int(snap.accelerators.region[decision.devices[0]])]
        node_ids = _node_ids_of(index, decision.devices)
        placed_nodes[job.pk] = set(node_ids)
        placed = {"devices": devices, "nodes": _hostnames(index, node_ids),
                  "resume_step": job.last_checkpoint_step}
        if decision.starts_at is not None and decision.starts_at > snap.now:
            # a previous holder is still stopping on some of these devices; the node's agent
            # launches this job once that stop finished
            placed["starts_at"] = datetime.fromtimestamp(decision.starts_at, tz=dt_timezone.utc).isoformat()
            placed["starts_in_seconds"] = round(decision.starts_at - snap.now, 1)
        placed_events.append(EventRow(job_id=job.pk, type=JobEvent.Type.PLACED, reason=decision.reason,
                                      created_at=now, extra_data=placed))
    # The placement goes in with the state change, one UPDATE per job row. A new placement is a
    # new generation: reports of any older copy are fenced off.
    placement = RowWrites(set_sql="device_count = v.c1, region_id = v.c2, generation = generation + 1",
                          columns=[[job.device_count for job in jobs], [job.region_id for job in jobs]],
                          types=("integer", "bigint"))
    jobs_transition_bulk(jobs=jobs, to=S.SCHEDULED, now=now, events=placed_events,
                         reasons={job_id: d.reason for job_id, d in by_id.items()},
                         extras={job_id: {"code": d.code} for job_id, d in by_id.items()},
                         publish_max=LIVE_PUSH_MAX_STARTS, row_writes=placement, nodes=placed_nodes)
    # Keyed by (job, rank), the replica_rank_unique key: reading the ~110k replica ids first (a
    # placement tick at 100k accelerators) cost a query and their Python objects for nothing.
    replicas = rows_update(Replica._meta.db_table, set_sql="device_id = v.c1, updated_at = %s",
                           keys={"job_id": replica_jobs, "rank": replica_ranks}, columns=[replica_devices],
                           types=("bigint",), params=[now])
    return len(jobs), len(ready) * 2 + replicas + len(jobs)


