"""POST /api/jobs/ answered before Django and DRF when it can be (the submission's fast path;
SubmitRouter, mounted in portal/asgi.py; issue 18: Slurm's submission rate).

Through Django, middleware and DRF, a submission cost ~13 ms of web-process CPU in process (~20 ms
under daphne at load), of which the job's own writes were a fraction: DRF's authentication, input
and output serializers, three ORM queries to find the user's team, the ORM's statement compilation
and the live push through async_to_sync (docs/devlog/2026-12-02/submit.md has the profile). This
path answers the common case -- a member's API token, a plain JSON job spec, a team that has room
-- with two statements: jobs.selectors.submitter_by_token (the token, its user and their teams in
one query) and jobs.services.job_submit_direct (the claim, the job, its replicas and its event in
one statement on PostgreSQL).

It answers only 201s. Every request it does not accept as certainly good goes to Django unchanged
(its body replayed), which gives today's answer, error bodies included: no Authorization: Token
header (sessions, with their CSRF check), a bad, unknown or inactive token, a superuser, any field
that is not a plain JSON value of the expected type, an unknown field, a spec that
job_spec_clean, the bundle's resolution or the size check refuses, an ambiguous or unknown team, a team over its quota
(or without a claim counter for the type yet), another Accept than JSON, a query string, a host
Django would refuse, a plain-HTTP request that SECURE_SSL_REDIRECT would redirect, a body over
FAST_BODY_MAX or without Content-Length, and any database error before the write. So the rules
live in one place each: the fast path's checks only decide "certainly like DRF would", and
tests/jobs/test_submit_fast_path.py proves each kind of answer equal to Django's. What it accepts
it answers with the same status, headers and body (JobOutputSerializer, DRF's JSON renderer).

A database error in the write itself is answered as the API's exception handler would (the
`error_answer` portal passes in: 503 with Retry-After when the database is busy, else 500), not
replayed: the statement may have committed. MERIDIAN_SUBMIT_FAST_PATH=0 sends everything to Django.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import DatabaseError
from django.http.request import split_domain_port, validate_host
from rest_framework.renderers import JSONRenderer

from fleet.live import group_for_team

logger = logging.getLogger(__name__)

SUBMIT_PATH = "/api/jobs/"
# Bodies above this go to Django (whose limit, DATA_UPLOAD_MAX_MEMORY_SIZE, answers 413s): a job
# spec is a few hundred bytes, and a large one pays Django's cost anyway.
FAST_BODY_MAX = 64 * 1024
JSON_TYPES = {b"application/json", b"application/json; charset=utf-8", b"application/json;charset=utf-8"}
ACCEPT_JSON = {b"", b"*/*", b"application/json"}

_renderer = JSONRenderer()


# The fields whose value is one of the serializer's choices (and, left out, its default).
CHOICE_FIELDS = ("tier", "accelerator_type", "if_resume_refused", "network")


class _Spec:
    """What JobSubmitApi.InputSerializer accepts, narrowed to plain JSON values of each field's own
    type, read once from the serializer itself (names, lengths, choices) so the rules stay there."""

    def __init__(self):
        from jobs.apis import JobSubmitApi

        fields = JobSubmitApi.InputSerializer().fields
        self.names = frozenset(fields)
        self.max_length = {name: fields[name].max_length for name in ("name", "entrypoint")}
        self.choices = {name: frozenset(fields[name].choices) for name in CHOICE_FIELDS}
        self.defaults = {name: fields[name].get_default() for name in
                         ("tier", "min_devices", "if_resume_refused", "network")}
        self.integer_range = {name: (fields[name].min_value, fields[name].max_value)
                              for name in ("world_size", "min_devices", "total_steps")}
        self.args_max = fields["args"].max_length
        self.bundle_max = fields["bundle"].max_length


_spec_rules: _Spec | None = None


def _plain_text(value) -> str | None:
    """Returns the text as DRF's CharField keeps it (stripped), or None unless it is certainly
    accepted: a str without NUL or surrogate characters (DRF refuses both)."""
    if type(value) is not str or "\x00" in value:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800")
        return None
    return value.strip()


def spec_if_plain(data) -> tuple[str | None, dict] | None:
    """Returns (the team reference or None, the job spec) as JobSubmitApi's InputSerializer would
    validate `data` (the parsed JSON body), or None when DRF must decide (see the module doc)."""
    global _spec_rules
    rules = _spec_rules = _spec_rules or _Spec()
    if type(data) is not dict or not data.keys() <= rules.names:
        return None
    spec: dict = {}
    for name in ("name", "entrypoint"):
        text = _plain_text(data.get(name))
        if not text or len(text) > rules.max_length[name]:
            return None
        spec[name] = text
    for name in CHOICE_FIELDS:
        if name not in data and name in rules.defaults:
            spec[name] = rules.defaults[name]
            continue
        value = data.get(name)
        if type(value) is not str or value not in rules.choices[name]:
            return None
        spec[name] = value
    for name in ("world_size", "min_devices", "total_steps"):
        if name not in data and name != "world_size":
            if name in rules.defaults:
                spec[name] = rules.defaults[name]
            continue
        value = data.get(name)
        if value is None and name == "total_steps":
            spec[name] = None
            continue
        low, high = rules.integer_range[name]
        if type(value) is not int or value < low or (high is not None and value > high):
            return None
        spec[name] = value
    args = data.get("args", [])
    if type(args) is not list or len(args) > rules.args_max:
        return None
    spec["args"] = [_plain_text(arg) for arg in args]
    if None in spec["args"]:
        return None
    env = data.get("env", {})
    if type(env) is not dict:
        return None
    spec["env"] = {key: _plain_text(value) for key, value in env.items()}
    if None in spec["env"].values():
        return None
    if data.get("bundle") is not None:
        # a digest; job_submit_direct resolves it as job_submit does (bundle_resolve_for_submit:
        # one query; an unknown digest or an entrypoint outside it is Django's 400)
        bundle = _plain_text(data["bundle"])
        if not bundle or len(bundle) > rules.bundle_max:
            return None
        spec["bundle"] = bundle
    elif "bundle" in data:
        spec["bundle"] = None
    team = data.get("team")
    if team is not None:
        team = _plain_text(team)
        if not team:
            return None
    elif "team" in data:
        return None  # null: DRF's "This field may not be null."
    return team, spec


def _headers(scope) -> dict[bytes, bytes] | None:
    """Returns the request's headers by lowercase name, or None when one repeats or has an
    underscore (Django would join them, or read "X_Forwarded_Proto" as "X-Forwarded-Proto": its
    answer then)."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name in headers or b"_" in name:
            return None
        headers[name] = value
    return headers


