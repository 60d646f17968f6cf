"""Full heartbeats acknowledged at once and folded into the database in batches (issue 18).

    heartbeat_enqueue(node_id=..., token_digest=..., wire=..., body=..., now=...) -> ReportOutcome | None
    heartbeat_enqueue_packed(...)                     the same on the event loop (jobs/heartbeat_api.py)
    heartbeat_outcomes_remember(node_id=..., wire=..., outcome=...)   a heartbeat recorded in its request
    heartbeats_fold(limit=...) -> FoldResult           one batch (the folder: jobs.tasks.heartbeats_fold)
    heartbeats_fold_all(max_seconds=...) -> FoldResult  batches until the queue is empty (the task; tests)

With MERIDIAN_HEARTBEAT_FOLD=async (jobs/heartbeats.py) a full heartbeat that was authenticated
and decoded (protocol.node.Heartbeat: every field bounded), from an agent that holds the current
desired state, is not recorded in the request. It is appended to a Redis stream in one round trip
(a Lua script: the append, the node's lease, the outcomes the folder recorded for the node), and
answered at once with what became of its reports as far as the folder can
already say:
  * a report whose content (all but its progress: protocol.node.PROGRESS_FIELDS) equals that of a
    report the folder recorded for the node answers that report's outcome (accepted, rejected with
    its Rejection, deferred);
  * any other report is "deferred": heard, not decided yet. The agent (agent/liveness.py) sends a
    full heartbeat again at its next beat until the outcome is known. An agent drops a finished copy
    only once it is accepted, so "accepted" is said only of what the folder recorded.
A heartbeat from an agent whose desired state is out of date is recorded in its request, as in
"sync": the changes that reject a report ("fence": the job runs as a newer generation; "cancel")
change the node's desired state too, and the agent must hear the rejection in the same answer as
the desired state without the job (from the desired state alone it would stop the copy at a
consistent cut, checkpointing a copy it must kill; found by the e2e cancel test). So a cached
outcome is answered only while the desired state it was decided under is the agent's. The folder's
commit bumps the node's desired serial (jobs/desired_signal.py) when a report changed its desired
state, so the agent's next lease brings a full heartbeat that gets the new one.

Why a Redis stream and not a table: the append is one command in the round trip the heartbeat pays
anyway (the lease write), costs no database transaction in the web process (a table's INSERT would
cost ~a third of the write it replaces), and a consumer group gives the folder what it needs to
lose nothing: entries stay pending until acknowledged, after the folder's commit.

Losing nothing:
  * Redis unreachable, or more than MERIDIAN_HEARTBEAT_FOLD_BACKLOG entries waiting (the folder is
    down or behind), or a body over QUEUED_BODY_MAX: the heartbeat is recorded in the request, as
    with MERIDIAN_HEARTBEAT_FOLD=sync.
  * The folder records a batch in one transaction, then acknowledges and deletes its entries. A
    folder that dies before its commit leaves its entries pending; the next one (one consumer name,
    FOLDER) reads them again first. One that dies after its commit but before acknowledging: the
    transaction also wrote the id of the last entry it recorded (the ControlLoopLease row FOLD_DUTY),
    so the next folder skips those entries (a heartbeat's telemetry is never counted twice in the
    history). Folders take the row's lock first: one folds at a time, in the stream's order.
  * A node's token revoked or rotated after its heartbeat was queued: the entry carries the digest
    of the token it came with, and the folder drops it unless that is still the node's (a revoked
    node never gets a report applied, however long the queue waited). So does a deleted node's.
  * Redis restarted empty: the entries not yet folded are gone, and so are the outcomes; the agents
    hear "deferred" again and send their reports again (level-triggered). What is lost is the
    progress and telemetry of the lost beats, overwritten by the next ones.
Coalescing: of several beats of one node in a batch, a report repeated in the node's next beat
with the same content (all but its progress) is dropped, and a beat left with no report is dropped
when a later beat of the node follows (its telemetry reading is superseded: the node's history
minute gets the later sample only). Beats of one node, or on one job, are recorded in their order,
each in a later round (jobs.workflows.node_reports_record judges a round on the database as it was
before it).

Redis keys (settings.REDIS_URL's database):
    meridian:heartbeats              stream   node, at (epoch seconds received), beat (the body),
                                              token (the digest of the token it came with)
    meridian:heartbeat-outcome:<id>  string   JSON {job id: [report key, "a" | "d" | rejection]}, the
                                              outcomes of the node's last folded beats (OUTCOME_TTL)
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from fleet.leases import LEASE_KEY, lease_store, redis_errors
from fleet.live import pushes_batched
from fleet.models import Node
from jobs.models import ControlLoopLease
from protocol.node import PROGRESS_FIELDS, Heartbeat, Rejection, ReportOutcome

logger = logging.getLogger(__name__)

STREAM_KEY = "meridian:heartbeats"
OUTCOME_KEY = "meridian:heartbeat-outcome:{node_id}"
GROUP = "folder"
FOLDER = "folder"  # one consumer name: a new folder reads what a dead one left pending
FOLD_DUTY = "heartbeat-fold"  # its ControlLoopLease row: the lock and the last entry recorded
OUTCOME_TTL = 3600  # seconds: a node silent this long hears "deferred" and reports again
FOLD_BATCH = 500  # entries per batch (one transaction)
# A heartbeat body larger than this is recorded in the request, never queued: a node with 8 devices
# and a few copies sends ~2-5 KB, and the queue's memory is bounded by this times the backlog.
QUEUED_BODY_MAX = 64 * 1024

ACCEPTED, DEFERRED = "a", "d"

# KEYS: stream, lease hash, the node's outcomes; ARGV: backlog limit, node id, now, body, token digest.
# Returns nil when the backlog is full (nothing appended), else the node's outcomes ("" when none).
_ENQUEUE_SCRIPT = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
redis.call('XADD', KEYS[1], '*', 'node', ARGV[2], 'at', ARGV[3], 'beat', ARGV[4], 'token', ARGV[5])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return redis.call('GET', KEYS[3]) or ''
"""
_ENQUEUE_SCRIPT_SHA = hashlib.sha1(_ENQUEUE_SCRIPT.encode()).hexdigest().encode()
_scripts: dict[int, object] = {}


