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
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from fleet.leases import nodes_alive_by_lease
from fleet.live import pushes_batched
from fleet.models import Accelerator, Node
from fleet.services import nodes_heartbeat_record
from jobs.logs import log_grant
from jobs.models import Bundle, Checkpoint, Job, JobEvent, Move, Replica
from jobs.moves import move_end, move_observe, move_relaunches
from jobs.services import (
    CheckpointNew,
    IllegalTransition,
    checkpoints_of_refused_run_retire,
    checkpoints_record,
    job_event_add,
    job_generation_bump,
    job_transition,
)
from protocol.launch import left_out_lines
from protocol.node import (
    SHA256_HEX,
    DesiredJob,
    DesiredState,
    Heartbeat,
    JobReport,
    JobSpan,
    Rejection,
    ReportOutcome,
    RestoreReport,
    Telemetry,
    checkpoint_uri_problem,
)
from protocol.states import LIVE_COPY_STATES, CopyState, DesiredAction, JobNetwork, JobState, ResumeRefused

logger = logging.getLogger(__name__)
S = Job.State

DESIRED_STATES = (S.SCHEDULED, S.RUNNING, S.MIGRATING, S.RESIZING)
MOVING_STATES = (S.PREEMPTING, S.MIGRATING, S.RESIZING)
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


def job_workspace_fields(job, *, bundle_sha256=None) -> dict:
    """The desired entry's bundle digest (`bundle_sha256` when the caller read it, else job.bundle's),
    outputs folder and workspace quota (jobs/bundles.py)."""
    from jobs.bundles import job_outputs_uri
    if bundle_sha256 is None and job.bundle_id:
        bundle_sha256 = job.bundle.sha256
    return {"bundle": bundle_sha256, "outputs": job_outputs_uri(job.pk),
            "workspace_quota_bytes": settings.MERIDIAN_WORKSPACE_QUOTA_BYTES or None}



def node_desired_state_build(*, node) -> DesiredState:
    """Returns what `node`'s agent should run now.

    One entry per job with replicas on this node's devices: action "run" (launch, restore, or
    resize to `devices`, on the node-local devices `device_indices`) or "wait" (a migration, or a
    resize across hosts, that has not reached its restore step), with the generation's own `store` folder and
    `restore_from`, the newest checkpoint the control plane accepted (the agent seeds the new
    store with it; None: start afresh) with `restore_sha256`, the digest of its MANIFEST.json
    recorded when it was reported (None for a checkpoint recorded without one: the agent refuses
    to restore it), plus one entry with action "stop" per job whose active
    move takes its old copy off this node. Every entry has the placement `generation` the agent
    must run (or stop), a run entry the job's `if_resume_refused` (meridian-run's
    --if-resume-refused) and its `network` (isolated or host: the agent's SandboxSpec.network).
    A job the agent runs that is not listed must be stopped with a checkpoint. Three queries.
    """
    devices, spans = _replicas_here_and_spans(node.pk)
    # Raw statements (the ORM's converters still apply): compiling the ORM's took ~60% of a rebuild's CPU.
    job_ids = sorted(devices)
    if job_ids:
        moves_sql = _select_rows(Move) + f" WHERE (job_id IN ({_marks(job_ids)}) OR from_node_id = %s) AND state = %s"
    else:
        moves_sql = _select_rows(Move) + " WHERE from_node_id = %s AND state = %s"
    moves = {m.job_id: m for m in Move.objects.raw(moves_sql, [*job_ids, node.pk, str(Move.State.ACTIVE)])}
    jobs = Job.objects.raw(_DESIRED_JOBS_SQL.format(marks=_marks(job_ids)), job_ids) if job_ids else ()
    entries = []
    for job in jobs:
        move = moves.get(job.pk)
        # A migration's new copy, or a resize's across hosts (a relaunch), starts once the old copy's
        # checkpoint is stored: until then it waits, and the old one is told to stop.
        relaunching = job.state == S.MIGRATING or (job.state == S.RESIZING and move is not None
                                                   and move_relaunches(move))
        waiting = relaunching and not (move and move.step in RESTORE_STEPS)
        entries.append(DesiredJob(
            job_id=job.pk, name=job.name, tier=job.tier, state=JobState(job.state),
            action=DesiredAction.WAIT if waiting else DesiredAction.RUN, generation=job.generation,
            world_size=job.world_size, devices=len(devices[job.pk]),
            device_indices=tuple(sorted(devices[job.pk])), entrypoint=job.entrypoint,
            args=tuple(job.args), env=dict(job.env),
            store=job_store_uri(job.pk, generation=job.generation), restore_from=job.restore_from,
            restore_sha256=job.restore_sha256 if re.fullmatch(SHA256_HEX, job.restore_sha256 or "") else None,
            last_checkpoint_step=job.last_checkpoint_step,
            span=_span_for(spans.get(job.pk), node_id=node.pk, job_id=job.pk, generation=job.generation,
                           world_size=job.world_size),
            if_resume_refused=ResumeRefused(job.if_resume_refused), network=JobNetwork(job.network),
            log_grant=log_grant(job_id=job.pk, generation=job.generation, node_id=node.pk),
            **job_workspace_fields(job, bundle_sha256=job.bundle_sha256),
        ))
    listed = {e.job_id for e in entries}
    for move in moves.values():
        if (move.from_node_id == node.pk and (move.kind != Move.Kind.RESIZE or move_relaunches(move))
                and move.step in STOP_STEPS
                and move.job_id not in listed):
            entries.append(DesiredJob(job_id=move.job_id, action=DesiredAction.STOP,
                                      generation=move.from_generation, move=str(move.kind),
                                      move_step=str(move.step)))
    return DesiredState(node_id=node.pk, hostname=node.hostname, state=str(node.state),
                        lost_after_seconds=node_lost_after_seconds(), jobs=tuple(entries))


