"""Live logs: storing what agents ship, the markers the control plane writes, and reading them back.

One log per job across every attempt (LogChunk rows in `id` order, which is the API's cursor;
every writer of a job's chunks takes the job's row first, so they commit in id order):
rank output (kind "output", per rank), notes that output was dropped ("dropped", per rank), and
markers ("marker", every rank) written where the job is preempted, moved, resized, restarted
after a lost node, failed or cancelled: `log_marker_for_transition` is called by
jobs.services.job_transition, the one state machine, inside its transaction.

Fencing (the rule of jobs.workflows.node_report_record, applied to logs): a node may ship the
output of a copy of a job when that copy is the job's current one (its placement generation is
the job's) and either the job is placed on that node, or the chunk carries the copy's log grant
(`log_grant`: a keyed digest of job, generation and node that the control plane puts in the node's
desired state for every copy it places there, so only a node that was given the copy holds it:
the tail of a copy that stopped, finished or failed is taken after the control plane released its
devices, even when none of it reached the control plane before, its agent frozen or cut off for
the copy's whole life); or when a move took or takes that copy (the move's from_generation) off
this node, its leader's host or a follower's, while the move runs or after it ended. Anything
else is refused with "fence": the agent stops shipping that copy. Each copy (job, generation) of
a batch is judged on its own: the refused tail of an older copy does not take the current copy's
chunks with it. A chunk sent twice (same copy, rank, stream and offset) is stored once.

Retention: chunks older than MERIDIAN_LOG_RETENTION_DAYS are pruned on write (at most once a
minute per process); a job keeps its newest MERIDIAN_LOG_MAX_CHUNKS_PER_JOB chunks.
"""
from __future__ import annotations

import dataclasses
import re
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.crypto import constant_time_compare, salted_hmac

from fleet.live import events_publish, group_for_job
from jobs.models import Job, LogChunk, Move, Replica
from protocol.logs import MAX_CHUNK_BYTES, LogBatch, LogBatchAnswer, LogRejection

S = Job.State
LIVE_TYPE = "jobs.log_appended"
PRUNE_EVERY_S = 60.0
DEFAULT_PAGE = 200
MAX_PAGE = 1000
_last_prune = [0.0]

# Transitions that get a marker in the log, and what it says (the reason follows).
MARKERS = {
    S.PREEMPTING: "preempting: checkpoint at a consistent cut, then stop",
    S.PREEMPTED: "preempted: waiting for devices; it resumes from its last checkpoint",
    S.MIGRATING: "moving to other devices",
    S.RESIZING: "resizing",
    S.FAILED: "failed",
    S.CANCELLED: "cancelled",
}


def _marker_text(text: str) -> str:
    return f"──── meridian: {text} ────\n"


def log_marker_add(*, job, text, now=None) -> LogChunk:
    """Returns a new marker chunk in `job`'s log (every rank sees it); pushed on commit. Takes the
    job's row first, as log_batch_record does (the caller, job_transition, already holds it): a
    job's chunks commit in id order."""
    with transaction.atomic():
        list(Job.objects.select_for_update().filter(pk=job.pk).values_list("pk", flat=True))
        chunk = LogChunk.objects.create(job_id=job.pk, kind=LogChunk.Kind.MARKER, generation=job.generation,
                                        text=_marker_text(text)[:2000], created_at=now or timezone.now())
    _publish(job_id=job.pk, team_id=job.team_id, seq=chunk.pk)
    return chunk


def log_marker_for_transition(*, job, from_state, to_state, reason="", now=None) -> LogChunk | None:
    """Writes the marker of a state change that interrupts or ends the job's run (MARKERS), and a
    "resumed" one when a job that was preempted, moved or resized runs again; returns it or None.
    Called by job_transition inside its transaction."""
    to_state, from_state = S(to_state), S(from_state)
    if to_state in MARKERS:
        text = MARKERS[to_state]
    elif to_state == S.RUNNING and from_state in (S.RESIZING, S.MIGRATING):
        text = f"running again after {'the resize' if from_state == S.RESIZING else 'the move'}"
    elif to_state == S.RUNNING and from_state == S.SCHEDULED and (job.preemption_count or job.migration_count):
        text = "resumed from its last checkpoint"
    else:
        return None
    if reason:
        text = f"{text} ({reason})"
    return log_marker_add(job=job, text=text, now=now)