def report_key(report: dict) -> str:
    """Returns the key of a job report's wire dict: a digest of all it says but its progress
    (equal keys: the same report, maybe at another step)."""
    said = {k: v for k, v in report.items() if k not in PROGRESS_FIELDS}
    return hashlib.blake2b(json.dumps(said, sort_keys=True, separators=(",", ":")).encode(),
                           digest_size=12).hexdigest()


def report_keys(wire: dict) -> dict:
    """Returns {job id: report_key} of a heartbeat's wire dict."""
    return {r["job_id"]: report_key(r) for r in wire.get("jobs") or ()}


def heartbeat_enqueue(*, node_id: int, token_digest: str, wire: dict, body: bytes | None = None,
                      now: float | None = None) -> ReportOutcome | None:
    """Appends node `node_id`'s heartbeat (`wire`: its decoded JSON, already checked to decode as a
    Heartbeat; `body`: its bytes as received, else `wire` is encoded; `token_digest`: the digest of
    the token it was authenticated with, Node.agent_token_hash) to the queue and records the
    node's lease; returns what can be said of its reports now (see the module doc), or None when
    it was not queued (Redis unreachable, the backlog full, the body too large): the caller records
    it itself."""
    store = lease_store()
    if store is None:
        return None
    now = time.time() if now is None else now
    script = _scripts.get(id(store))
    if script is None:
        script = _scripts[id(store)] = store.register_script(_ENQUEUE_SCRIPT)
    if body is None:
        body = json.dumps(wire, separators=(",", ":")).encode()
    if len(body) > QUEUED_BODY_MAX:
        return None
    try:
        held = script(keys=[STREAM_KEY, LEASE_KEY, OUTCOME_KEY.format(node_id=node_id)],
                      args=[settings.MERIDIAN_HEARTBEAT_FOLD_BACKLOG, node_id, repr(now), body, token_digest])
    except redis_errors() as exc:
        logger.warning("heartbeat queue: Redis unreachable (%s); recorded in the request", exc)
        return None
    if held is None:
        _backlog_full()
        return None
    return _queued_outcome(wire, held)