_R, _A, _N, _J = (model._meta.db_table for model in (Replica, Accelerator, Node, Job))
# Every placed replica of the jobs in a desired state with a replica on the node (%s), with its
# device's node, index and hostname: the node's own devices and the jobs' spans from one read.
_REPLICAS_OF_JOBS_HERE_SQL = (
    f"SELECT r.job_id, r.rank, r.device_id, a.node_id, a.{connection.ops.quote_name('index')}, n.hostname "
    f"FROM {_R} r JOIN {_A} a ON a.id = r.device_id JOIN {_N} n ON n.id = a.node_id "
    f"WHERE r.job_id IN (SELECT r2.job_id FROM {_R} r2 JOIN {_A} a2 ON a2.id = r2.device_id "
    f"JOIN {_J} j ON j.id = r2.job_id WHERE a2.node_id = %s AND j.state IN ({', '.join(['%s'] * len(DESIRED_STATES))}))"
)


def _replicas_here_and_spans(node_id) -> tuple[dict[int, set[int]], dict[int, list[tuple[int, int, int, str, int]]]]:
    """Returns ({job id: the node-local indices of the devices it holds on node `node_id`} of the
    jobs in a desired state there, {job id: [(first rank, ranks, node id, hostname, devices), ...]
    in rank order} of those whose replicas lie on more than one node). One query."""
    devices = defaultdict(set)
    # job id -> node id -> [first rank, ranks, {devices}, hostname]
    shares: dict[int, dict[int, list]] = defaultdict(dict)
    with connection.cursor() as cursor:
        cursor.execute(_REPLICAS_OF_JOBS_HERE_SQL, [node_id, *(str(state) for state in DESIRED_STATES)])
        for job_id, rank, device_id, on_node, index, hostname in cursor.fetchall():
            if on_node == node_id:
                devices[job_id].add(index)
            share = shares[job_id].get(on_node)
            if share is None:
                shares[job_id][on_node] = [rank, 1, {device_id}, hostname]
            else:
                share[0] = min(share[0], rank)
                share[1] += 1
                share[2].add(device_id)
    spans = {job_id: sorted((first, ranks, on_node, hostname, len(on_devices))
                            for on_node, (first, ranks, on_devices, hostname) in per_node.items())
             for job_id, per_node in shares.items() if len(per_node) > 1}
    return devices, spans


def _span_for(shares, *, node_id, job_id, generation, world_size) -> JobSpan | None:
    """Returns this node's JobSpan of a job that spans hosts (None: it runs on one host): its
    block of ranks (W/d per device it holds, so hosts holding unequal device counts get unequal
    blocks: its launcher runs exactly that block, meridian-run --first-rank/--host-ranks). A share
    that cannot run still gets its span: the agent refuses it by name (agent/node.py
    multihost_span_problem), and blocks that do not tile the ranks are refused by the job's
    leader (runtime/multihost.py blocks_problem), so the job fails saying why, never runs wrong."""
    if not shares:
        return None
    node_rank = next(i for i, share in enumerate(shares) if share[2] == node_id)
    first, ranks, _node, _hostname, _devices = shares[node_rank]
    return JobSpan(nodes=len(shares), node_rank=node_rank, first_rank=first, ranks=ranks,
                   job_devices=sum(share[4] for share in shares), leader=shares[0][3],
                   rendezvous=f"{job_store_uri(job_id, generation=generation)}/rendezvous")


def node_desired_state(*, node) -> dict:
    """Returns node_desired_state_build(node=node) as its wire dict (what GET desired/ answers)."""
    return node_desired_state_build(node=node).to_dict()


# --- observed state -----------------------------------------------------------------------------


def _marks(values) -> str:
    return ", ".join(["%s"] * len(values))


def _select_rows(model) -> str:
    """SELECT of every column of `model`'s table (for Model.objects.raw)."""
    columns = ", ".join(connection.ops.quote_name(field.column) for field in model._meta.concrete_fields)
    return f"SELECT {columns} FROM {model._meta.db_table}"


