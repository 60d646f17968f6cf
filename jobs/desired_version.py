"""The desired state a heartbeat answers, served from what changed (the heartbeat's hot path).

    node_desired_answer(node=..., held_version=...) -> (DesiredState | None, version)

A node's desired state changes rarely (a placement, a move step, a checkpoint), but each heartbeat
used to rebuild it (three ORM queries and the message) and send it whole. Now:
  * `version` is a digest of the desired state's wire form: equal versions, equal content,
    whichever web process computed it (each computes it from the content itself).
  * Each web process keeps, per node, the last desired state it built with a fingerprint of
    every database row it was built from (_inputs_fingerprint: one raw query, no ORM
    compiling); while the fingerprint is unchanged the state is not rebuilt. Another process's
    writes change the rows, hence the fingerprint: no invalidation message is needed, and a
    process that has never seen the node (or restarted with new code or settings) builds afresh.
  * The answer omits the desired state when the agent already holds `version` (the protocol's
    Heartbeat.desired_version / HeartbeatAnswer.desired_version).

Whatever jobs.workflows.node_desired_state_build reads from the database must be covered by the
fingerprint: the replicas of every job with a replica on the node (with their devices' nodes and
hostnames), those jobs' rows and checkpoints, the active moves of those jobs or off the node, and
the node itself. tests/fleet/test_heartbeat_desired_version.py checks, after random changes, that
an unchanged fingerprint always means an unchanged desired state.
"""
from __future__ import annotations

import hashlib
import hmac
import json

from django.db import connection

from fleet.models import Accelerator, Node
from jobs.models import Checkpoint, Job, Move, Replica
from jobs.workflows import node_desired_state_build
from protocol.node import DesiredState

CACHE_MAX_NODES = 100_000  # per web process; beyond it the cache starts over (a rebuild per node)
_cache: dict[int, tuple[str, str, DesiredState]] = {}  # node id -> (fingerprint, version, desired state)

_R, _A, _J, _C, _M = (m._meta.db_table for m in (Replica, Accelerator, Job, Checkpoint, Move))
_NODE = "fleet_node"
_JOBS_HERE = f"SELECT r2.job_id FROM {_R} r2 JOIN {_A} a2 ON a2.id = r2.device_id WHERE a2.node_id = %s"
_JOB_COLUMNS = ("j.id", "j.state", "j.generation", "j.name", "j.tier", "j.world_size", "j.min_devices",
                "j.entrypoint", "j.args", "j.env", "j.total_steps", "j.last_checkpoint_step", "j.bundle_id",
                f"(SELECT MAX(c.id) FROM {_C} c WHERE c.job_id = j.id AND c.retired_at IS NULL)",
                f"(SELECT COUNT(*) FROM {_C} c WHERE c.job_id = j.id AND c.retired_at IS NULL)")
_REPLICA_COLUMNS = ("r.job_id", "r.rank", "r.device_id", "a.node_id", f"a.{connection.ops.quote_name('index')}",
                    "n.hostname")
_MOVE_COLUMNS = ("m.id", "m.job_id", "m.kind", "m.step", "m.from_node_id", "m.from_generation", "m.to_node_id",
                 "m.to_generation")


def _select(tag: str, columns: tuple[str, ...]) -> str:
    """SELECT of one part of the fingerprint query: the tag, then `columns` as text, NULL-padded."""
    texts = [f"CAST({c} AS TEXT)" for c in columns] + ["CAST(NULL AS TEXT)"] * (len(_JOB_COLUMNS) - len(columns))
    return f"SELECT '{tag}', {', '.join(texts)}"