async def heartbeat_enqueue_packed(*, node_id: int, token_digest: str, wire: dict, body: bytes, now: float
                                   ) -> ReportOutcome | None:
    """heartbeat_enqueue for the path answered before Django (jobs/heartbeat_api.py), on this event
    loop: the same script, sent packed on the lease's connections (fleet.lease_api.LeaseConnections)
    without redis-py's client. Returns None when the backlog is full or the body too large; raises
    redis-py's errors (Redis unreachable): the caller then takes the full path, which records it."""
    from redis.exceptions import NoScriptError

    from fleet.lease_api import command_packed, redis_connections

    if len(body) > QUEUED_BODY_MAX:
        return None
    arguments = (b"3", STREAM_KEY.encode(), LEASE_KEY.encode(), OUTCOME_KEY.format(node_id=node_id).encode(),
                 str(settings.MERIDIAN_HEARTBEAT_FOLD_BACKLOG).encode(), str(node_id).encode(), repr(now).encode(),
                 body, token_digest.encode())
    connections = redis_connections()
    try:
        held = await connections.execute(command_packed(b"EVALSHA", _ENQUEUE_SCRIPT_SHA, *arguments))
    except NoScriptError:  # a Redis restarted (or its scripts flushed) since: EVAL caches it again
        held = await connections.execute(command_packed(b"EVAL", _ENQUEUE_SCRIPT.encode(), *arguments))
    if held is None:
        _backlog_full()
        return None
    return _queued_outcome(wire, held)


def _backlog_full() -> None:
    logger.warning("heartbeat queue: %s entries wait (the folder is down or behind); recorded in the request",
                   settings.MERIDIAN_HEARTBEAT_FOLD_BACKLOG)


def _queued_outcome(wire: dict, held) -> ReportOutcome:
    """Returns what can be said of a queued heartbeat's reports from the node's outcomes the queue
    script returned (`held`: JSON, or empty when none; see the module doc)."""
    outcomes = json.loads(held) if held else {}
    accepted, rejected, deferred = [], [], []
    for report in wire.get("jobs") or ():
        job_id = report["job_id"]
        key, outcome = outcomes.get(str(job_id), (None, None))
        if key != report_key(report) or outcome == DEFERRED:
            deferred.append(job_id)
        elif outcome == ACCEPTED:
            accepted.append(job_id)
        else:
            rejected.append(Rejection.from_dict(outcome))
    return ReportOutcome(accepted=tuple(dict.fromkeys(accepted)), rejected=tuple(rejected),
                         deferred=tuple(dict.fromkeys(deferred)))


def heartbeat_outcomes_remember(*, node_id: int, wire: dict, outcome: ReportOutcome) -> None:
    """Records the outcomes of a heartbeat recorded in its request (in async mode) as the folder
    records its own, so that the node's next queued heartbeat answers them, not older ones. Best
    effort: without it the next one is answered from older outcomes of other reports (their keys
    differ) or "deferred"."""
    store = lease_store()
    if store is None:
        return
    keys = report_keys(wire)
    try:
        store.set(OUTCOME_KEY.format(node_id=node_id), json.dumps(_outcome_wire(outcome, keys)), ex=OUTCOME_TTL)
    except redis_errors() as exc:
        logger.warning("heartbeat outcomes: Redis unreachable (%s)", exc)


# --- the folder -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FoldResult:
    entries: int = 0  # read from the queue
    recorded: int = 0  # beats recorded (after coalescing)
    coalesced: int = 0  # beats dropped: superseded by a later beat of the node in the batch
    skipped: int = 0  # entries recorded before (a folder died before acknowledging them) or unreadable
    rounds: int = 0

    def __add__(self, other: FoldResult) -> FoldResult:
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return FoldResult(*(a + b for a, b in pairs))


