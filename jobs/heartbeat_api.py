"""POST /api/agent/heartbeat/ answered before Django and DRF when it can be (HeartbeatRouter,
mounted in portal/asgi.py; issue 18: a full heartbeat's web CPU).

Through Django a full heartbeat paid, besides its own work (jobs.heartbeats.node_heartbeat_answer):
Django's ASGI request and its thread (one per request), ten middlewares, DRF's dispatch,
authentication, parsing and rendering, and a database connection checked out of the pool and
handed back per request (docs/devlog/2026-12-05/hb18.md has the profile). This path answers the
common case -- `Authorization: Node <token>` of an enrolled node, a JSON body that decodes as a
protocol.node.Heartbeat -- by calling the same service in the one sync thread that keeps its
connection (as jobs/submit_api.py does), and renders the answer as DRF would.

Its common case under MERIDIAN_HEARTBEAT_FOLD=async -- the agent holds the current desired state,
so the heartbeat is queued for the folder (jobs/heartbeat_fold.py) -- is answered on the event loop
(_queued_answer, issue 18: a full heartbeat cost 3-4 leases of web CPU, and ~45% of the agents'
minute; docs/devlog/2026-12-06/hb24.md has the profile):
  * the token maps to its node through the lease's per-process digest map (fleet.lease_api), not a
    query of its own;
  * the node's desired serial is read (one packed Redis command on the lease's connections) before
    the version check, as jobs.heartbeats reads it before the desired state is built;
  * one statement in Django's sync thread checks, on the node's row as it is now, that the token is
    still the node's (a revoked or rotated token is refused at once, as before: the map only names
    which row to read), that the node is not lost, and that the desired state's inputs are unchanged
    since this process built the version the agent holds (jobs.desired_version);
  * the queue's script runs packed on the same connections (jobs.heartbeat_fold.heartbeat_enqueue_packed).
Whatever it cannot answer so -- a token not in the map, a node lost or gone, a desired state
changed or never built in this process, Redis unreachable, the backlog full, a database error --
takes the full path below, which is unchanged: nothing was written yet (but for the one case of a
queue script whose answer was lost after it ran: the folder coalesces the beat queued twice).

It answers only what Django would answer 200 (and the errors of the service itself, as the API's
exception handler would: the write may have committed). Everything else goes to Django with its
body replayed, which gives today's answer: a missing, unknown or revoked token (401, checked before
the body as DRF does), a body that is not a Heartbeat (400 naming the field), a body over
FAST_BODY_MAX or without Content-Length, another content type or Accept, a query string, a host
Django would refuse, a plain-HTTP request SECURE_SSL_REDIRECT would redirect. A token is checked in
the database on every heartbeat, as DRF's authentication does: a revoked token is refused at once.
tests/jobs/test_heartbeat_fast_path.py compares each kind of answer with Django's.
MERIDIAN_HEARTBEAT_FAST_PATH=0 sends every heartbeat to Django.
"""
from __future__ import annotations

import json
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError

from jobs.submit_api import (
    ErrorAnswer,
    FastPathRouter,
    _headers,
    _read_body,
    _replaying,
    _request_checks,
    connection_kept_checked,
    response_headers,
)
from observability.metrics import heartbeat_observed
from protocol.node import Heartbeat, HeartbeatAnswer

logger = logging.getLogger(__name__)

HEARTBEAT_PATH = "/api/agent/heartbeat/"
# A heartbeat reports every copy on the node; one with hundreds of reports goes through Django
# (whose limit, DATA_UPLOAD_MAX_MEMORY_SIZE, answers 413s).
FAST_BODY_MAX = 256 * 1024
ALLOW = b"POST, OPTIONS"  # what DRF's Allow header says of NodeHeartbeatApi

FALLBACK = object()


def _node_token(headers) -> str | None:
    """Returns the token of `Authorization: Node <token>` as jobs.agent_apis reads it, or None."""
    parts = headers.get(b"authorization", b"").split()
    if len(parts) != 2 or parts[0].lower() != b"node":
        return None
    try:
        return parts[1].decode()
    except UnicodeError:
        return None  # DRF decodes with errors="replace": its 401 then


def _version_current(node_id: int, digest: str, held_version: str) -> bool:
    """In Django's sync thread: jobs.desired_version.node_desired_version_current (False on a
    database error: the full path meets it and answers it)."""
    from django.db import connection

    from jobs.desired_version import node_desired_version_current

    connection_kept_checked(connection)
    try:
        return node_desired_version_current(node_id=node_id, token_digest=digest, held_version=held_version)
    except DatabaseError:
        return False


