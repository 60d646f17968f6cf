"""POST /api/agent/heartbeat/ answered before Django and DRF when it can be (HeartbeatRouter,
mounted in portal/asgi.py; issue 18: a full heartbeat's web CPU).

Through Django a full heartbeat paid, besides its own work (jobs.heartbeats.node_heartbeat_answer):
Django's ASGI request and its thread (one per request), ten middlewares, DRF's dispatch,
authentication, parsing and rendering, and a database connection checked out of the pool and
handed back per request (docs/devlog/2026-12-05/hb18.md has the profile). This path answers the
common case -- `Authorization: Node <token>` of an enrolled node, a JSON body that decodes as a
protocol.node.Heartbeat -- by calling the same service in the one sync thread that keeps its
connection (as jobs/submit_api.py does), and renders the answer as DRF would.

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

from asgiref.sync import sync_to_async
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
from protocol.node import Heartbeat

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
