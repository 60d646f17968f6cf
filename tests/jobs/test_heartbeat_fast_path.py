"""POST /api/agent/heartbeat/ answered before Django (jobs/heartbeat_api.py) gives the answers
Django and DRF give: the same status, headers and body for a node's well-formed heartbeat, and
Django's own answer (the request replayed to it) for everything else. Each case is sent through the
real ASGI application (portal.asgi) with MERIDIAN_HEARTBEAT_FAST_PATH on and off, and the two
answers compared; whether Django answered is seen from its request_started signal."""
import json

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.core.signals import request_started

from fleet.models import Accelerator, Node
from fleet.services import fleet_generate, node_token_issue, node_token_revoke
from jobs.heartbeat_api import FAST_BODY_MAX, HEARTBEAT_PATH
from jobs.models import Job, Replica
from tests.jobs.heartbeat_requests import post

# Transactional: Django answers each ASGI request in its own thread, whose connection must see the
# test's rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def node(db):
    fleet_generate(regions=1, clusters=1, nodes=2, devices=2, accelerator_type="H100-80GB", prefix="fp")
    return Node.objects.order_by("hostname").first()


@pytest.fixture
def running(node, team_a, alice, submit):
    """A job running on `node`'s device 0, generation 0."""
    job = submit(team_a, alice, accelerator_type="H100-80GB", world_size=1, min_devices=1)
    Replica.objects.filter(job=job).update(device=Accelerator.objects.get(node=node, index=0))
    Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING)
    return job


def test_a_nodes_heartbeat_is_answered_before_django_exactly_as_django_answers_it(node, running):
    token = node_token_issue(node=node)
    body = {"telemetry": {"utilization": 0.5, "devices": [{"index": 0, "utilization": 0.5, "memory_used_gb": 9.0}]},
            "jobs": [{"job_id": running.pk, "state": "running", "step": 7, "steps_per_s": 1.5, "generation": 0},
                     {"job_id": running.pk + 1000, "state": "running", "step": 1}]}

    fast = post(body, token=token)
    slow = post(body, token=token, fast=False)

    assert fast[3] is False and slow[3] is True  # the first never reached Django
    assert fast[:3] == slow[:3]
    status, _, answer, _ = fast
    assert status == 200 and answer["accepted"] == [running.pk]
    assert [r["job_id"] for r in answer["rejected"]] == [running.pk + 1000] and answer["rejected"][0]["fence"]
    assert [j["job_id"] for j in answer["desired"]["jobs"]] == [running.pk]
    assert Job.objects.get(pk=running.pk).progress_step == 7
    # holding the current version: no desired state, from either path
    body["desired_version"] = answer["desired_version"]
    assert post(body, token=token)[:3] == post(body, token=token, fast=False)[:3]
    assert post(body, token=token)[2]["desired"] is None


@pytest.mark.parametrize("case", ["no token", "unknown token", "revoked token", "not a heartbeat", "not json",
                                  "over the fast path's size", "a query string"])
def test_what_it_does_not_certainly_accept_django_answers(node, case):
    token = node_token_issue(node=node)
    body, raw, headers = {"telemetry": {"utilization": 0.5}, "jobs": []}, None, ()
    if case == "no token":
        token = None
    elif case == "unknown token":
        token = "not-a-token"
    elif case == "revoked token":
        node_token_revoke(node=node)  # refused at once: the fast path reads the token's row every time
    elif case == "not a heartbeat":
        body = {"jobs": [{"job_id": 1, "state": "running", "step": -1}]}
    elif case == "not json":
        raw = b"{not json"
    elif case == "over the fast path's size":
        raw = json.dumps({"telemetry": {"utilization": 0.5}, "jobs": [], "pad": "x" * FAST_BODY_MAX}).encode()

    if case == "a query string":
        from portal.asgi import application

        communicator = HttpCommunicator(application, "POST", HEARTBEAT_PATH + "?x=1", body=json.dumps(body).encode(),
                                        headers=[(b"host", b"testserver"), (b"content-type", b"application/json"),
                                                 (b"authorization", f"Node {token}".encode())])
        django_answered = []
        request_started.connect(lambda **_: django_answered.append(True), weak=False, dispatch_uid="qs")
        try:
            assert async_to_sync(communicator.get_response)(timeout=20)["status"] == 200
        finally:
            request_started.disconnect(dispatch_uid="qs")
        assert django_answered
        return
    fast = post(body, token=token, raw=raw, headers=headers)
    slow = post(body, token=token, raw=raw, headers=headers, fast=False)

    assert fast[3] is True  # replayed to Django
    assert fast[:3] == slow[:3]
    assert fast[0] in {"no token": (401,), "unknown token": (401,), "revoked token": (401,),
                       "not a heartbeat": (400,), "not json": (400,), "over the fast path's size": (413,)}[case]


def test_a_bad_body_with_a_bad_token_is_a_401_as_through_django(node):
    fast = post(None, token="not-a-token", raw=b"{not json")

    assert fast[0] == 401 and fast[3] is True