def _request_checks(scope, headers) -> tuple[str, bool] | None:
    """Returns (the host, whether the request is secure) when Django's middleware would let the
    request through to the view unchanged and DRF would answer it with its JSON renderer; None
    when Django must answer (a host ALLOWED_HOSTS refuses, an SSL redirect, content negotiation)."""
    if scope.get("query_string") or scope.get("root_path") or settings.USE_X_FORWARDED_HOST:
        return None
    if headers.get(b"content-type", b"").lower() not in JSON_TYPES:
        return None
    if headers.get(b"accept", b"").strip().lower() not in ACCEPT_JSON:
        return None
    host = headers.get(b"host", b"").decode("latin-1")
    domain, _port = split_domain_port(host)
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    if not domain or not validate_host(domain, allowed):
        return None
    secure = scope.get("scheme") == "https"
    if settings.SECURE_PROXY_SSL_HEADER:
        header, secure_value = settings.SECURE_PROXY_SSL_HEADER
        forwarded = headers.get(header.removeprefix("HTTP_").replace("_", "-").lower().encode("latin-1"))
        if forwarded is not None:
            secure = forwarded.decode("latin-1").split(",", 1)[0].strip() == secure_value
    if settings.SECURE_SSL_REDIRECT and not secure:
        return None
    if any(pattern.search(headers.get(b"user-agent", b"").decode("latin-1"))
           for pattern in settings.DISALLOWED_USER_AGENTS):
        return None
    return host, secure