def _publish(*, job_id, team_id, seq):
    events_publish(groups=[group_for_job(job_id)], type=LIVE_TYPE,
                   payload={"job_id": job_id, "team_id": team_id, "seq": seq})


# --- what agents ship ------------------------------------------------------------------------


GRANT_SALT = "meridian.jobs.logs.grant"


def log_grant(*, job_id: int, generation: int, node_id: int) -> str:
    """Returns the grant of the copy of job `job_id` at `generation` placed on node `node_id`: a
    SHA-256 HMAC under the control plane's SECRET_KEY, handed to that node only (in its desired
    state). With it, the copy's output is taken even when its first chunk arrives after the job
    ended and released its devices (the node's agent was frozen or cut off for the copy's whole
    life)."""
    return salted_hmac(GRANT_SALT, f"{job_id}:{generation}:{node_id}", algorithm="sha256").hexdigest()


def _granted(chunk, *, node, generation) -> bool:
    return bool(chunk.grant) and generation is not None and constant_time_compare(
        chunk.grant, log_grant(job_id=chunk.job_id, generation=generation, node_id=node.pk))


def _copy_of(chunk, jobs: dict) -> tuple[int, int | None]:
    """(job id, placement generation) of the copy `chunk` comes from (the job's generation when the
    chunk says none; None for a job that does not exist)."""
    job = jobs.get(chunk.job_id)
    if chunk.generation is not None or job is None:
        return chunk.job_id, chunk.generation
    return chunk.job_id, job.generation


def _refusals(*, node, batch: LogBatch, jobs: dict) -> dict[tuple[int, int | None], LogRejection]:
    """Returns, by copy ((job id, generation): a batch may hold the tail of an older copy of a job
    next to its current one, and each is judged on its own), why this node may not ship that
    copy's chunks."""
    ids = list(jobs)
    placed = set(Replica.objects.filter(device__node_id=node.pk, job_id__in=ids).values_list("job_id", flat=True))
    # The copies a move took (or takes) off this node, its leader's host or a follower host: their
    # tails are taken after the move ended too (a follower's last lines of a job that finished as
    # it was resized across hosts arrive after the job ended at the move's new generation).
    took_off = Move.copies_taken_off(node_id=node.pk, job_ids=ids,
                                     generations={c.generation for c in batch.chunks if c.generation is not None})
    refused: dict[tuple[int, int | None], LogRejection] = {}
    for chunk in batch.chunks:
        copy = _copy_of(chunk, jobs)
        job = jobs.get(chunk.job_id)
        if copy in refused:
            continue
        generation = copy[1]
        if job is None:
            refused[copy] = LogRejection(job_id=chunk.job_id, fence=True, error="no such job", generation=generation)
            continue
        if (job.pk, generation) in took_off:
            continue  # the copy a move took off this node
        if generation != job.generation:
            refused[copy] = LogRejection(job_id=job.pk, fence=True, generation=generation, error=(
                f"stale copy: generation {generation}, the job now runs as generation {job.generation}"))
        elif job.pk not in placed and not _granted(chunk, node=node, generation=generation):
            refused[copy] = LogRejection(job_id=job.pk, fence=True, generation=generation,
                                         error="this job is not placed on your node")
        elif chunk.rank >= job.world_size:
            refused[copy] = LogRejection(job_id=job.pk, generation=generation, error=(
                f"rank {chunk.rank} is out of range: the job has {job.world_size} rank(s)"))
    return refused


