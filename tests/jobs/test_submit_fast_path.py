"""POST /api/jobs/ answered before Django (jobs/submit_api.py) gives the answers Django and DRF
give: the same status, headers and body for what it accepts, and Django's own answer (the request
replayed to it) for everything else. Each case is sent twice through the real ASGI application
(portal.asgi), with MERIDIAN_SUBMIT_FAST_PATH on and off, and the two answers compared; whether
Django answered is seen from its request_started signal. On SQLite and on PostgreSQL (CI's second
pass)."""
import json
import random
import threading

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.conf import settings as django_settings
from django.core.exceptions import ValidationError
from django.core.signals import request_started
from django.db import connection
from rest_framework.authtoken.models import Token

from jobs.apis import JobSubmitApi
from jobs.models import Job, JobEvent, Replica, TeamQuotaClaim
from jobs.selectors import submitter_by_token
from jobs.services import _team_quota_claimed_recomputed, job_cancel, job_spec_clean, job_submit_direct, job_transition
from jobs.submit_api import FAST_BODY_MAX, SUBMIT_PATH, spec_if_plain

# Transactional: Django answers each ASGI request in its own thread (ThreadSensitiveContext), whose
# connection must see the test's rows.
pytestmark = pytest.mark.django_db(transaction=True)

# What differs between two submissions of the same body: the new row's id and the clock.
VOLATILE = {"id", "state_changed_at", "submitted_at"}


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def tokens(cast):
    """API tokens of the cast by name; bob's user is inactive. Teams A and B have their CPU claim
    counters (a team's first claim of a type goes through job_submit, which creates the counter:
    test_the_quota_counter_under_fast_submissions_cancel_and_finish)."""
    cast.bob.is_active = False
    cast.bob.save()
    for team in (cast.team_a, cast.team_b):
        TeamQuotaClaim.objects.create(team=team, accelerator_type="CPU", claimed=0)
    return {user.username: Token.objects.create(user=user).key
            for user in (cast.alice, cast.bob, cast.carol, cast.charlie, cast.admin)}