_FINGERPRINT_PARTS = (
    f"{_select('r', _REPLICA_COLUMNS)} FROM {_R} r LEFT JOIN {_A} a ON a.id = r.device_id "
    f"LEFT JOIN {_NODE} n ON n.id = a.node_id WHERE r.job_id IN ({_JOBS_HERE}) "
    f"UNION ALL {_select('j', _JOB_COLUMNS)} FROM {_J} j WHERE j.id IN ({_JOBS_HERE}) "
    f"UNION ALL {_select('m', _MOVE_COLUMNS)} FROM {_M} m WHERE m.state = %s AND "
    f"(m.job_id IN ({_JOBS_HERE}) OR m.from_node_id = %s)"
)
# One statement (UNION ALL of the three parts, every value as text), ordered by the parts' keys
# (each part's first two columns after the tag are unique in it: a total order).
_FINGERPRINT_SQL = f"{_FINGERPRINT_PARTS} ORDER BY 1, 2, 3"
# The same with the node's own row (tag "n"): its hostname, state and token digest, for the full
# heartbeat's common case (node_desired_version_current).
_NODE_AND_FINGERPRINT_SQL = (f"{_select('n', ('hostname', 'state', 'agent_token_hash'))} FROM {_NODE} WHERE id = %s "
                             f"UNION ALL {_FINGERPRINT_PARTS} ORDER BY 1, 2, 3")


def _fingerprint_params(node_id: int) -> list:
    return [node_id, node_id, str(Move.State.ACTIVE), node_id, node_id]


def _fingerprint_of(node_id: int, hostname: str, state: str, rows) -> str:
    return hashlib.sha256(repr((node_id, hostname, state, rows)).encode()).hexdigest()


def _inputs_fingerprint(node) -> str:
    """Returns a digest of every row the node's desired state is built from (see the module doc)."""
    with connection.cursor() as cursor:
        cursor.execute(_FINGERPRINT_SQL, _fingerprint_params(node.pk))
        rows = cursor.fetchall()
    return _fingerprint_of(node.pk, node.hostname, str(node.state), rows)


def node_desired_version_current(*, node_id: int, token_digest: str, held_version: str) -> bool:
    """Returns True when node `node_id` exists, its token's digest is `token_digest` (not revoked or
    rotated: checked on its row now), it is not lost, and `held_version` is its current desired
    version as this process last built it (its inputs' fingerprint unchanged). One statement: the
    node's row and the fingerprint's rows together. False means: take the full path
    (jobs.heartbeats.node_heartbeat_answer), which refuses the token, brings a lost node back, or
    builds and caches the desired state (a process that never built it answers False once)."""
    cached = _cache.get(node_id)
    if cached is None or cached[1] != held_version:
        return False
    with connection.cursor() as cursor:
        cursor.execute(_NODE_AND_FINGERPRINT_SQL, [node_id, *_fingerprint_params(node_id)])
        rows = cursor.fetchall()
    own = [row for row in rows if row[0] == "n"]
    if not own:
        return False  # the node is gone
    _tag, hostname, state, stored_digest = own[0][:4]
    if not stored_digest or not hmac.compare_digest(stored_digest, token_digest) or state == Node.State.LOST:
        return False
    # Its other rows are _FINGERPRINT_SQL's, in its order (a total order: removing one row keeps it).
    return _fingerprint_of(node_id, hostname, state, [row for row in rows if row[0] != "n"]) == cached[0]


def desired_version_of(desired: DesiredState) -> str:
    """Returns the version of a desired state: a digest of its wire form (32 hex digits)."""
    wire = json.dumps(desired.to_dict(), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(wire.encode()).hexdigest()[:32]


def node_desired_answer(*, node, held_version: str | None) -> tuple[DesiredState | None, str]:
    """Returns (the node's desired state, or None when the agent holds `held_version` and that is
    still current; the current version). Call it after the heartbeat's report is recorded."""
    fingerprint = _inputs_fingerprint(node)
    cached = _cache.get(node.pk)
    if cached is not None and cached[0] == fingerprint:
        version, desired = cached[1], cached[2]
    else:
        desired = node_desired_state_build(node=node)
        version = desired_version_of(desired)
        if len(_cache) >= CACHE_MAX_NODES:
            _cache.clear()
        _cache[node.pk] = (fingerprint, version, desired)
    return (None if held_version == version else desired), version