def log_batch_record(*, node, batch: LogBatch, now=None) -> LogBatchAnswer:
    """Stores the chunks of `batch` that `node` may ship (see the module docstring); returns how
    many were stored, how many were already there, and the refusals by copy.

    The rows of the batch's jobs are locked first (in id order): every writer of a job's log
    (this, and a marker written by job_transition, which updates the job's row first) takes the
    job's row before its chunks get their ids, so a job's chunks commit in id order and a reader
    following the cursor (id > after) never passes a chunk that commits later with a smaller id
    (PostgreSQL hands out ids at insert time, not at commit; SQLite has one writer at a time)."""
    now = now or timezone.now()
    if not batch.chunks:
        return LogBatchAnswer(stored=0)
    with transaction.atomic():
        jobs = {job.pk: job for job in Job.objects.select_for_update().filter(
            pk__in={c.job_id for c in batch.chunks}).order_by("pk").only("id", "team_id", "generation", "world_size")}
        refused = _refusals(node=node, batch=batch, jobs=jobs)
        wanted = [c for c in batch.chunks if _copy_of(c, jobs) not in refused]
        ends = _stored_ends(node=node, chunks=wanted)
        rows, duplicates, empty = [], 0, 0
        for chunk in wanted:
            generation = _copy_of(chunk, jobs)[1]
            if chunk.length == 0 and not chunk.text and not chunk.dropped:
                empty += 1  # an older agent announcing its copy: taken, nothing to store
                continue
            key = (chunk.job_id, generation, chunk.attempt, chunk.rank, chunk.stream)
            chunk = _beyond(chunk, ends.get(key, -1))
            if chunk is None:
                duplicates += 1  # every byte of it is stored already
                continue
            ends[key] = chunk.offset + chunk.length
            common = {"job_id": chunk.job_id, "node_id": node.pk, "generation": generation,
                      "attempt": chunk.attempt, "rank": chunk.rank, "stream": chunk.stream, "created_at": now}
            if chunk.dropped:
                rows.append(LogChunk(kind=LogChunk.Kind.DROPPED, offset=chunk.offset, **common, text=(
                    f"[meridian: {chunk.dropped} bytes of rank {chunk.rank}'s {chunk.stream} were dropped: "
                    f"the agent on {node.hostname} could not reach the control plane and keeps a bounded backlog]\n")))
            rows.append(LogChunk(kind=LogChunk.Kind.OUTPUT, offset=chunk.offset, length=chunk.length,
                                 text=chunk.text, **common))
        created = LogChunk.objects.bulk_create(rows) if rows else []
        stored = empty + sum(1 for row in created if row.kind == LogChunk.Kind.OUTPUT)
        for job_id in {row.job_id for row in created}:
            last = max(row.pk for row in created if row.job_id == job_id)
            _publish(job_id=job_id, team_id=jobs[job_id].team_id, seq=last)
            _prune_job(job_id)
    log_chunks_prune(now=now)
    return LogBatchAnswer(stored=stored, duplicates=duplicates, rejected=tuple(refused.values()))


def _stored_ends(*, node, chunks) -> dict[tuple, int]:
    """Returns, per (job, generation, attempt, rank, stream) of `chunks`, the end (offset + length)
    of the furthest stored output chunk from `node` that a chunk of them could overlap (one query,
    bounded by the batch: chunks from MAX_CHUNK_BYTES before the batch's first offset on)."""
    if not chunks:
        return {}
    rows = LogChunk.objects.filter(
        job_id__in={c.job_id for c in chunks}, node_id=node.pk, kind=LogChunk.Kind.OUTPUT,
        attempt__in={c.attempt for c in chunks}, offset__gte=min(c.offset for c in chunks) - MAX_CHUNK_BYTES,
    ).values_list("job_id", "generation", "attempt", "rank", "stream", "offset", "length")
    ends: dict[tuple, int] = {}
    for job_id, generation, attempt, rank, stream, offset, length in rows:
        key = (job_id, generation, attempt, rank, stream)
        ends[key] = max(ends.get(key, -1), offset + length)
    return ends


