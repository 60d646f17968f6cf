"""POST /api/agent/lease/: the agents' liveness beat, answered before Django and DRF (portal/asgi.py).

A full heartbeat through Django/DRF costs ~10-34 ms of web-process CPU (auth, parsing, the report,
the desired state; docs/devlog/2026-12-01/scale-tick.md). A node that has nothing to report only
needs to say "alive" and learn whether its desired state changed; this raw ASGI handler does that:

    Authorization: Node <token>     body {"v": 1, "node_id": N}  (protocol.node.Lease, <= MAX_BODY_BYTES)
    -> 200 LeaseAnswer {node_id, desired_serial, lease_seconds, full_heartbeat_seconds, lost_after_seconds}

  * The token is checked against a per-process map of token digests (SHA-256, as stored in
    Node.agent_token_hash; node tokens are 256-bit random, so a digest lookup is safe) reloaded from
    the database every MERIDIAN_LEASE_TOKEN_CACHE_SECONDS: a revoked or rotated token is refused
    within that delay at most (the full heartbeat, register and logs refuse it at once). A digest not
    in the map is looked up once (a node enrolled since the reload) and a miss is remembered until
    the next reload, so a flood of bad tokens costs no database queries.
  * The lease is one Redis command: a short Lua script (EVALSHA) that does HSET meridian:lease <node>
    <now> and answers HGET meridian:desired-serial <node> (fleet/leases.py). It was a pipeline of the
    two commands; redis-py packs, sends and parses each command and runs a pipeline's own machinery
    in Python, and that was half the lease's CPU in process (bench/lease_profile.py). Since session
    22 the command is packed once (but for the node id and the time) and sent on redis-py's own
    connections without its client's per-command machinery (LeaseConnections): the Redis call 1.5-2x
    cheaper in CPU; reconnect after a Redis restart, the timeouts and the NOSCRIPT reload are kept
    (tests/fleet/test_node_lease.py).
  * It proves liveness only: no report, no telemetry, no change of desired state, no way back from
    "lost" (that takes a full heartbeat). Fencing is unchanged.

Answers: 401 (no, unknown or revoked token; WWW-Authenticate: Node), 403 (node_id is another
node's), 400 (not JSON, or not a Lease: names the field), 405 (not POST), 413 (body too large),
503 (Redis or the database unreachable: the agent sends a full heartbeat instead). Never a 500.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import weakref

from asgiref.sync import sync_to_async
from django.conf import settings

from fleet.leases import DESIRED_SERIAL_KEY, LEASE_KEY
from observability import metrics
from protocol import ProtocolError
from protocol.node import Lease, LeaseAnswer

logger = logging.getLogger(__name__)

LEASE_PATH = "/api/agent/lease/"
MAX_BODY_BYTES = 1024
MISSES_MAX = 100_000  # remembered unknown digests per process; beyond it the memory starts over
# The lease's one Redis command (see the module doc): its time written, its node's serial read.
LEASE_SCRIPT = "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) return redis.call('HGET', KEYS[2], ARGV[1])"
LEASE_SCRIPT_SHA = hashlib.sha1(LEASE_SCRIPT.encode()).hexdigest()


def _connection_fresh() -> None:
    """Drops this thread's database connection if it is broken or past its age, as Django does
    around each request (these queries run between requests). Not inside a transaction (a test's)."""
    from django.db import close_old_connections, connection

    if not connection.in_atomic_block:
        close_old_connections()


class NodeTokenDigests:
    """The per-process map {token digest: node id}, reloaded whole every `ttl` seconds."""

    def __init__(self):
        self.digests: dict[str, int] = {}
        self.misses: set[str] = set()
        self.loaded_at: float | None = None
        self.lock = asyncio.Lock()

    @staticmethod
    def _load() -> dict[str, int]:
        from fleet.models import Node

        _connection_fresh()
        return dict(Node.objects.exclude(agent_token_hash="").values_list("agent_token_hash", "pk"))

    @staticmethod
    def _lookup(digest: str) -> int | None:
        from fleet.models import Node

        _connection_fresh()
        return Node.objects.filter(agent_token_hash=digest).values_list("pk", flat=True).first()

    async def node_of(self, digest: str, *, now: float, ttl: float) -> int | None:
        """Returns the node whose token has `digest`, or None (unknown or revoked)."""
        if self.loaded_at is None or now - self.loaded_at >= ttl:
            async with self.lock:
                if self.loaded_at is None or now - self.loaded_at >= ttl:
                    # thread_sensitive: the ORM runs in Django's own sync thread, as its views do
                    self.digests = await sync_to_async(self._load)()
                    self.misses = set()
                    self.loaded_at = now
        node_id = self.digests.get(digest)
        if node_id is None and digest not in self.misses:
            node_id = await sync_to_async(self._lookup)(digest)
            if node_id is None:
                if len(self.misses) >= MISSES_MAX:
                    self.misses.clear()
                self.misses.add(digest)
            else:
                self.digests[digest] = node_id
        return node_id


_tokens = NodeTokenDigests()


def _bulk(value: bytes) -> bytes:
    """Returns `value` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def command_packed(*arguments: bytes) -> bytes:
    """Returns a Redis command of `arguments` in RESP, Redis's wire format (an array of bulk strings)."""
    return b"*%d\r\n" % len(arguments) + b"".join(_bulk(argument) for argument in arguments)


def _lease_command_prefix(name: bytes, script_or_sha: bytes) -> bytes:
    """Returns the lease's command up to its two per-call arguments (node id, time), packed once: an
    array of 7 bulk strings in RESP, Redis's wire format."""
    return (b"*7\r\n" + _bulk(name) + _bulk(script_or_sha) + _bulk(b"2")
            + _bulk(LEASE_KEY.encode()) + _bulk(DESIRED_SERIAL_KEY.encode()))


EVALSHA_PREFIX = _lease_command_prefix(b"EVALSHA", LEASE_SCRIPT_SHA.encode())
EVAL_PREFIX = _lease_command_prefix(b"EVAL", LEASE_SCRIPT.encode())
LEASE_REDIS_TIMEOUT_SECONDS = 2.0  # connect, write and read: a Redis slower than this is a 503
IDLE_CONNECTIONS_MAX = 64  # per process; more leases in flight at once open (then close) more


class LeaseConnections:
    """One event loop's Redis connections for the lease's one command.

    The connections are redis-py's own (its connect and handshake, AUTH, TLS, the socket timeouts,
    the RESP parser, hiredis when installed, its error types); what is left out is the client's
    per-command machinery around them: the pool's lock and health check, the retry object, the
    observability hooks, the argument encoder and the response callbacks. hb21's profile put about
    half the lease's CPU in process there (bench/lease_profile.py). The command is packed once but
    for its two per-call arguments.

    Idle connections wait in a list (one event loop, so no lock): a lease takes one or opens one,
    and gives it back only after reading its whole answer; on any error the connection is closed,
    never reused half-read."""

    def __init__(self, url: str):
        import redis.asyncio

        # redis-py parses the URL (redis://, rediss://, unix://, credentials, db) and makes the
        # connections; this pool object is never asked for one.
        self.factory = redis.asyncio.ConnectionPool.from_url(
            url, socket_timeout=LEASE_REDIS_TIMEOUT_SECONDS,
            socket_connect_timeout=LEASE_REDIS_TIMEOUT_SECONDS)
        self.idle: list = []

    async def _round_trip(self, connection, command: bytes):
        await connection.send_packed_command(command, check_health=False)  # connects if closed
        return await connection.read_response()

    async def call(self, prefix: bytes, node_id: int, now: float):
        """Returns the answer of the command `prefix` + node id + time: the serial (bytes or None).
        Raises redis-py's errors (ConnectionError, TimeoutError, NoScriptError, ...)."""
        return await self.execute(prefix + _bulk(str(node_id).encode()) + _bulk(repr(now).encode()))

    async def execute(self, command: bytes):
        """Returns the answer of `command` (packed: command_packed), parsed by redis-py's parser. Raises
        redis-py's errors. A command sent again after a dropped idle connection must be harmless to
        repeat (the lease's, the heartbeat's reads and its queue script: see call)."""
        from redis.exceptions import ConnectionError as RedisConnectionError

        reused = bool(self.idle)
        connection = self.idle.pop() if reused else self.factory.make_connection()
        try:
            try:
                answer = await self._round_trip(connection, command)
            except RedisConnectionError:
                if not reused:
                    raise
                # An idle connection that Redis closed meanwhile (a restart, CLIENT KILL, an idle
                # timeout) fails on its first use; one try on a new connection, as redis-py's client
                # retries. Sending the lease again is harmless: it writes the same time again.
                await connection.disconnect()
                answer = await self._round_trip(connection, command)
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        if len(self.idle) < IDLE_CONNECTIONS_MAX:
            self.idle.append(connection)
        else:
            await connection.disconnect()
        return answer


# {event loop: {Redis URL: LeaseConnections}}: a connection belongs to the loop it was opened on.
_lease_connections: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def redis_connections() -> LeaseConnections:
    """Returns this event loop's lease connections to settings.REDIS_URL (also the full heartbeat's:
    jobs/heartbeat_api.py)."""
    by_url = _lease_connections.setdefault(asyncio.get_running_loop(), {})
    connections = by_url.get(settings.REDIS_URL)
    if connections is None:
        connections = by_url[settings.REDIS_URL] = LeaseConnections(settings.REDIS_URL)
    return connections


async def _lease_record(node_id: int, now: float):
    """Writes node `node_id`'s lease at `now` and returns its desired serial (bytes, or None before its
    first bump), in one Redis command."""
    from redis.exceptions import NoScriptError

    connections = redis_connections()
    try:
        return await connections.call(EVALSHA_PREFIX, node_id, now)
    except NoScriptError:  # a Redis restarted (or its scripts flushed) since: EVAL caches it again
        return await connections.call(EVAL_PREFIX, node_id, now)


async def desired_serial_fetch(node_id: int) -> int:
    """Returns node `node_id`'s desired serial (0 before its first bump; fleet.leases.desired_serial_of
    on this event loop's connections). Raises redis-py's errors."""
    serial = await redis_connections().execute(
        command_packed(b"HGET", DESIRED_SERIAL_KEY.encode(), str(node_id).encode()))
    return int(serial or 0)


async def node_of_token_digest(digest: str) -> int | None:
    """Returns the node whose token's digest is `digest` in this process's map, or None: what a lease
    is told (a token revoked or rotated may still map for MERIDIAN_LEASE_TOKEN_CACHE_SECONDS; a
    caller that must refuse it at once checks the node's row: jobs/heartbeat_api.py). Raises the
    database's errors."""
    return await _tokens.node_of(digest, now=time.monotonic(), ttl=settings.MERIDIAN_LEASE_TOKEN_CACHE_SECONDS)


def tokens_forget() -> None:
    """Drops this process's token map (tests; the next lease reloads it)."""
    global _tokens
    _tokens = NodeTokenDigests()


async def _answer(send, status: int, body: dict, *, headers=()) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})
    metrics.lease_observed(status=status)