_JOBS_SQL = _select_rows(Job) + " WHERE id IN ({marks})"
_C, _B = Checkpoint._meta.db_table, Bundle._meta.db_table
# The jobs of a desired state with their bundle's digest and their newest live checkpoint's uri and
# digest (the checkpoint the agent restores: highest step, of equal steps the newest row).
_NEWEST_CHECKPOINT = (f"FROM {_C} c WHERE c.job_id = j.id AND c.retired_at IS NULL "
                      f"ORDER BY c.step DESC, c.id DESC LIMIT 1")
_DESIRED_JOBS_SQL = (
    "SELECT " + ", ".join(f"j.{connection.ops.quote_name(f.column)}" for f in Job._meta.concrete_fields)
    + f", b.sha256 AS bundle_sha256, (SELECT c.uri {_NEWEST_CHECKPOINT}) AS restore_from, "
    f"(SELECT c.sha256 {_NEWEST_CHECKPOINT}) AS restore_sha256 "
    f"FROM {_J} j LEFT JOIN {_B} b ON b.id = j.bundle_id WHERE j.id IN ({{marks}}) ORDER BY j.id"
)
_MOVES_SQL = _select_rows(Move) + " WHERE job_id IN ({marks}) AND state = %s"


def _placements_of(node_ids, job_ids) -> tuple[set[tuple[int, int]], dict[int, int]]:
    """Returns ({(job id, node id)} of those of `job_ids` with a replica on the devices of one of
    `node_ids`, {job id: the node of its rank 0}) in one query: the rows of those nodes' own
    replicas and of every rank 0."""
    placed, leaders = set(), {}
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT r.job_id, r.rank, a.node_id FROM {_R} r JOIN {_A} a ON a.id = r.device_id "
                       f"WHERE r.job_id IN ({_marks(job_ids)}) AND (a.node_id IN ({_marks(node_ids)}) OR r.rank = 0)",
                       [*job_ids, *node_ids])
        rows = cursor.fetchall()
    wanted = set(node_ids)
    for job_id, rank, device_node in rows:
        if device_node in wanted:
            placed.add((job_id, device_node))
        if rank == 0:
            leaders[job_id] = device_node
    return placed, leaders


def _progress_write(progress: dict[int, tuple[float | None, int | None]]) -> None:
    """Writes the reported progress of several jobs in one UPDATE ... FROM (VALUES ...): {job id:
    (steps per second, progress step, or None to keep the recorded one)}. The CASTs type the VALUES
    list (PostgreSQL reads bare parameters as text)."""
    if not progress:
        return
    table = Job._meta.db_table
    values = ", ".join(["(CAST(%s AS BIGINT), CAST(%s AS DOUBLE PRECISION), CAST(%s AS BIGINT))"] * len(progress))
    params = [x for job_id, (rate, step) in progress.items() for x in (job_id, rate, step)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH progress(id, rate, step) AS (VALUES {values}) "
            f"UPDATE {table} SET steps_per_second = progress.rate, "
            f"progress_step = COALESCE(progress.step, {table}.progress_step) "
            f"FROM progress WHERE {table}.id = progress.id", params)


def node_report_apply(*, node, report: Heartbeat | dict, now=None) -> dict:
    """Applies one agent report (node_report_record); returns its ReportOutcome as a wire dict
    ({"accepted", "rejected", "deferred"}). `report` is a Heartbeat or its wire dict, decoded
    here (a malformed one raises protocol.ProtocolError, naming the field)."""
    heartbeat = report if isinstance(report, Heartbeat) else Heartbeat.from_dict(report)
    return node_report_record(node=node, heartbeat=heartbeat, now=now).to_dict()


def _telemetry_dict(telemetry: Telemetry | None) -> dict:
    """Returns the telemetry as fleet.services.nodes_heartbeat_record reads it: no "utilization"
    key when the node did not say (its last reading stays)."""
    if telemetry is None:
        return {}
    readings = {"devices": [{"index": device.index, "utilization": device.utilization,
                             "memory_used_gb": device.memory_used_gb} for device in telemetry.devices]}
    if telemetry.utilization is not None:
        readings["utilization"] = telemetry.utilization
    return readings


NOT_YOURS = ("this node holds no copy of job {job_id} that the control plane knows of; "
             "kill it without a checkpoint")


def _not_yours(job_id) -> Rejection:
    """The one rejection of a report on a job this node does not hold: the same words whether the
    job exists, runs elsewhere, ended or never was, so a node learns nothing of others' jobs."""
    return Rejection(job_id=job_id, fence=True, error=NOT_YOURS.format(job_id=job_id))


def _last_placed_on(job, node, *, types=(JobEvent.Type.PLACED,)) -> bool:
    """True when the job's newest placement (its newest event of `types`: PLACED by default) named
    `node`: the one node that may hear that the job it ran was cancelled."""
    placed = (JobEvent.objects.filter(job_id=job.pk, type__in=types).order_by("-created_at", "-id")
              .values_list("extra_data", flat=True).first())
    return isinstance(placed, dict) and node.hostname in (placed.get("nodes") or [])


