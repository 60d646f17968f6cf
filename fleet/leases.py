"""Node liveness leases in Redis: written by the lease endpoint, read by the lost-node sweep, applied
to the database in batches.

    leases_read(node_ids=...) -> {node id: datetime}     one HMGET (None: Redis unreachable)
    leases_flush(now=...) -> int                          fleet.tasks.leases_flush: Node.last_heartbeat
                                                          from the leases, one UPDATE ... FROM unnest
    desired_serials_bump(job_nodes=..., node_ids=...)     agents that lease learn to sync (jobs/desired_signal.py)
    desired_serial_of(node_id=...) -> int

Redis keys (in the database of settings.REDIS_URL, the one Celery and Channels use):
    meridian:lease            hash  node id -> the epoch seconds of its last lease (fleet/lease_api.py)
    meridian:desired-serial   hash  node id -> a counter bumped whenever its desired state may have changed
    meridian:desired-nodes    hash  job id -> "1,5,7": the nodes it was last signalled on (so a node the
                                    job left, e.g. a cancelled job's, is bumped too)

A lease proves liveness only: it carries no report and changes no desired state. The database's
Node.last_heartbeat stays the durable record (pages, admin, and the sweep when Redis is down): it
lags the leases by at most MERIDIAN_LEASE_FLUSH_SECONDS. Everything here tolerates an unreachable
Redis (logged, then a short pause before the next try): agents whose lease fails fall back to the
full heartbeat, which writes Node.last_heartbeat itself.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import connection

from fleet.models import Node

logger = logging.getLogger(__name__)

LEASE_KEY = "meridian:lease"
DESIRED_SERIAL_KEY = "meridian:desired-serial"
DESIRED_NODES_KEY = "meridian:desired-nodes"
# After Redis failed, skip it for this long (each caller would otherwise wait for its connect timeout).
REDIS_RETRY_AFTER_SECONDS = 5.0
REDIS_TIMEOUT_SECONDS = 2.0
# Leases older than this are dropped from the hash by the flush (a node that left the fleet).
LEASE_FORGET_AFTER = timedelta(days=1)
CHUNK = 5000
# One HINCRBY per field in one command: a placement tick bumps ~12k nodes, and as many HINCRBY
# commands cost ~0.15 s of client CPU to pack (redis-py packs each command in Python).
_BUMP_SCRIPT = "for i = 1, #ARGV do redis.call('HINCRBY', KEYS[1], ARGV[i], 1) end return #ARGV"

_clients: dict[str, object] = {}
_down_until = 0.0


def lease_store():
    """Returns a redis-py client for settings.REDIS_URL, or None while Redis was found unreachable
    in the last REDIS_RETRY_AFTER_SECONDS."""
    import redis

    if time.monotonic() < _down_until:
        return None
    url = settings.REDIS_URL
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_SECONDS,
                                                      socket_connect_timeout=REDIS_TIMEOUT_SECONDS)
    return client


def _store_failed(exc: Exception, what: str) -> None:
    global _down_until
    _down_until = time.monotonic() + REDIS_RETRY_AFTER_SECONDS
    logger.warning("leases: Redis unreachable while %s (%s); retrying in %.0f s", what, exc,
                   REDIS_RETRY_AFTER_SECONDS)


def redis_errors():
    """Returns the exceptions of an unreachable or failing Redis (also jobs/heartbeat_fold.py)."""
    import redis

    return (redis.RedisError, OSError)


def _moment(raw) -> datetime | None:
    try:
        return datetime.fromtimestamp(float(raw), tz=dt_timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def leases_read(*, node_ids: Iterable[int]) -> dict[int, datetime] | None:
    """Returns {node id: time of its last lease} for those of `node_ids` that leased (one HMGET per
    CHUNK ids), or None when Redis cannot be reached (the caller then has the database only)."""
    ids = [int(i) for i in node_ids]
    if not ids:
        return {}
    store = lease_store()
    if store is None:
        return None
    leases = {}
    try:
        for start in range(0, len(ids), CHUNK):
            part = ids[start:start + CHUNK]
            for node_id, raw in zip(part, store.hmget(LEASE_KEY, part), strict=True):
                moment = _moment(raw) if raw is not None else None
                if moment is not None:
                    leases[node_id] = moment
    except redis_errors() as exc:
        _store_failed(exc, "reading leases")
        return None
    return leases


def nodes_alive_by_lease(*, node_ids: Iterable[int], cutoff: datetime) -> set[int]:
    """Returns those of `node_ids` whose lease is newer than `cutoff` (empty when Redis is down)."""
    leases = leases_read(node_ids=node_ids) or {}
    return {node_id for node_id, moment in leases.items() if moment >= cutoff}


def leases_flush(*, now: datetime) -> int:
    """Applies every lease to Node.last_heartbeat where it is newer (never moves it back); returns
    the rows updated. One UPDATE ... FROM unnest(ids, times) per CHUNK nodes on PostgreSQL, one
    executemany of conditional UPDATEs on SQLite. Leases older than LEASE_FORGET_AFTER are dropped
    from Redis. Only last_heartbeat is written: a lost node comes back to ready through a full
    heartbeat (fleet.services.node_heartbeat_record), never through a lease."""
    store = lease_store()
    if store is None:
        return 0
    try:
        raw = store.hgetall(LEASE_KEY)
    except redis_errors() as exc:
        _store_failed(exc, "flushing leases")
        return 0
    leases, forget = [], []
    for key, value in raw.items():
        moment = _moment(value)
        try:
            node_id = int(key)
        except ValueError:
            forget.append(key)
            continue
        if moment is None or now - moment > LEASE_FORGET_AFTER:
            forget.append(key)
        else:
            leases.append((node_id, moment))
    updated = 0
    table = Node._meta.db_table
    with connection.cursor() as cursor:
        for start in range(0, len(leases), CHUNK):
            part = leases[start:start + CHUNK]
            if connection.vendor == "postgresql":
                cursor.execute(
                    f"UPDATE {table} AS n SET last_heartbeat = v.at "
                    f"FROM unnest(%s::bigint[], %s::timestamptz[]) AS v(id, at) "
                    f"WHERE n.id = v.id AND (n.last_heartbeat IS NULL OR n.last_heartbeat < v.at)",
                    [[node_id for node_id, _ in part], [moment for _, moment in part]])
                updated += cursor.rowcount
            else:
                adapt = connection.ops.adapt_datetimefield_value
                rows = [(adapt(moment), node_id, adapt(moment)) for node_id, moment in part]
                cursor.executemany(
                    f"UPDATE {table} SET last_heartbeat = %s "
                    f"WHERE id = %s AND (last_heartbeat IS NULL OR last_heartbeat < %s)", rows)
                updated += max(0, cursor.rowcount)
    if forget:
        try:
            store.hdel(LEASE_KEY, *forget)
        except redis_errors() as exc:
            _store_failed(exc, "forgetting old leases")
    return updated


def desired_serial_of(*, node_id: int) -> int | None:
    """Returns the node's desired-state serial (0 when never bumped), or None when Redis is down."""
    store = lease_store()
    if store is None:
        return None
    try:
        return int(store.hget(DESIRED_SERIAL_KEY, node_id) or 0)
    except redis_errors() as exc:
        _store_failed(exc, "reading a desired serial")
        return None