async def _body(scope, receive) -> bytes | None:
    """Returns the request body, or None when it is (or says it will be) over MAX_BODY_BYTES."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                if int(value) > MAX_BODY_BYTES:
                    return None
            except ValueError:
                return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _token(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            parts = value.split()
            if len(parts) == 2 and parts[0].lower() == b"node":
                return parts[1].decode("latin-1")
            return None
    return None


async def lease_app(scope, receive, send) -> None:
    """The ASGI application of POST /api/agent/lease/ (see the module doc)."""
    if scope["method"] != "POST":
        await _answer(send, 405, {"detail": "use POST"}, headers=[(b"allow", b"POST")])
        return
    token = _token(scope)
    body = await _body(scope, receive)
    if body is None:
        await _answer(send, 413, {"detail": f"a lease body is at most {MAX_BODY_BYTES} bytes"})
        return
    if not token:
        await _answer(send, 401, {"detail": "send Authorization: Node <node token>"},
                      headers=[(b"www-authenticate", b"Node")])
        return
    now = time.time()
    try:
        node_id = await node_of_token_digest(hashlib.sha256(token.encode("utf-8", "replace")).hexdigest())
    except Exception as exc:  # noqa: BLE001 - the database is down: the agent falls back, no 500
        logger.warning("lease: node tokens could not be read: %s", exc)
        await _answer(send, 503, {"detail": "node tokens unavailable; send a full heartbeat"})
        return
    if node_id is None:
        await _answer(send, 401, {"detail": "unknown or revoked node token; register the agent again "
                                            "with the enrollment token"}, headers=[(b"www-authenticate", b"Node")])
        return
    try:
        lease = Lease.from_dict(json.loads(body))
    except (ValueError, UnicodeDecodeError) as exc:
        problem = exc.problem if isinstance(exc, ProtocolError) else "the body is not JSON"
        field = (exc.field if isinstance(exc, ProtocolError) else "") or "non_field_errors"
        detail = problem if field == "non_field_errors" else f"{field}: {problem}"
        await _answer(send, 400, {"detail": detail, field: [problem]})
        return
    if lease.node_id != node_id:
        await _answer(send, 403, {"detail": "a node may lease only for itself"})
        return
    try:
        serial = await _lease_record(node_id, now)
    except Exception as exc:  # noqa: BLE001 - Redis down or restarting: the agent falls back, no 500
        logger.warning("lease: Redis unreachable: %s", exc)
        await _answer(send, 503, {"detail": "the lease store is unreachable; send a full heartbeat"})
        return
    answer = LeaseAnswer(node_id=node_id, desired_serial=int(serial or 0),
                         lease_seconds=float(settings.MERIDIAN_AGENT_HEARTBEAT_SECONDS),
                         full_heartbeat_seconds=float(settings.MERIDIAN_AGENT_FULL_HEARTBEAT_SECONDS),
                         lost_after_seconds=float(settings.MERIDIAN_NODE_LOST_AFTER_SECONDS))
    await _answer(send, 200, answer.to_dict())


class LeaseRouter:
    """ASGI middleware: POST /api/agent/lease/ goes to lease_app, everything else to `app` (Django)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == LEASE_PATH:
            await lease_app(scope, receive, send)
        else:
            await self.app(scope, receive, send)