def _token(headers) -> str | None:
    """Returns the key of `Authorization: Token <key>` as DRF's TokenAuthentication reads it, or
    None when DRF must decide (no such header: session authentication and its CSRF check)."""
    parts = headers.get(b"authorization", b"").split()
    if len(parts) != 2 or parts[0].lower() != b"token":
        return None
    try:
        return parts[1].decode()
    except UnicodeError:
        return None


def response_headers(*, host: str, secure: bool, length: int,
                     allow: bytes = b"GET, POST, HEAD, OPTIONS") -> list[tuple[bytes, bytes]]:
    """Returns the headers Django's middleware and DRF give a 201 of POST /api/jobs/ (or a JSON
    answer of another API view whose methods are `allow`), in their order."""
    headers = [(b"Content-Type", b"application/json"), (b"Vary", b"Accept"), (b"Allow", allow)]
    policy = settings.MERIDIAN_CONTENT_SECURITY_POLICY
    if policy:
        headers.append((b"Content-Security-Policy", policy.replace("{host}", host).encode("latin-1")))
    if settings.X_FRAME_OPTIONS:
        headers.append((b"X-Frame-Options", settings.X_FRAME_OPTIONS.upper().encode("latin-1")))
    headers.append((b"Content-Length", str(length).encode()))
    if settings.SECURE_HSTS_SECONDS and secure:
        hsts = f"max-age={settings.SECURE_HSTS_SECONDS}"
        if settings.SECURE_HSTS_INCLUDE_SUBDOMAINS:
            hsts += "; includeSubDomains"
        if settings.SECURE_HSTS_PRELOAD:
            hsts += "; preload"
        headers.append((b"Strict-Transport-Security", hsts.encode()))
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append((b"X-Content-Type-Options", b"nosniff"))
    referrer = settings.SECURE_REFERRER_POLICY
    if referrer:
        value = referrer if isinstance(referrer, str) else ",".join(referrer)
        headers.append((b"Referrer-Policy", value.encode("latin-1")))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append((b"Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY.encode("latin-1")))
    return headers


async def _read_body(receive, *, limit: int = FAST_BODY_MAX) -> tuple[bytes | None, list[dict]]:
    """Returns (the body, or None when over `limit` bytes or the client left; the messages read,
    to replay to Django)."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return None, messages
        size += len(message.get("body", b""))
        if size > limit:
            return None, messages
        if not message.get("more_body", False):
            return b"".join(m.get("body", b"") for m in messages), messages


def _replaying(messages: list[dict], receive):
    """Returns an ASGI receive that gives `messages` again, then reads on."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


FALLBACK = object()


def _submit(key: str, team_ref: str | None, spec: dict):
    """In Django's sync thread: returns the new Job (committed), or FALLBACK when Django must
    answer (nothing was written). Raises what the write raised."""
    from django.db import connection

    from jobs.selectors import submitter_by_token
    from jobs.services import job_submit_direct

    # This thread (asgiref's one thread for thread-sensitive code outside a request of Django's)
    # keeps its connection between submissions, where Django's handler opens one per request
    # (CONN_MAX_AGE 0): reconnecting costs ~1 ms on SQLite (Django registers its SQL functions on
    # each new connection) and a pool round trip on PostgreSQL. It never holds a transaction
    # open between them. One that saw an error is checked, and dropped if broken (the next
    # statement reconnects). Not inside a test's transaction.
    connection_kept_checked(connection)
    try:
        submitter = submitter_by_token(key=key)
    except DatabaseError:
        return FALLBACK  # Django meets the same error and answers it
    if submitter is None or submitter.user.is_superuser:
        return FALLBACK
    if team_ref is None:
        teams = submitter.teams if len(submitter.teams) == 1 else ()
    else:
        teams = tuple(t for t in submitter.teams if team_ref in {t.slug, str(t.pk)})
    if len(teams) != 1 or not isinstance(teams[0].quotas, dict) \
            or type(teams[0].quotas.get(spec["accelerator_type"], 0)) is not int:
        return FALLBACK  # Team.quota_for's int() of an odd value: Django's answer
    try:
        job = job_submit_direct(team=teams[0], submitted_by=submitter.user, spec=spec)
    except ValidationError:
        return FALLBACK  # nothing written; DRF's answer names the field
    return FALLBACK if job is None else job


async def _publish(job) -> None:
    """Sends the new job's "jobs.job_updated" to its team's group (as job_submit's on-commit push
    does); best effort, like fleet.live.events_publish_now."""
    from channels.layers import get_channel_layer

    from jobs.services import job_updated_message

    message = job_updated_message(job=job)
    try:
        layer = get_channel_layer()
        if layer is not None:
            await layer.group_send(group_for_team(job.team_id), message)
    except Exception:  # noqa: BLE001 - a live push never fails a committed submission
        logger.warning("could not publish %s to %s", message["type"], group_for_team(job.team_id), exc_info=True)


async def _answer(send, status: int, data, *, host: str, secure: bool, extra=()) -> None:
    body = _renderer.render(data)
    await send({"type": "http.response.start", "status": status,
                "headers": [*response_headers(host=host, secure=secure, length=len(body)), *extra]})
    await send({"type": "http.response.body", "body": body})


_output = None


def _job_answer(job) -> dict:
    """Returns JobOutputSerializer(job).data, from one serializer built once per process (its
    fields are built per instance, ~1 ms; they keep no state between calls)."""
    global _output
    if _output is None:
        from jobs.apis import JobOutputSerializer

        _output = JobOutputSerializer()
    return _output.to_representation(job)


ErrorAnswer = Callable[[Exception], "tuple[int, dict, dict[str, str]]"]


async def submit_app(scope, receive, send, *, django_app, error_answer: ErrorAnswer) -> None:
    """The ASGI application of POST /api/jobs/ (see the module doc); `django_app` answers what it
    does not."""
    import json

    headers = _headers(scope)
    checked = _request_checks(scope, headers) if headers is not None else None
    key = _token(headers) if checked is not None else None
    declared = headers.get(b"content-length", b"") if headers is not None else b""
    if key is None or not declared.isdigit() or int(declared) > FAST_BODY_MAX:
        await django_app(scope, receive, send)
        return
    body, messages = await _read_body(receive)
    accepted = None
    if body is not None:
        try:
            accepted = spec_if_plain(json.loads(body.decode("utf-8")))
        except (ValueError, RecursionError):
            accepted = None
    if accepted is None:
        await django_app(scope, _replaying(messages, receive), send)
        return
    host, secure = checked
    try:
        job = await sync_to_async(_submit)(key, *accepted)
    except Exception as exc:  # noqa: BLE001 - the write failed: answered, not replayed (it may have committed)
        status, data, extra = error_answer(exc)
        await _answer(send, status, data, host=host, secure=secure,
                      extra=[(name.encode(), value.encode()) for name, value in extra.items()])
        return
    if job is FALLBACK:
        await django_app(scope, _replaying(messages, receive), send)
        return
    await _publish(job)
    await _answer(send, 201, _job_answer(job), host=host, secure=secure)


def connection_kept_checked(connection) -> None:
    """The fast paths keep their thread's connection between requests: one that saw an error is
    checked, and dropped if broken (the next statement reconnects). Not inside a test's transaction."""
    if connection.errors_occurred and connection.connection is not None and not connection.in_atomic_block:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()


class FastPathRouter:
    """ASGI middleware: POST `path` goes to `handler` (a fast path, which hands what it does not
    answer to `app`) while settings.<enabled> holds, everything else to `app` (Django)."""

    def __init__(self, app, *, path: str, handler, enabled: str, error_answer: ErrorAnswer):
        self.app, self.path, self.handler, self.enabled = app, path, handler, enabled
        self.error_answer = error_answer

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["path"] == self.path and scope["method"] == "POST"
                and getattr(settings, self.enabled)):
            await self.handler(scope, receive, send, django_app=self.app, error_answer=self.error_answer)
        else:
            await self.app(scope, receive, send)


def SubmitRouter(app, *, error_answer: ErrorAnswer) -> FastPathRouter:  # noqa: N802 - used as a class
    """POST /api/jobs/ to submit_app, everything else to `app`."""
    return FastPathRouter(app, path=SUBMIT_PATH, handler=submit_app, enabled="MERIDIAN_SUBMIT_FAST_PATH",
                          error_answer=error_answer)