def _final_report_repeated(*, job, node, generation, entry: JobReport) -> bool:
    """True when `entry` repeats the final report that ended `job`: the job ended as the copy says
    (finished -> succeeded, failed -> failed), at the generation reported, whose placement (its
    newest PLACED or MIGRATED event) named `node`; or it is the old copy of a move that took it
    off `node` (a follower host's share of a job that finished before a resize's cut across hosts,
    reported after the move ended). Such a report is accepted and records nothing."""
    ended_as = {CopyState.FINISHED: S.SUCCEEDED, CopyState.FAILED: S.FAILED}.get(entry.state)
    if ended_as is None or job.state != ended_as:
        return False
    if generation != job.generation:
        return (job.pk, generation) in Move.copies_taken_off(node_id=node.pk, job_ids=[job.pk],
                                                             generations=[generation])
    return _last_placed_on(job, node, types=(JobEvent.Type.PLACED, JobEvent.Type.MIGRATED))


def _checkpoint_problem(*, job, generation, entry: JobReport):
    """Returns None when the report's checkpoint (if any) may be recorded for the copy of `job`
    at `generation`, else (field, problem): the checkpoint lies in that generation's own store
    folder and carries the sha256 of its manifest."""
    checkpoint = entry.checkpoint
    if checkpoint is None or not checkpoint.uri or checkpoint.step is None:
        return None
    problem = checkpoint_uri_problem(checkpoint.uri, store=job_store_uri(job.pk, generation=generation))
    if problem:
        return "checkpoint.uri", problem
    if not checkpoint.sha256:
        return "checkpoint.sha256", ("is required: the sha256 of the checkpoint's MANIFEST.json, which every "
                                     "restore checks; upgrade the agent")
    return None


def node_report_record(*, node, heartbeat: Heartbeat, now=None) -> ReportOutcome:
    """Applies one agent report (heartbeat, telemetry, observed jobs); returns what became of each
    job report: accepted, rejected (with why) or deferred.

    A node may report only on a copy it holds: the job's current placement generation on its own
    devices, or the old copy an active move takes off it (the move's from_generation). Any other
    report (a job placed elsewhere, one that ended, one that does not exist) is rejected with
    "fence": true and the same words whatever the reason (NOT_YOURS), and changes nothing; only
    the node of the job's newest placement hears "cancel": true for a running copy of a job that
    was cancelled (the agent kills it and removes its store), and that node's report that the copy
ended is accepted (recording nothing). A final report repeated after the job ended on it (the
    first answer was lost) is accepted too, recording nothing, so the agent removes the store.
    A report of the held job naming another generation is rejected with "fence". A checkpoint
    outside the copy's own store folder (<root>/job-<id>/g<generation>), or without its manifest's
    sha256, is rejected naming the field, and nothing of that report is recorded. A finished
    report of a job still in the middle of a migration is deferred (neither accepted nor
    rejected: the agent reports it again).
    Idempotent: a repeated report is a no-op.
    """
    return node_reports_record(beats=[NodeBeat(node=node, heartbeat=heartbeat, now=now or timezone.now())])[0]


@dataclass(frozen=True)
class NodeBeat:
    """One heartbeat to record: the node it came from (authenticated), its report, when it was received."""

    node: Node
    heartbeat: Heartbeat
    now: datetime