def desired_serials_bump(*, job_nodes: Mapping[int, set[int]] | None = None, node_ids: Iterable[int] = ()) -> set[int]:
    """Bumps the desired-state serial of `node_ids`, of the nodes each job in `job_nodes` ({job id:
    the nodes it is on now}) is on, and of the nodes each was on when it was last signalled; records
    the new nodes of each job. Two round trips (HMGET, then one pipeline; the serials bumped by a
    short Lua script, many nodes per command). Returns the nodes bumped
    (empty when Redis is down: agents then sync at their full-heartbeat interval)."""
    job_nodes = dict(job_nodes or {})
    bump = {int(n) for n in node_ids}
    store = lease_store()
    if store is None:
        return set()
    try:
        job_ids = list(job_nodes)
        for start in range(0, len(job_ids), CHUNK):
            part = job_ids[start:start + CHUNK]
            for raw in store.hmget(DESIRED_NODES_KEY, part):
                if raw:
                    bump.update(int(n) for n in raw.decode().split(",") if n.isdigit())
        recorded, forgotten = [], []
        for job_id, nodes in job_nodes.items():
            bump.update(nodes)
            if nodes:
                recorded.append((job_id, ",".join(str(n) for n in sorted(nodes))))
            else:
                forgotten.append(job_id)
        # Many fields per HSET / HDEL: a placement tick records ~30k jobs, and one command each
        # cost ~1 s of client CPU to pack.
        pipe = store.pipeline(transaction=False)
        for start in range(0, len(recorded), CHUNK):
            pipe.hset(DESIRED_NODES_KEY, mapping=dict(recorded[start:start + CHUNK]))
        for start in range(0, len(forgotten), CHUNK):
            pipe.hdel(DESIRED_NODES_KEY, *forgotten[start:start + CHUNK])
        bumped = list(bump)
        for start in range(0, len(bumped), CHUNK):
            pipe.eval(_BUMP_SCRIPT, 1, DESIRED_SERIAL_KEY, *bumped[start:start + CHUNK])
        pipe.execute()
    except redis_errors() as exc:
        _store_failed(exc, "bumping desired serials")
        return set()
    return bump


def lease_settings_check(*, lost_after: float, heartbeat: float, flush: float) -> str | None:
    """Returns why these settings let a live node that only leases be found lost, or None.

    The sweep reads the leases from Redis; when Redis is down it has Node.last_heartbeat only, which
    lags by up to `flush` seconds, and an agent notices within one `heartbeat` that its lease fails
    and sends full heartbeats instead: lost-after must exceed flush + 2 heartbeats."""
    if lost_after and lost_after <= flush + 2 * heartbeat:
        return (f"MERIDIAN_NODE_LOST_AFTER_SECONDS ({lost_after:g}) should exceed MERIDIAN_LEASE_FLUSH_SECONDS "
                f"({flush:g}) + 2 x MERIDIAN_AGENT_HEARTBEAT_SECONDS ({heartbeat:g}): while Redis is down, "
                "nodes that only leased could be found lost")
    return None