def post(body=None, *, token=None, raw=None, headers=(), fast=True, path=SUBMIT_PATH):
    """Returns (status, headers without Content-Length, body bytes, whether Django answered)."""
    from portal.asgi import application

    payload = raw if raw is not None else json.dumps(body).encode()
    defaults = [(b"host", b"testserver"), (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *([(b"authorization", f"Token {token}".encode())] if token else [])]
    names = {name for name, _ in headers}
    sent = [(name, value) for name, value in defaults if name not in names] + list(headers)
    django_answered = []

    def seen(**_):
        django_answered.append(True)

    request_started.connect(seen, weak=False)
    old = django_settings.MERIDIAN_SUBMIT_FAST_PATH
    django_settings.MERIDIAN_SUBMIT_FAST_PATH = fast
    try:
        communicator = HttpCommunicator(application, "POST", path, body=payload, headers=sent)
        response = async_to_sync(communicator.get_response)(timeout=20)
    finally:
        django_settings.MERIDIAN_SUBMIT_FAST_PATH = old
        request_started.disconnect(seen)
    # a new CSRF cookie (Django's browsable API page sets one) differs each time: its name is compared
    answer_headers = sorted((name.lower(), value.split(b"=")[0] if name.lower() == b"set-cookie" else value)
                            for name, value in response["headers"] if name.lower() != b"content-length")
    return response["status"], answer_headers, response["body"], bool(django_answered)


def _without_volatile(body: bytes):
    try:
        data = json.loads(body)
    except ValueError:
        return "(not JSON)"  # DRF's browsable API page: compared by status and headers only
    return {key: value for key, value in data.items() if key not in VOLATILE} if isinstance(data, dict) else data


def _job_row(job_id):
    job = Job.objects.get(pk=job_id)
    row = {f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields
           if f.attname not in {"id", "state_changed_at", "submitted_at", "updated_at"}}
    replicas = list(Replica.objects.filter(job=job).order_by("rank").values_list("rank", "device_id"))
    events = list(JobEvent.objects.filter(job=job).values_list("type", "from_state", "to_state", "reason", "actor_id",
                                                               "extra_data"))
    return row, replicas, events


GOOD_BODIES = {
    "minimal": {"team": "team-a", "name": "demo", "accelerator_type": "CPU", "world_size": 1, "entrypoint": "t.py"},
    "every field": {"team": "team-a", "name": "resnet", "tier": "premium", "accelerator_type": "CPU",
                    "world_size": 8, "min_devices": 2, "entrypoint": "train.py", "args": ["--epochs", "3", ""],
                    "env": {"LR": "0.1", "EMPTY": ""}, "total_steps": 100, "bundle": None,
                    "if_resume_refused": "restart", "network": "isolated"},
    "team left out": {"name": "demo", "accelerator_type": "CPU", "world_size": 2, "entrypoint": "t.py"},
    "whitespace is stripped as DRF strips it": {"team": " team-a ", "name": "  padded  ", "accelerator_type": "CPU",
                                                 "world_size": 1, "entrypoint": " t.py ", "args": ["  a ", "   "],
                                                 "env": {"K": "  v  "}},
    "null total_steps, unicode name": {"name": "entraînement ✓", "accelerator_type": "CPU", "world_size": 4,
                                       "min_devices": 4, "entrypoint": "t.py", "total_steps": None},
}


@pytest.mark.parametrize("body", GOOD_BODIES.values(), ids=GOOD_BODIES.keys())
def test_a_plain_submission_is_answered_before_django_exactly_as_django_answers_it(tokens, team_a, body):
    fast = post(body, token=tokens["alice"])
    slow = post(body, token=tokens["alice"], fast=False)

    assert fast[0] == slow[0] == 201, (fast, slow)
    assert fast[3] is False and slow[3] is True  # the first never reached Django
    assert fast[1] == slow[1]  # every header: CSP, X-Frame-Options, Vary, Allow, ...
    assert _without_volatile(fast[2]) == _without_volatile(slow[2])
    fast_id, slow_id = json.loads(fast[2])["id"], json.loads(slow[2])["id"]
    assert _job_row(fast_id) == _job_row(slow_id)  # the job, its replicas, its event
    claimed = TeamQuotaClaim.objects.get(team=team_a, accelerator_type="CPU").claimed
    assert claimed == _team_quota_claimed_recomputed(team_id=team_a.pk, accelerator_type="CPU")


def _django_middleware_reload():
    """Rebuilds the middleware of portal.asgi's Django handler (SecurityMiddleware reads its
    settings once, when the chain is built)."""
    from django.core.handlers.asgi import ASGIHandler

    from portal.asgi import application

    app = application.application_mapping["http"]
    while type(app) is not ASGIHandler:  # under the lease and submit routers and the static files handler
        app = getattr(app, "app", None) or app.application
    app.load_middleware(is_async=True)


@pytest.fixture
def hsts(settings):
    settings.SECURE_HSTS_SECONDS = 3600
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    _django_middleware_reload()
    yield
    settings.SECURE_HSTS_SECONDS = 0
    _django_middleware_reload()


def test_a_submission_with_a_bundle_is_answered_before_django_as_django_answers_it(tokens, settings, tmp_path):
    import hashlib
    import io

    from django.contrib.auth import get_user_model

    from jobs.bundles import bundle_store
    from protocol.bundle import pack_bytes

    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")
    archive = pack_bytes({"train.py": b"print('train')\n"})
    sha = hashlib.sha256(archive).hexdigest()
    bundle_store(stream=io.BytesIO(archive), sha256=sha, user=get_user_model().objects.get(username="alice"))
    body = {**GOOD_BODIES["minimal"], "bundle": sha, "entrypoint": "train.py"}
    fast = post(body, token=tokens["alice"])
    slow = post(body, token=tokens["alice"], fast=False)
    assert (fast[0], fast[3], slow[0]) == (201, False, 201), (fast, slow)
    assert fast[1] == slow[1] and _without_volatile(fast[2]) == _without_volatile(slow[2])
    assert json.loads(fast[2])["bundle"] == sha
    assert _job_row(json.loads(fast[2])["id"]) == _job_row(json.loads(slow[2])["id"])
    # a digest carol never uploaded, an entrypoint outside the bundle: Django's 400s, nothing written
    for refused, token in (({**body, "team": "team-b"}, tokens["carol"]), ({**body, "entrypoint": "../x.py"},
                                                                            tokens["alice"])):
        fast, slow = post(refused, token=token), post(refused, token=token, fast=False)
        assert fast[3] is True and fast[0] == 400 and fast[:3] == slow[:3]


def test_the_answer_keeps_hsts_on_a_secure_request_like_django(tokens, hsts):
    body = GOOD_BODIES["minimal"]
    secure = [(b"x-forwarded-proto", b"https")]
    fast = post(body, token=tokens["alice"], headers=secure)
    slow = post(body, token=tokens["alice"], headers=secure, fast=False)
    assert (fast[0], fast[3], slow[0]) == (201, False, 201)
    assert fast[1] == slow[1] and (b"strict-transport-security", b"max-age=3600") in fast[1]


SPEC = {"team": "team-a", "name": "demo", "accelerator_type": "CPU", "world_size": 4, "entrypoint": "t.py"}
PLAIN = {key: value for key, value in SPEC.items() if key != "team"}  # a job spec, as job_submit takes it
OTHER_BODIES = {
    "unknown field": {**SPEC, "gpus": 2},
    "unknown tier": {**SPEC, "tier": "gold"},
    "world_size 0": {**SPEC, "world_size": 0},
    "world_size as a string (DRF accepts it)": {**SPEC, "world_size": "4"},
    "world_size true": {**SPEC, "world_size": True},
    "world_size 4.0": {**SPEC, "world_size": 4.0},
    "blank name": {**SPEC, "name": "   "},
    "name with NUL": {**SPEC, "name": "a\x00b"},
    "name too long": {**SPEC, "name": "n" * 201},
    "name a number": {**SPEC, "name": 7},
    "args not a list": {**SPEC, "args": "--epochs 3"},
    "args with a number": {**SPEC, "args": ["--epochs", 3]},
    "env with a number": {**SPEC, "env": {"LR": 0.1}},
    "env bad name": {**SPEC, "env": {"1X": "a"}},
    "min_devices not dividing": {**SPEC, "min_devices": 3},
    "world_size over the ranks-per-device bound": {**SPEC, "world_size": 100_000, "min_devices": 1},
    "unknown team": {**SPEC, "team": "team-z"},
    "another team's slug": {**SPEC, "team": "team-b"},
    "team null": {**SPEC, "team": None},
    "unknown bundle": {**SPEC, "bundle": "a" * 64},
    "not a digest": {**SPEC, "bundle": "x"},
    "blank bundle": {**SPEC, "bundle": "  "},
    "bundle too long": {**SPEC, "bundle": "a" * 65},
    "a list": [SPEC],
    "total_steps 0": {**SPEC, "total_steps": 0},
    "the host network, which the operator denies": {**SPEC, "network": "host"},
    "an unknown network": {**SPEC, "network": "none"},
}


@pytest.mark.parametrize("body", OTHER_BODIES.values(), ids=OTHER_BODIES.keys())
def test_what_the_fast_path_does_not_accept_gets_djangos_own_answer(tokens, body):
    before = Job.objects.count()
    fast = post(body, token=tokens["alice"])
    slow = post(body, token=tokens["alice"], fast=False)

    assert fast[3] is True  # replayed to Django
    assert (fast[0], fast[1], _without_volatile(fast[2])) == (slow[0], slow[1], _without_volatile(slow[2]))
    assert Job.objects.count() - before == (2 if fast[0] == 201 else 0)


@pytest.mark.parametrize(("case", "kwargs"), [
    ("no token", {}),
    ("unknown token", {"token": "not-a-token"}),
    ("inactive user", {"token": "bob"}),
    ("on two teams, none named", {"token": "carol"}),
    ("a superuser", {"token": "admin"}),
    ("not JSON", {"token": "alice", "raw": b"{name: demo"}),
    ("asks for HTML", {"token": "alice", "headers": ((b"accept", b"text/html"),)}),
    ("form-encoded", {"token": "alice", "headers": ((b"content-type", b"application/x-www-form-urlencoded"),)}),
    ("a host not allowed", {"token": "alice", "headers": ((b"host", b"evil.example"),)}),
    ("a query string", {"token": "alice", "path": SUBMIT_PATH + "?format=json"}),
    ("a repeated header", {"token": "alice", "headers": ((b"x-a", b"1"), (b"x-a", b"2"))}),
    ("an over-long Token header", {"token": "alice extra"}),
], ids=lambda value: value if isinstance(value, str) else "")
def test_requests_it_cannot_vouch_for_get_djangos_answer(tokens, settings, case, kwargs):
    settings.ALLOWED_HOSTS = ["testserver"]
    kwargs = dict(kwargs)
    if kwargs.get("token") in tokens:
        kwargs["token"] = tokens[kwargs["token"]]
    elif kwargs.get("token") == "alice extra":
        kwargs["token"] = tokens["alice"] + " extra"
    body = {k: v for k, v in SPEC.items() if k != "team"}
    fast = post(body, fast=True, **kwargs)
    slow = post(body, fast=False, **kwargs)
    assert fast[3] is True, case
    assert (fast[0], fast[1], _without_volatile(fast[2])) == (slow[0], slow[1], _without_volatile(slow[2])), case


def test_a_body_over_the_fast_limit_goes_to_django_whole(tokens):
    body = {**SPEC, "args": ["x" * 1000] * (FAST_BODY_MAX // 1000 + 5)}
    fast = post(body, token=tokens["alice"])
    slow = post(body, token=tokens["alice"], fast=False)
    assert fast[3] is True and fast[0] == slow[0] == 201


def test_the_quota_counter_under_fast_submissions_cancel_and_finish(tokens, team_a, alice):
    team_a.quotas = {"CPU": 6}
    team_a.save()
    TeamQuotaClaim.objects.filter(team=team_a).delete()
    body = {**SPEC, "world_size": 4, "min_devices": 2}

    first = post(body, token=tokens["alice"])
    assert first[0] == 201 and first[3] is True  # no counter for (team, CPU) yet: Django creates it
    answers = [post(body, token=tokens["alice"]) for _ in range(2)]
    assert [(status, by_django) for status, _h, _b, by_django in answers] == [(201, False), (201, False)]
    assert TeamQuotaClaim.objects.get(team=team_a, accelerator_type="CPU").claimed == 6

    over, over_django = post(body, token=tokens["alice"]), post(body, token=tokens["alice"], fast=False)
    assert over[0] == 400 and over[3] is True and over[:3] == over_django[:3]
    assert "over team quota" in json.loads(over[2])["min_devices"][0]

    cancelled = Job.objects.get(pk=json.loads(answers[0][2])["id"])
    job_cancel(job=cancelled, by=alice)
    assert TeamQuotaClaim.objects.get(team=team_a, accelerator_type="CPU").claimed == 4
    again = post(body, token=tokens["alice"])
    assert again[0] == 201 and again[3] is False

    finished = Job.objects.get(pk=json.loads(answers[1][2])["id"])
    for to in ("scheduled", "running", "succeeded"):
        finished = job_transition(job=finished, to=to)
    assert TeamQuotaClaim.objects.get(team=team_a, accelerator_type="CPU").claimed == 4
    assert _team_quota_claimed_recomputed(team_id=team_a.pk, accelerator_type="CPU") == 4


def test_a_fast_submission_pushes_the_new_job_to_its_team(tokens, team_a):
    from channels.layers import get_channel_layer

    from portal.asgi import application

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(f"team.{team_a.pk}", channel)
        payload = json.dumps(GOOD_BODIES["minimal"]).encode()
        communicator = HttpCommunicator(application, "POST", SUBMIT_PATH, body=payload, headers=[
            (b"host", b"testserver"), (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()), (b"authorization", f"Token {tokens['alice']}".encode())])
        response = await communicator.get_response(timeout=20)
        return response, await layer.receive(channel)

    response, message = async_to_sync(scenario)()
    assert response["status"] == 201
    job_id = json.loads(response["body"])["id"]
    assert (message["type"], message["job"]["job_id"], message["job"]["team_id"], message["job"]["state"]) == (
        "jobs.job_updated", job_id, team_a.pk, "pending")


def test_a_token_selects_its_active_user_and_their_teams_in_one_query(tokens, django_assert_num_queries):
    with django_assert_num_queries(1):
        carol = submitter_by_token(key=tokens["carol"])
    assert carol.user.username == "carol" and [t.slug for t in carol.teams] == ["team-a", "team-b"]
    assert submitter_by_token(key=tokens["bob"]) is None  # inactive
    assert submitter_by_token(key="nope") is None


def test_min_devices_one_skips_the_fleet_capacity_query(team_a, alice):
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        job_submit_direct(team=team_a, submitted_by=alice, spec={**PLAIN, "min_devices": 1})
    # (a prepared statement's text is logged as None on PostgreSQL: Django reads it back from psycopg)
    texts = [(q["sql"] or "").lower() for q in queries.captured_queries]
    assert not any("accelerator" in sql and "count(" in sql for sql in texts)
    with CaptureQueriesContext(connection) as queries:
        job_submit_direct(team=team_a, submitted_by=alice, spec={**PLAIN, "min_devices": 2})
    texts = [(q["sql"] or "").lower() for q in queries.captured_queries]
    assert any("accelerator" in sql and "count(" in sql for sql in texts)  # min_devices 2: the fleet bounds it


def _random_value(rng, depth=0):
    kind = rng.randrange(12 if depth < 2 else 9)
    return [
        lambda: rng.choice(["", " ", "a", " a ", "CPU", "basic", "fail", "team-a", "\x00", "\ud800", "é", "4", "1"]),
        lambda: rng.choice([0, 1, 2, 4, -1, 100_000, 100_001, 2**63, 2**63 - 1]),
        lambda: rng.choice([True, False]),
        lambda: rng.choice([1.0, 4.0, 0.5, float("nan")]),
        lambda: None,
        lambda: "x" * rng.choice([199, 200, 201, 1000, 1001]),
        lambda: rng.choice(["premium", "standard", "restart", "H100-80GB", "gold"]),
        lambda: rng.choice(["train.py", " t.py "]),
        lambda: rng.randint(1, 8),
        lambda: [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {rng.choice(["LR", "A", "1X", "", "B_2"]): _random_value(rng, depth + 1)
                 for _ in range(rng.randrange(3))},
        lambda: [rng.choice(["a", " b ", "  "]) for _ in range(rng.randrange(3))],
    ][kind]()


def test_what_the_fast_check_accepts_drf_and_job_spec_clean_accept_alike():
    """A property over random bodies: whenever spec_if_plain accepts one, JobSubmitApi's
    InputSerializer accepts it too with the same values, and job_spec_clean cleans both alike."""
    rng = random.Random(18)
    fields = sorted(JobSubmitApi.InputSerializer().fields) + ["gpus"]
    accepted = 0
    for _ in range(8000):
        body = {"name": "demo", "accelerator_type": "CPU", "world_size": 4, "entrypoint": "t.py"}
        for field in rng.sample(fields, rng.randrange(1, 5)):
            if rng.random() < 0.15:
                body.pop(field, None)
            else:
                body[field] = _random_value(rng)
        fast = spec_if_plain(body)
        if fast is None:
            continue
        team, spec = fast
        serializer = JobSubmitApi.InputSerializer(data=body)
        assert serializer.is_valid(), (body, serializer.errors)
        drf = dict(serializer.validated_data)
        assert drf.pop("team", None) == team, body
        assert drf == spec, body
        try:
            fast_clean = job_spec_clean(spec)
        except ValidationError as error:
            with pytest.raises(ValidationError) as drf_error:
                job_spec_clean(drf)
            assert drf_error.value.message_dict == error.message_dict
        else:
            assert job_spec_clean(drf) == fast_clean
        accepted += 1
    assert accepted > 300  # the property was exercised, not vacuous


def test_concurrent_fast_submissions_never_claim_past_the_quota(cast):
    if connection.vendor == "sqlite" and "memory" in str(connection.settings_dict.get("TEST", {}).get("NAME")
                                                         or connection.settings_dict["NAME"]):
        pytest.skip("threads need a database file or server (CI's PostgreSQL pass runs this)")
    team, alice = cast.team_a, cast.alice
    team.quotas = {"CPU": 10}
    team.save()
    TeamQuotaClaim.objects.update_or_create(team=team, accelerator_type="CPU", defaults={"claimed": 0})
    Job.objects.filter(team=team).delete()
    barrier = threading.Barrier(8)
    created, errors = [], []

    def worker():
        from django.db import connection as thread_connection
        try:
            barrier.wait(timeout=30)
            for _ in range(4):
                job = job_submit_direct(team=team, submitted_by=alice, spec={**PLAIN, "world_size": 2})
                if job is not None:
                    created.append(job.pk)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))
        finally:
            thread_connection.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert len(created) == 10 and len(set(created)) == 10  # 32 tries, room for exactly 10
    assert TeamQuotaClaim.objects.get(team=team, accelerator_type="CPU").claimed == 10
    assert _team_quota_claimed_recomputed(team_id=team.pk, accelerator_type="CPU") == 10
    assert Replica.objects.filter(job__team=team).count() == 20
    assert JobEvent.objects.filter(job__team=team, type=JobEvent.Type.SUBMITTED).count() == 10


def test_a_write_that_fails_is_answered_as_the_api_answers_errors_and_not_replayed(tokens, team_a):
    """The claim's row locked by another transaction past lock_timeout: the statement fails inside
    the write, so the answer is the API's 500 (not Django's second try: the write may have
    committed), and nothing is written. PostgreSQL only (row locks)."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks and lock_timeout: CI's PostgreSQL pass runs this")
    import psycopg

    settings_dict = connection.settings_dict
    other = psycopg.connect(host=settings_dict["HOST"] or None, port=settings_dict["PORT"] or None,
                            user=settings_dict["USER"] or None, password=settings_dict["PASSWORD"] or None,
                            dbname=settings_dict["NAME"])
    before = Job.objects.count()
    try:
        other.execute("SELECT 1 FROM jobs_teamquotaclaim WHERE team_id = %s FOR UPDATE", [team_a.pk])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '300ms'")
        fast = post(GOOD_BODIES["minimal"], token=tokens["alice"])
    finally:
        other.rollback()
        other.close()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert (fast[0], fast[3]) == (500, False)
    assert json.loads(fast[2]) == {"detail": "internal error; it is logged, and retrying will not help until it "
                                             "is fixed: tell the operator the time and the URL"}
    assert Job.objects.count() == before
    assert TeamQuotaClaim.objects.get(team=team_a, accelerator_type="CPU").claimed == 0