@dataclass
class _Beat:
    entry: str
    node_id: int
    now: datetime
    wire: dict
    heartbeat: Heartbeat
    keys: dict  # job id -> report key
    token: str | None  # the digest of the token it came with (None: queued before session 24; see _still_enrolled)


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read(store, limit):
    """Returns [(entry id, fields)]: this consumer's pending entries first (a dead folder's), else new ones."""
    import redis

    for start in ("0", ">"):
        try:
            answer = store.xreadgroup(GROUP, FOLDER, {STREAM_KEY: start}, count=limit)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # From the stream's start ("0"): entries appended before the group existed are folded too.
            store.xgroup_create(STREAM_KEY, GROUP, id="0", mkstream=True)
            answer = store.xreadgroup(GROUP, FOLDER, {STREAM_KEY: start}, count=limit)
        entries = [(_text(entry_id), fields) for _stream, items in answer or () for entry_id, fields in items
                   if fields is not None]
        if entries:
            return entries
    return []


def _decode(entry_id, fields) -> _Beat | None:
    fields = {_text(k): v for k, v in fields.items()}
    try:
        wire = json.loads(fields["beat"])
        return _Beat(entry=entry_id, node_id=int(fields["node"]),
                     now=datetime.fromtimestamp(float(fields["at"]), tz=dt_timezone.utc), wire=wire,
                     heartbeat=Heartbeat.from_dict(wire),  # checked again: what is recorded is decoded here
                     keys=report_keys(wire), token=_text(fields["token"]) if "token" in fields else None)
    except (KeyError, ValueError, TypeError) as exc:  # only the web path writes here: a bug, said loudly
        logger.error("heartbeat queue: entry %s unreadable (%s); dropped", entry_id, exc)
        return None


def _still_enrolled(beat: _Beat, nodes: dict) -> bool:
    """True when the beat's node exists and still has the token the beat came with (see the module doc)."""
    node = nodes.get(beat.node_id)
    if node is None:
        logger.info("heartbeat folder: node %s is gone; its heartbeat %s dropped", beat.node_id, beat.entry)
        return False
    # An empty digest: queued by a caller that authenticated no token (the service called directly).
    if beat.token and not hmac.compare_digest(node.agent_token_hash, beat.token):
        logger.warning("heartbeat folder: node %s's token was revoked or rotated since its heartbeat %s was queued; "
                       "dropped", beat.node_id, beat.entry)
        return False
    return True


def _coalesce(beats: list[_Beat]) -> tuple[list[_Beat], int]:
    """Returns (the beats to record, in order, each with only the reports its node's next beat in the
    batch does not repeat; how many beats were dropped): see the module doc."""
    later: dict[int, _Beat] = {}
    kept, dropped = [], 0
    for beat in reversed(beats):
        following = later.get(beat.node_id)
        if following is not None:
            kept_at = [i for i, r in enumerate(beat.wire.get("jobs") or ())
                       if following.keys.get(r["job_id"]) != beat.keys[r["job_id"]]]
            if not kept_at:
                dropped += 1
                continue
            beat.wire = {**beat.wire, "jobs": [beat.wire["jobs"][i] for i in kept_at]}
            beat.heartbeat = dataclasses.replace(beat.heartbeat, jobs=tuple(beat.heartbeat.jobs[i] for i in kept_at))
        later[beat.node_id] = beat
        kept.append(beat)
    kept.reverse()
    return kept, dropped


def _rounds(beats: list[_Beat]) -> list[list[_Beat]]:
    """Splits `beats` into rounds: a beat goes after every earlier beat of its node or on one of its jobs."""
    last_of_node, last_of_job = {}, {}
    rounds: list[list[_Beat]] = []
    for beat in beats:
        jobs = {r["job_id"] for r in beat.wire.get("jobs") or ()}
        index = 1 + max([last_of_node.get(beat.node_id, -1), *(last_of_job.get(j, -1) for j in jobs)])
        if index == len(rounds):
            rounds.append([])
        rounds[index].append(beat)
        last_of_node[beat.node_id] = index
        for job_id in jobs:
            last_of_job[job_id] = index
    return rounds


def _outcome_wire(outcome: ReportOutcome, keys: dict) -> dict:
    said = {}
    for job_id in outcome.accepted:
        said[str(job_id)] = [keys.get(job_id), ACCEPTED]
    for job_id in outcome.deferred:
        said[str(job_id)] = [keys.get(job_id), DEFERRED]
    for rejection in outcome.rejected:
        said[str(rejection.job_id)] = [keys.get(rejection.job_id), rejection.to_dict()]
    return said