def node_reports_record(*, beats: Sequence[NodeBeat]) -> list[ReportOutcome]:
    """Records several nodes' heartbeats at once, each as node_report_record records one (the same
    rules, fencing included); returns their ReportOutcomes in order. The heartbeat folder
    (jobs/heartbeat_fold.py) calls it with a batch of queued heartbeats; node_report_record with one.

    The reads (jobs, placements, moves, recorded checkpoints) and the writes of progress and new
    checkpoints are one statement each for the whole batch, so each heartbeat must be judged on
    the database as it was before the batch: no two beats may come from the same node or report
    on the same job (ValueError; the folder puts such beats in later batches, in their order).
    One transaction: a failure records nothing of any beat.
    """
    nodes, reported = set(), set()
    for beat in beats:
        ids = {entry.job_id for entry in beat.heartbeat.jobs}
        if beat.node.pk in nodes or ids & reported:
            raise ValueError("node_reports_record: two beats of one node, or two reports on one job, in one batch")
        nodes.add(beat.node.pk)
        reported |= ids
    outcomes = [(beat, [], [], []) for beat in beats]  # (beat, accepted, rejected, deferred)
    # The page pushes of its commit in one hop (when this is the outermost transaction).
    with pushes_batched(), transaction.atomic():
        if connection.vendor == "postgresql":
            # A heartbeat lost in a database crash is repeated by the next one (level-triggered):
            # no need to wait for its WAL flush (the biggest cost of a heartbeat at scale).
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit = off")
        nodes_heartbeat_record(beats=[(beat.node, _telemetry_dict(beat.heartbeat.telemetry), beat.now)
                                      for beat in beats])
        reporting = [o for o in outcomes if o[0].heartbeat.jobs]
        if not reporting:  # telemetry only: nothing more to read or write
            return [ReportOutcome() for _ in beats]
        ids = sorted(reported)
        # Raw queries (the ORM's converters still apply): compiling them cost more CPU than running them.
        jobs = {job.pk: job for job in Job.objects.raw(_JOBS_SQL.format(marks=_marks(ids)), ids)}
        # Where rank 0 of each job lies: the leader of a job that spans hosts speaks for all of it.
        placed, leaders = _placements_of(sorted({o[0].node.pk for o in reporting}), ids)
        moves = {m.job_id: m for m in Move.objects.raw(_MOVES_SQL.format(marks=_marks(ids)),
                                                       [*ids, str(Move.State.ACTIVE)])}
        # The reports that are applied (below), with their jobs and moves: the progress of them all
        # is written first, in one statement, then each one's checkpoint and state.
        applying = []
        for beat, accepted, rejected, deferred in reporting:
            node, now = beat.node, beat.now
            for entry in beat.heartbeat.jobs:
                job = jobs.get(entry.job_id)
                if job is None:
                    rejected.append(_not_yours(entry.job_id))
                    continue
                here = (job.pk, node.pk) in placed
                move = moves.get(job.pk)
                old_node = move is not None and move.ran_old_copy_on(node.pk)
                if entry.generation is None:  # an agent that does not say (hollow nodes, older agents)
                    generation = move.from_generation if old_node and not here else job.generation
                else:
                    generation = entry.generation
                old_copy = old_node and generation == move.from_generation
                current = here and generation == job.generation
                if not (current or old_copy):
                    if here:  # the node holds the job, but runs a copy of another generation
                        rejected.append(Rejection(job_id=job.pk, fence=True,
                                                  error=f"stale copy: generation {generation}, the job now runs as "
                                                        f"generation {job.generation}; kill it without a checkpoint"))
                    elif job.state == S.CANCELLED and _last_placed_on(job, node):
                        if entry.state in LIVE_COPY_STATES:
                            rejected.append(Rejection(job_id=job.pk, cancel=True,
                                                      error="the job was cancelled; kill it without a checkpoint"))
                        else:  # its copy here ended: nothing to kill, nothing recorded
                            accepted.append(job.pk)
                    elif _final_report_repeated(job=job, node=node, generation=generation, entry=entry):
                        # The answer to its first final report was lost (found by the chaos soak: a
                        # partition cut the connection after the commit). Fenced, the agent would keep
                        # the finished job's checkpoint store for ever; accepted, it removes it.
                        accepted.append(job.pk)
                    else:
                        rejected.append(_not_yours(job.pk))
                    continue
                problem = _checkpoint_problem(job=job, generation=generation, entry=entry)
                if problem is not None:
                    field, why = problem
                    rejected.append(Rejection(job_id=job.pk,
                                              error=f"{field}: {why}; nothing of this report was recorded"))
                    continue
                leader = leaders.get(job.pk) in (None, node.pk)
                if current and not leader:
                    # A follower host of a job that spans hosts: its copy's state is the leader's to
                    # report (the leader ends when any host fails); its own step is not the job's.
                    accepted.append(job.pk)
                    continue
                if current and entry.state == CopyState.FAILED and _a_host_is_silent(job, node, now=now):
                    # Most likely the leader failed because a host of the job went silent: the lost-node
                    # sweep restarts the job from its last checkpoint; the report waits until then.
                    deferred.append(job.pk)
                    continue
                applying.append((job, entry, current, move, generation, beat, accepted, deferred))
        _progress_write({job.pk: _progress_of(job, entry) for job, entry, current, *_ in applying
                         if current and entry.step is not None})
        checkpointed = _checkpoints_recorded(
            {(job.pk, entry.checkpoint.uri) for job, entry, *_ in applying if _checkpoint_reported(entry)})
        # The new checkpoints of all reports at once (each job instance refreshed), before any state
        # changes, as one report at a time records its checkpoint first. Stamped with the newest
        # beat's time (one statement writes them all).
        new = {}
        for job, entry, *_ in applying:
            if _checkpoint_reported(entry) and (job.pk, entry.checkpoint.uri) not in checkpointed:
                new.setdefault((job.pk, entry.checkpoint.uri), _checkpoint_new(job, entry))
        if new:
            checkpoints_record(checkpoints=list(new.values()), now=max(beat.now for beat in beats))
        checkpointed |= new.keys()
        restored = _restores_recorded({(job.pk, job.generation) for job, entry, current, *_ in applying
                                       if current and entry.restore is not None})
        for job, entry, current, move, generation, beat, accepted, deferred in applying:
            if current and entry.restore is not None and (job.pk, job.generation) not in restored:
                _restored_event_add(job=job, restore=entry.restore, node=beat.node)
                restored.add((job.pk, job.generation))
            result = _observed_apply(job=job, entry=entry, current=current, node=beat.node, now=beat.now,
                                     checkpointed=checkpointed)
            if move is not None:
                move_observe(move=move, generation=generation, node=beat.node, entry=entry, now=beat.now)
            (deferred if result == "deferred" else accepted).append(job.pk)
    return [ReportOutcome(accepted=tuple(accepted), rejected=tuple(rejected), deferred=tuple(deferred))
            for _beat, accepted, rejected, deferred in outcomes]