async def _queued_answer(token: str, heartbeat: Heartbeat, wire: dict, body: bytes) -> HeartbeatAnswer | None:
    """Returns the answer of a heartbeat queued for the folder without its report recorded here, or
    None when the full path must answer it (see the module doc: nothing was written then)."""
    from fleet.lease_api import desired_serial_fetch, node_of_token_digest
    from fleet.leases import lease_store, redis_errors
    from fleet.models import node_token_hash
    from jobs.heartbeat_fold import heartbeat_enqueue_packed
    from jobs.heartbeats import heartbeat_answer_of

    if lease_store() is None:
        return None  # Redis was found unreachable moments ago: the full path records it in the request
    digest = node_token_hash(token)
    try:
        node_id = await node_of_token_digest(digest)
    except DatabaseError:
        return None
    if node_id is None:
        return None  # unknown or revoked: Django's 401
    try:
        # Read before the version is checked (jobs/heartbeats.py: the serial counts only changes
        # the checked state includes).
        serial = await desired_serial_fetch(node_id)
        if not await sync_to_async(_version_current)(node_id, digest, heartbeat.desired_version):
            return None
        outcome = await heartbeat_enqueue_packed(node_id=node_id, token_digest=digest, wire=wire, body=body,
                                                 now=time.time())
    except redis_errors() as exc:
        logger.warning("heartbeat: Redis unreachable (%s); answered by the full path", exc)
        return None
    if outcome is None:
        return None  # the backlog is full: recorded in the request
    return heartbeat_answer_of(outcome, desired=None, version=heartbeat.desired_version, serial=serial)


def _heartbeat(token: str, heartbeat: Heartbeat, wire: dict, body: bytes):
    """In Django's sync thread: returns the HeartbeatAnswer, or FALLBACK when Django must answer
    (nothing was written). Raises what the service raised."""
    from django.db import connection

    from fleet.selectors import node_get_by_token
    from jobs.heartbeats import node_heartbeat_answer

    # This thread keeps its connection between heartbeats (see jobs.submit_api._submit); one that
    # saw an error is checked, and dropped if broken. Not inside a test's transaction.
    connection_kept_checked(connection)
    try:
        node = node_get_by_token(token=token)
    except DatabaseError:
        return FALLBACK  # Django meets the same error and answers it
    if node is None:
        return FALLBACK  # Django's 401
    return node_heartbeat_answer(node=node, heartbeat=heartbeat, wire=wire, body=body)


async def _answer(send, status: int, body: bytes, *, host: str, secure: bool, extra=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*response_headers(host=host, secure=secure, length=len(body), allow=ALLOW), *extra]})
    await send({"type": "http.response.body", "body": body})
    heartbeat_observed(status=status)  # portal.metrics.HeartbeatMetricsMiddleware counts Django's


async def heartbeat_app(scope, receive, send, *, django_app, error_answer: ErrorAnswer) -> None:
    """The ASGI application of POST /api/agent/heartbeat/ (see the module doc); `django_app`
    answers what it does not."""
    from rest_framework.renderers import JSONRenderer

    headers = _headers(scope)
    checked = _request_checks(scope, headers) if headers is not None else None
    token = _node_token(headers) if checked is not None else None
    declared = headers.get(b"content-length", b"") if headers is not None else b""
    if token is None or not declared.isdigit() or int(declared) > FAST_BODY_MAX:
        await django_app(scope, receive, send)
        return
    body, messages = await _read_body(receive, limit=FAST_BODY_MAX)
    heartbeat = wire = None
    if body is not None:
        try:
            wire = json.loads(body.decode("utf-8"))
            heartbeat = Heartbeat.from_dict(wire)
        except (ValueError, RecursionError):  # ProtocolError is a ValueError
            heartbeat = None
    if heartbeat is None:
        await django_app(scope, _replaying(messages, receive), send)
        return
    host, secure = checked
    if heartbeat.desired_version is not None and settings.MERIDIAN_HEARTBEAT_FOLD == "async":
        try:
            answer = await _queued_answer(token, heartbeat, wire, body)
        except Exception:  # noqa: BLE001 - a bug here must cost the full path, not a 500
            logger.exception("heartbeat: the path on the event loop failed; answered by the full path")
            answer = None
        if answer is not None:
            await _answer(send, 200, JSONRenderer().render(answer.to_dict()), host=host, secure=secure)
            return
    try:
        answer = await sync_to_async(_heartbeat)(token, heartbeat, wire, body)
    except Exception as exc:  # noqa: BLE001 - the service failed: answered as DRF would, not replayed
        status, data, extra = error_answer(exc)
        await _answer(send, status, JSONRenderer().render(data), host=host, secure=secure,
                      extra=[(name.encode(), value.encode()) for name, value in extra.items()])
        return
    if answer is FALLBACK:
        await django_app(scope, _replaying(messages, receive), send)
        return
    await _answer(send, 200, JSONRenderer().render(answer.to_dict()), host=host, secure=secure)


def HeartbeatRouter(app, *, error_answer: ErrorAnswer) -> FastPathRouter:  # noqa: N802 - used as a class
    """POST /api/agent/heartbeat/ to heartbeat_app, everything else to `app`."""
    return FastPathRouter(app, path=HEARTBEAT_PATH, handler=heartbeat_app, enabled="MERIDIAN_HEARTBEAT_FAST_PATH",
                          error_answer=error_answer)