def _beyond(chunk, stored_end: int):
    """Returns `chunk`, or its part after `stored_end` when it overlaps what is stored (a batch sent
    again after its answer was lost, cut anew: its first chunk starts where the stored one did but
    runs further), or None when all of it is stored. Found by the logs e2e: the web server killed
    after it committed a batch, the longer chunk sent again was taken for a duplicate and the bytes
    beyond the stored one were lost."""
    end = chunk.offset + chunk.length
    if end <= stored_end:
        return None
    if chunk.offset >= stored_end:
        return chunk
    skip = stored_end - chunk.offset
    raw = chunk.text.encode("utf-8")
    # The text is the bytes decoded with bad bytes replaced: exact when it re-encodes to `length`.
    tail = raw[skip:] if len(raw) == chunk.length else raw[max(0, len(raw) - (end - stored_end)):]
    return dataclasses.replace(chunk, offset=stored_end, length=end - stored_end, dropped=0,  # said the 1st time
                               text=tail.decode("utf-8", errors="replace"))


def _prune_job(job_id) -> int:
    """Deletes the oldest chunks of a job beyond MERIDIAN_LOG_MAX_CHUNKS_PER_JOB; returns how many."""
    cap = settings.MERIDIAN_LOG_MAX_CHUNKS_PER_JOB
    chunks = LogChunk.objects.filter(job_id=job_id)
    if chunks.count() <= cap:
        return 0
    cutoff = chunks.order_by("-id").values_list("id", flat=True)[cap]
    return chunks.filter(id__lte=cutoff).delete()[0]


def log_chunks_prune(*, now=None, force=False) -> int:
    """Deletes chunks older than MERIDIAN_LOG_RETENTION_DAYS (at most once a minute per process
    unless `force`); returns how many."""
    if not force and time.monotonic() - _last_prune[0] < PRUNE_EVERY_S:
        return 0
    _last_prune[0] = time.monotonic()
    cutoff = (now or timezone.now()) - timedelta(days=settings.MERIDIAN_LOG_RETENTION_DAYS)
    return LogChunk.objects.filter(created_at__lt=cutoff).delete()[0]


# --- reading ---------------------------------------------------------------------------------


def log_chunks_list(*, job, rank=None, after=0, limit=DEFAULT_PAGE, tail=False):
    """Returns `job`'s chunks after cursor `after` (oldest first, at most `limit`): one rank's
    (with the markers) or every rank's. With `tail`, the newest `limit` instead (oldest first)."""
    chunks = LogChunk.objects.filter(job_id=job.pk, id__gt=after)
    if rank is not None:
        chunks = chunks.filter(Q(rank=rank) | Q(rank__isnull=True))
    fields = ("id", "kind", "rank", "stream", "generation", "attempt", "text", "created_at")
    if tail:
        return list(reversed(chunks.order_by("-id").only(*fields)[:limit]))
    return list(chunks.order_by("id").only(*fields)[:limit])


FAILED_RANK = re.compile(r"rank (\d+) exited with code")


def log_failing_rank(*, job) -> int | None:
    """Returns the rank whose exit failed the job, as the launcher said in the failure reason
    ("rank 3 exited with code 1"), else the rank with the newest output, else None."""
    match = FAILED_RANK.search(job.failure_reason or "")
    if match and int(match.group(1)) < job.world_size:
        return int(match.group(1))
    newest = (LogChunk.objects.filter(job_id=job.pk, kind=LogChunk.Kind.OUTPUT)
              .order_by("-id").values_list("rank", flat=True).first())
    return newest


def log_tail_text(*, job, rank, lines=40, chunks=50) -> str:
    """Returns the last `lines` lines of `rank`'s log of `job` (markers included), or ""."""
    text = "".join(c.text for c in log_chunks_list(job=job, rank=rank, limit=chunks, tail=True))
    return "".join(text.splitlines(keepends=True)[-lines:])