def _acknowledge(store, *, ids, outcomes) -> None:
    """After the commit: the nodes' outcomes written, the entries acknowledged and deleted (one round trip)."""
    pipe = store.pipeline(transaction=False)
    for node_id, said in outcomes.items():
        pipe.set(OUTCOME_KEY.format(node_id=node_id), json.dumps(said), ex=OUTCOME_TTL)
    pipe.xack(STREAM_KEY, GROUP, *ids)
    pipe.xdel(STREAM_KEY, *ids)
    pipe.execute()


def heartbeats_fold(*, limit: int = FOLD_BATCH) -> FoldResult:
    """Records up to `limit` queued heartbeats in one transaction (see the module doc); returns
    what it did. Returns an empty result at once when the queue is empty or Redis unreachable."""
    from jobs.workflows import NodeBeat, node_reports_record

    store = lease_store()
    if store is None:
        return FoldResult()
    try:
        if not store.xlen(STREAM_KEY):
            return FoldResult()
    except redis_errors() as exc:
        logger.warning("heartbeat folder: Redis unreachable (%s)", exc)
        return FoldResult()
    ControlLoopLease.objects.get_or_create(name=FOLD_DUTY)
    with pushes_batched(), transaction.atomic():  # the batch's page pushes in one hop, after its commit
        # The row's lock (a write: SQLite takes its write lock here too): one folder at a time.
        ControlLoopLease.objects.filter(name=FOLD_DUTY).update(holder=FOLDER, expires_at=timezone.now())
        cursor = ControlLoopLease.objects.filter(name=FOLD_DUTY).values_list("last_tick_stats", flat=True).get()
        done = _entry_order((cursor or {}).get("last_entry", "0-0"))
        entries = _read(store, limit)
        if not entries:
            return FoldResult()
        fresh = [(entry_id, fields) for entry_id, fields in entries if _entry_order(entry_id) > done]
        beats = [beat for beat in (_decode(e, f) for e, f in fresh) if beat is not None]
        nodes = Node.objects.in_bulk({beat.node_id for beat in beats})
        present = [beat for beat in beats if _still_enrolled(beat, nodes)]
        skipped = len(entries) - len(present)  # recorded before, unreadable, of a deleted node or a revoked token
        beats, coalesced = _coalesce(present)
        outcomes: dict[int, dict] = defaultdict(dict)
        rounds = _rounds(beats)
        for round_beats in rounds:
            recorded = node_reports_record(beats=[
                NodeBeat(node=nodes[b.node_id], heartbeat=b.heartbeat, now=b.now)
                for b in round_beats])
            for beat, outcome in zip(round_beats, recorded, strict=True):
                outcomes[beat.node_id].update(_outcome_wire(outcome, beat.keys))
        last = max(entries, key=lambda e: _entry_order(e[0]))[0]
        if _entry_order(last) > done:
            ControlLoopLease.objects.filter(name=FOLD_DUTY).update(
                last_tick_stats={"last_entry": last, "folded": len(beats)})
    ids = [entry_id for entry_id, _ in entries]
    try:
        _acknowledge(store, ids=ids, outcomes=outcomes)
    except redis_errors() as exc:  # recorded: the entries are skipped when read again (the cursor)
        logger.warning("heartbeat folder: could not acknowledge %d entries (%s)", len(ids), exc)
    return FoldResult(entries=len(entries), recorded=len(beats), coalesced=coalesced, skipped=skipped,
                      rounds=len(rounds))


def heartbeats_fold_all(*, max_seconds: float | None = None, limit: int = FOLD_BATCH) -> FoldResult:
    """Folds batches until the queue is empty (or `max_seconds` passed); returns the sum."""
    began = time.monotonic()
    total = FoldResult()
    while True:
        result = heartbeats_fold(limit=limit)
        total = total + result
        if not result.entries or (max_seconds is not None and time.monotonic() - began >= max_seconds):
            return total