def _progress_of(job, entry: JobReport) -> tuple[float | None, int | None]:
    """Returns (steps per second, progress step or None to keep it) of a report of `job`'s current
    copy: the step moves back only while the copy lives (a restore from an older checkpoint)."""
    keep = not (entry.step >= job.progress_step or entry.state in LIVE_COPY_STATES)
    return entry.steps_per_s, None if keep else entry.step


def _checkpoint_new(job, entry: JobReport) -> CheckpointNew:
    checkpoint = entry.checkpoint
    seconds = checkpoint.seconds
    return CheckpointNew(job=job, step=checkpoint.step, engine=checkpoint.engine or "framework", uri=checkpoint.uri,
                         size_bytes=checkpoint.bytes, sha256=checkpoint.sha256,
                         left_out=left_out_lines(checkpoint.left_out),
                         # the stages the node timed (a GPU job's CUDA moves only where there were some)
                         seconds={k: v for k, v in asdict(seconds).items() if v is not None} if seconds else None,
                         device_bytes=checkpoint.device_bytes)


def _checkpoint_reported(entry: JobReport) -> bool:
    checkpoint = entry.checkpoint
    return checkpoint is not None and bool(checkpoint.uri) and checkpoint.step is not None


def _checkpoints_recorded(pairs: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Returns those of the (job id, uri) `pairs` that are recorded already. One query: agents
    repeat their copies' last checkpoint in every report (level-triggered)."""
    if not pairs:
        return set()
    job_ids, uris = list({job_id for job_id, _ in pairs}), list({uri for _, uri in pairs})
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT job_id, uri FROM {Checkpoint._meta.db_table} "
                       f"WHERE job_id IN ({_marks(job_ids)}) AND uri IN ({_marks(uris)})", [*job_ids, *uris])
        return set(cursor.fetchall()) & pairs


def _restores_recorded(pairs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Returns those of the (job id, generation) `pairs` whose "restored" event is written already.
    One query: agents repeat a copy's restore in every report (level-triggered)."""
    if not pairs:
        return set()
    rows = JobEvent.objects.filter(job_id__in={job_id for job_id, _ in pairs}, type=JobEvent.Type.RESTORED) \
        .values_list("job_id", "extra_data__generation")
    return set(rows) & pairs


def _restored_event_add(*, job, restore: RestoreReport, node):
    """Writes the job's "restored" event for its current generation: from which step, on which host,
    and where the time went, stage by stage with rates (issue 17 §3: the way back of a checkpoint)."""
    engine = f" ({restore.engine} engine)" if restore.engine else ""
    stages = [f"restored on {node.hostname} from step {restore.step}{engine} in {restore.seconds:.2f} s"]
    if restore.device_in is not None:
        stages.append(f"of which the ranks' CUDA state host -> device {restore.device_in:.2f} s")
    if restore.load_s is not None and restore.apply_s is not None:
        to_devices = ""
        if restore.device_bytes:
            gb = restore.device_bytes / 1e9
            rate = f", {gb / restore.apply_s:.2f} GB/s" if restore.apply_s > 0 else ""
            to_devices = f", {gb:.2f} GB to devices{rate}"
        stages.append(f"then the ranks' state store -> host {restore.load_s:.2f} s, into the script's objects "
                      f"{restore.apply_s:.2f} s{to_devices}")
    job_event_add(job=job, type=JobEvent.Type.RESTORED, reason="; ".join(stages)[:500],
                  extra={"node": node.hostname, "generation": job.generation, **restore.to_dict()})


def _a_host_is_silent(job, node, *, now) -> bool:
    """True when another node holding `job`'s replicas is lost or missed heartbeats for a third of
    the lost-node threshold: a job spanning hosts whose leader reports it failed then is most
    likely the victim of that host, not of its own code. One query, and one read of the leases of
    the hosts the database finds silent (a host that only leases is not silent: fleet/leases.py)."""
    cutoff = now - timedelta(seconds=node_lost_after_seconds() / 3)
    suspects = dict(Node.objects.filter(Q(state=Node.State.LOST) | Q(last_heartbeat__lt=cutoff),
                                        accelerators__replicas__job_id=job.pk).exclude(pk=node.pk)
                    .values_list("pk", "state").distinct())
    if any(state == Node.State.LOST for state in suspects.values()):
        return True
    return bool(set(suspects) - nodes_alive_by_lease(node_ids=suspects, cutoff=cutoff))


def _observed_apply(*, job, entry: JobReport, current, node, now, checkpointed=None):
    """Records one accepted report on `job` (but its progress: node_report_record writes the
    progress of all of a heartbeat's reports at once); `current`: it comes from the job's current
    copy on its placed node. `checkpointed`: the (job id, uri) of the reported checkpoints that are
    recorded already (None: looked up here). Returns "deferred" when a final state must wait (see
    node_report_record)."""
    state = entry.state
    checkpoint = entry.checkpoint
    if _checkpoint_reported(entry):
        if checkpointed is None:
            checkpointed = _checkpoints_recorded({(job.pk, checkpoint.uri)})
        if (job.pk, checkpoint.uri) not in checkpointed:
            # checkpoints_record refreshes `job` itself (its last_checkpoint_* moved)
            checkpoints_record(checkpoints=[_checkpoint_new(job, entry)], now=now)
            checkpointed.add((job.pk, checkpoint.uri))  # a report repeated in the same heartbeat
    if not current:
        return None
    _waiting_apply(job=job, entry=entry, node=node)
    _restarted_apply(job=job, entry=entry, node=node)
    try:
        if state == CopyState.RUNNING and job.state == S.SCHEDULED:
            # An unconfined copy (a node that cannot sandbox it) says so in the job's events.
            # So does the checkpoint engine and why it was chosen (a framework fallback names its cause).
            loud = f" ({entry.sandbox})" if entry.sandbox and entry.sandbox.startswith("UNCONFINED") else ""
            engine = f"; {entry.engine} engine: {entry.engine_reason}" if entry.engine and entry.engine_reason else ""
            job_transition(job=job, to=S.RUNNING, reason=f"running on {node.hostname}{loud}{engine}"[:500], now=now,
                           extra={"node": node.hostname, "devices": entry.devices, "sandbox": entry.sandbox,
                                  "engine": entry.engine, "engine_reason": entry.engine_reason})
        elif state == CopyState.FINISHED and job.state == S.MIGRATING:
            return "deferred"  # the move's restore/release steps run first; reported again then
        elif state == CopyState.FINISHED and job.state in (S.SCHEDULED, S.RUNNING, S.RESIZING):
            if job.state == S.SCHEDULED:
                job = job_transition(job=job, to=S.RUNNING, now=now, reason=f"ran on {node.hostname}")
            Job.objects.filter(pk=job.pk).update(exit_code=0)
            # A success the owner should hear about (no optimizer step taken) says so.
            note = f": {entry.note}" if entry.note else ""
            job_transition(job=job, to=S.SUCCEEDED, now=now, reason=f"finished on {node.hostname}{note}"[:500],
                           extra={"step": entry.step, "note": entry.note})
        elif state == CopyState.FAILED and entry.host_failure and job.state in (S.SCHEDULED, S.RUNNING, S.RESIZING):
            _host_failure_requeue(job=job, node=node, entry=entry, now=now)
        elif state == CopyState.FAILED and job.state in (S.SCHEDULED, S.RUNNING, S.RESIZING):
            _job_fail(job=job, exit_code=entry.exit_code, now=now,
                      error=str(entry.error or "the job's launcher failed"))
    except IllegalTransition as exc:
        # The job changed under this report (the tick moved it, a node-lost restart began): the
        # report is heard again at the next beat and judged on the job as it is then. Accepting it
        # here would tell the agent its outcome was taken, and for "finished" the agent removes the
        # job's checkpoint store, which the new generation restores from (found by the chaos soak).
        logger.info("report from %s on job %s: %s; deferred", node.hostname, job.pk, exc)
        return "deferred"
    return None


def _job_fail(*, job, exit_code, error, now):
    """Fails `job` for good, keeping the exit code and the whole error; the event carries its start."""
    Job.objects.filter(pk=job.pk).update(exit_code=exit_code, failure_reason=error[:4000])
    job_transition(job=job, to=S.FAILED, now=now, reason=error[:500])


HOST_FAILURE_CODE = "host failed under the job"
# Restarts from one checkpoint after a host failed under the job before it fails for good: a job
# whose hosts keep failing before it checkpoints again would otherwise go round for ever.
MAX_HOST_FAILURE_RESTARTS = 3


def _host_failure_requeue(*, job, node, entry: JobReport, now):
    """The leader of a job that spans hosts failed because a host of the job failed under it (a
    follower's launcher fenced itself when its agent fell silent, a follower went silent, the
    leader's store was unreachable: JobReport.host_failure), not because of the job's code: the job
    goes back in line (preempted) and resumes from its last checkpoint, as after a lost node; its
    generation is bumped, so what is left of this copy on any host is fenced. After
    MAX_HOST_FAILURE_RESTARTS such restarts from the same checkpoint it fails, saying so.

    In a resize (one that relaunches the job across hosts: its new copy is the one that failed) the
    resize move ends here, failed: the 30-minute chaos soak (session 24) lost a job whose host failed
    under it while it was being grown onto a second host, failed for good as if by its code."""
    error = str(entry.error or "a host of the job failed")
    if job.state == S.RESIZING:
        for move in Move.objects.filter(job=job, state=Move.State.ACTIVE):
            move_end(move=move, job=job, state=Move.State.FAILED, now=now, requeue=False,
                     reason=f"a host of the job failed under it: {error}")
    step = job.last_checkpoint_step or 0
    resume = f"checkpoint step {step}" if job.last_checkpoint_step else "its start (no checkpoint yet)"
    earlier = JobEvent.objects.filter(job=job, type=JobEvent.Type.STATE_CHANGED, to_state=S.PREEMPTED,
                                      extra_data__code=HOST_FAILURE_CODE,
                                      extra_data__checkpoint_step=step).count()
    if earlier >= MAX_HOST_FAILURE_RESTARTS:
        _job_fail(job=job, exit_code=entry.exit_code, now=now, error=(
            f"restarted {earlier} times from {resume} after a host failed under it, and it failed again the "
            f"same way: {error}"))
        return
    job_generation_bump(job)
    job_transition(job=job, to=S.PREEMPTED, now=now,
                   reason=f"a host of the job failed under it ({error}); back in line, resuming from {resume}"[:500],
                   extra={"code": HOST_FAILURE_CODE, "checkpoint_step": step, "node": node.hostname})


def _waiting_apply(*, job, entry: JobReport, node):
    """Shows why the current copy of a placed job has not started yet (the agent is fetching its
    code, say) as the job's wait reason, with an event each time the reason changes; clears it
    once the copy runs."""
    waiting = f"{entry.waiting} on {node.hostname}"[:500] if entry.waiting and entry.state == CopyState.STARTING else ""
    if waiting == job.wait_reason or (not waiting and job.state in Job.WAITING_STATES):
        return
    Job.objects.filter(pk=job.pk).update(wait_reason=waiting)
    job.wait_reason = waiting
    if waiting:
        job_event_add(job=job, type=JobEvent.Type.MESSAGE, reason=waiting, extra={"node": node.hostname,
                                                                                 "waiting": entry.waiting})


def _restarted_apply(*, job, entry: JobReport, node):
    """Records, once per placement generation, that the current copy's launcher started the script
    again from scratch because the framework engine refused its resume (the job asked for that:
    if_resume_refused "restart"): a RESTARTED_FROM_SCRATCH event with the launcher's reason. The
    job's progress starts again from step 0, so its owner must hear of it. The agent says so on
    every report of the copy (level-triggered), hence the look for the event already written: one
    query, made only for such reports.

    In the same transaction the refused run's checkpoints (those outside this copy's own store
    folder) are retired and job.last_checkpoint_step follows the new run: otherwise the next resume
    would be pointed at the refused run's newest checkpoint again (refused again, restarted again,
    the new run's progress lost)."""
    if not entry.restarted:
        return
    if JobEvent.objects.filter(job=job, type=JobEvent.Type.RESTARTED_FROM_SCRATCH,
                               extra_data__generation=job.generation).exists():
        return
    # The launcher's words begin "restarted from scratch ...": the host goes first, the rest as said.
    job_event_add(job=job, type=JobEvent.Type.RESTARTED_FROM_SCRATCH,
                  reason=f"on {node.hostname}: {entry.restarted}"[:500],
                  extra={"node": node.hostname, "generation": job.generation, "restarted": entry.restarted,
                         "step": entry.step})
    checkpoints_of_refused_run_retire(job=job, store=job_store_uri(job.pk, generation=job.generation))


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
    """Deletes Checkpoint rows beyond the newest `keep` live ones per job (retired rows go first);
    returns how many it deleted.

    Agents report a checkpoint every interval for every running job; the store itself keeps only
    the newest few, so older rows point at nothing. (Telemetry needs no pruning: it is stored as
    the latest value per node and device.)
    """
    from django.db.models import Window
    from django.db.models.functions import RowNumber

    # Retired rows (a refused run's, see checkpoints_of_refused_run_retire) rank after every live
    # one: by step alone they would crowd out the new run's lower-step checkpoints it resumes from.
    ranked = Checkpoint.objects.annotate(
        newest=Window(RowNumber(), partition_by=[F("job_id")],
                      order_by=[F("retired_at").asc(nulls_first=True), F("step").desc(), F("id").desc()]))
    deleted = 0
    while True:
        ids = list(ranked.filter(newest__gt=keep).values_list("id", flat=True)[:batch])
        if not ids:
            return deleted
        deleted += Checkpoint.objects.filter(pk__in=ids).delete()[0]
