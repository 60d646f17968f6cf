"""Draining and undraining a node (fleet.services.node_drain / node_undrain), through the service,
the REST API (POST /api/nodes/<id>/drain/, /undrain/) and the node's page: who may (global admins
only: a team's capacity manager may not), idempotence, a lost node refused, the reason bounded, the
drain surviving the node's loss and its agent's re-registration, the leasing agent told."""
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from fleet import leases
from fleet.agent_services import node_reregister
from fleet.models import NODE_DRAIN_REASON_MAX_LENGTH, Accelerator, Node
from fleet.services import (
    NodeStateConflict,
    fleet_generate,
    node_drain,
    node_heartbeat_record,
    node_token_issue,
    node_undrain,
)


@pytest.fixture
def fleet(db):
    fleet_generate(regions=1, clusters=1, nodes=3, devices=4, accelerator_type="CPU", prefix="d")


@pytest.fixture
def node(fleet):
    return Node.objects.get(hostname="d-r00-c00-n0000")


@pytest.fixture
def staff_user(db):
    """Staff (may log in to /admin/) but not a superuser: not a fleet operator either."""
    return get_user_model().objects.create_user("sam", password="x", is_staff=True)


def drain_url(node_id):
    return f"/api/nodes/{node_id}/drain/"


def undrain_url(node_id):
    return f"/api/nodes/{node_id}/undrain/"


# --- the service ------------------------------------------------------------------------------------


def test_draining_records_the_reason_who_and_when_and_undraining_clears_them(node, admin_user):
    at = timezone.now() - timedelta(minutes=3)
    node_drain(node=node, by=admin_user, reason="  replace GPU 3 (ticket 1234)  ", now=at)
    node.refresh_from_db()
    assert (node.state, node.drain_reason, node.drained_by, node.drained_at) == (
        Node.State.DRAINING, "replace GPU 3 (ticket 1234)", "admin", at)
    node_undrain(node=node, by=admin_user)
    node.refresh_from_db()
    assert (node.state, node.drain_reason, node.drained_by, node.drained_at) == (Node.State.READY, "", "", None)


def test_draining_twice_keeps_the_first_drain_and_undraining_a_ready_node_changes_nothing(node, admin_user):
    first = timezone.now() - timedelta(hours=1)
    node_drain(node=node, by=admin_user, reason="first", now=first)
    again = node_drain(node=node, by=admin_user, reason="second", now=timezone.now())
    assert (again.state, again.drain_reason, again.drained_at) == (Node.State.DRAINING, "first", first)
    node_undrain(node=node, by=admin_user)
    assert node_undrain(node=node, by=admin_user).state == Node.State.READY


def test_a_lost_node_can_be_neither_drained_nor_undrained(node, admin_user):
    Node.objects.filter(pk=node.pk).update(state=Node.State.LOST)
    with pytest.raises(NodeStateConflict, match="is lost"):
        node_drain(node=node, by=admin_user, reason="too late")
    with pytest.raises(NodeStateConflict, match="comes back ready"):
        node_undrain(node=node, by=admin_user)
    node.refresh_from_db()
    assert (node.state, node.drain_reason) == (Node.State.LOST, "")


@pytest.mark.parametrize("reason", ["", "   ", None, 7, "x" * (NODE_DRAIN_REASON_MAX_LENGTH + 1)],
                         ids=["empty", "blank", "none", "not-text", "too-long"])
def test_a_drain_needs_a_reason_a_person_can_read(node, admin_user, reason):
    with pytest.raises(ValidationError) as error:
        node_drain(node=node, by=admin_user, reason=reason)
    assert "reason" in error.value.message_dict
    node.refresh_from_db()
    assert node.state == Node.State.READY


@pytest.mark.parametrize("who", ["alice", "charlie", "carol", "staff_user"])
def test_only_global_admins_may_drain_or_undrain(node, admin_user, who, request):
    user = request.getfixturevalue(who)
    with pytest.raises(PermissionDenied, match="only global admins"):
        node_drain(node=node, by=user, reason="mine")
    node_drain(node=node, by=admin_user, reason="maintenance")
    with pytest.raises(PermissionDenied, match="only global admins"):
        node_undrain(node=node, by=user)
    node.refresh_from_db()
    assert node.state == Node.State.DRAINING


def test_a_drained_node_that_was_lost_comes_back_draining_and_stays_so_when_its_agent_registers_again(
        fleet, admin_user):
    drained, plain = Node.objects.order_by("hostname")[:2]
    node_drain(node=drained, by=admin_user, reason="flaky NIC")
    Node.objects.filter(pk__in=[drained.pk, plain.pk]).update(state=Node.State.LOST)
    for row in (drained, plain):
        row.refresh_from_db()
        node_heartbeat_record(node=row, telemetry={}, now=timezone.now())
        row.refresh_from_db()
    assert (drained.state, drained.drain_reason, plain.state) == (Node.State.DRAINING, "flaky NIC", Node.State.READY)
    token = node_token_issue(node=drained)
    again, _ = node_reregister(node=drained, token=token, hostname=drained.hostname, region="d-r00", cluster="c00",
                               devices=[{"type": "CPU"}] * 4)
    assert again.state == Node.State.DRAINING  # an agent restart does not undo an operator's drain
    plain_token = node_token_issue(node=plain)
    assert node_reregister(node=plain, token=plain_token, hostname=plain.hostname, region="d-r00", cluster="c00",
                           devices=[{"type": "CPU"}] * 4)[0].state == Node.State.READY


def test_draining_and_undraining_bump_the_nodes_desired_serial(node, admin_user, redis_url, settings,
                                                              django_capture_on_commit_callbacks):
    # The node's state is part of its desired state: an agent that only leases must sync.
    settings.REDIS_URL = redis_url
    leases._down_until = 0.0
    store = leases.lease_store()
    store.delete(leases.DESIRED_SERIAL_KEY)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            node_drain(node=node, by=admin_user, reason="maintenance")
        assert leases.desired_serial_of(node_id=node.pk) == 1
        with django_capture_on_commit_callbacks(execute=True):
            node_drain(node=node, by=admin_user, reason="maintenance")  # no change, no signal
        assert leases.desired_serial_of(node_id=node.pk) == 1
        with django_capture_on_commit_callbacks(execute=True):
            node_undrain(node=node, by=admin_user)
        assert leases.desired_serial_of(node_id=node.pk) == 2
    finally:
        store.delete(leases.DESIRED_SERIAL_KEY)


async def receive_within(layer, channel, *, seconds):
    import asyncio

    return await asyncio.wait_for(layer.receive(channel), seconds)


def test_draining_and_undraining_tell_the_fleet_pages(node, admin_user, settings, django_capture_on_commit_callbacks):
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)("fleet", channel)
    pushed = []
    for change in (lambda: node_drain(node=node, by=admin_user, reason="x"),
                   lambda: node_undrain(node=node, by=admin_user)):
        with django_capture_on_commit_callbacks(execute=True):
            change()
        pushed.append(async_to_sync(receive_within)(layer, channel, seconds=5))
    assert [(m["type"], m["node_id"], m["state"]) for m in pushed] == [
        ("fleet.node_updated", node.pk, "draining"), ("fleet.node_updated", node.pk, "ready")]


# --- the REST API -----------------------------------------------------------------------------------


@pytest.mark.parametrize("who, status", [("alice", 403), ("charlie", 403), ("carol", 403), ("staff_user", 403),
                                         ("admin_user", 200)])
def test_the_drain_api_permissions(api_client_for, node, who, status, request):
    client = api_client_for(request.getfixturevalue(who))
    response = client.post(drain_url(node.pk), {"reason": "maintenance"}, format="json")
    assert response.status_code == status, response.content
    if status == 403:
        assert "only global admins" in response.json()["detail"]
        assert client.post(undrain_url(node.pk)).status_code == 403
    node.refresh_from_db()
    assert node.state == (Node.State.DRAINING if status == 200 else Node.State.READY)


def test_anonymous_callers_are_asked_to_log_in(node):
    assert APIClient().post(drain_url(node.pk), {"reason": "x"}, format="json").status_code == 401


def test_the_drain_api_answers_the_node_with_its_drain_and_the_jobs_still_on_it(
        api_client_for, node, admin_user, alice, team_a, submit):
    job = submit(team_a, alice, world_size=2, min_devices=2)
    devices = list(Accelerator.objects.filter(node=node).order_by("index")[:2])
    for replica, device in zip(job.replicas.order_by("rank"), devices):
        replica.device = device
        replica.save()
    client = api_client_for(admin_user)
    body = client.post(drain_url(node.pk), {"reason": "replace GPU 3"}, format="json").json()
    assert (body["state"], body["drain_reason"], body["drained_by"], body["jobs_holding_devices"]) == (
        "draining", "replace GPU 3", "admin", 1)
    assert body["drained_at"]
    detail = api_client_for(alice).get(f"/api/nodes/{node.pk}/").json()
    assert (detail["state"], detail["drain_reason"], detail["jobs_holding_devices"]) == ("draining", "replace GPU 3", 1)
    listed = api_client_for(alice).get("/api/nodes/", {"hostname": node.hostname}).json()
    assert [n["id"] for n in listed["results"]] == [node.pk] and listed["results"][0]["drained_by"] == "admin"
    body = client.post(undrain_url(node.pk)).json()
    assert (body["state"], body["drain_reason"], body["drained_by"], body["drained_at"]) == ("ready", "", "", None)


def test_the_drain_api_errors_say_what_to_fix(api_client_for, node, admin_user):
    client = api_client_for(admin_user)
    missing = client.post(drain_url(node.pk), {}, format="json")
    assert missing.status_code == 400 and "say why" in missing.json()["reason"][0]
    blank = client.post(drain_url(node.pk), {"reason": "   "}, format="json")
    assert blank.status_code == 400 and "say why" in blank.json()["reason"][0]
    long = client.post(drain_url(node.pk), {"reason": "x" * (NODE_DRAIN_REASON_MAX_LENGTH + 1)}, format="json")
    assert long.status_code == 400 and f"at most {NODE_DRAIN_REASON_MAX_LENGTH}" in long.json()["reason"][0]
    unknown = client.post(drain_url(999999), {"reason": "x"}, format="json")
    assert unknown.status_code == 404 and "no node 999999" in unknown.json()["detail"]
    assert client.post(undrain_url(999999)).status_code == 404
    Node.objects.filter(pk=node.pk).update(state=Node.State.LOST)
    lost = client.post(drain_url(node.pk), {"reason": "x"}, format="json")
    assert lost.status_code == 409 and "a lost node cannot be drained" in lost.json()["detail"]
    assert client.post(undrain_url(node.pk)).status_code == 409
    node.refresh_from_db()
    assert (node.state, node.drain_reason) == (Node.State.LOST, "")


def test_the_drain_api_needs_the_csrf_token_with_a_session(node, admin_user):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(admin_user)
    refused = client.post(drain_url(node.pk), {"reason": "x"}, format="json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    node.refresh_from_db()
    assert node.state == Node.State.READY


def test_the_schema_documents_drain_and_undrain(api_client_for, alice):
    schema = api_client_for(alice).get("/api/schema/", {"format": "json"}).json()
    drain = schema["paths"]["/api/nodes/{node_id}/drain/"]["post"]
    assert drain["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/NodeDrainInputRequest")
    assert schema["components"]["schemas"]["NodeDrainInputRequest"]["required"] == ["reason"]
    assert "/api/nodes/{node_id}/undrain/" in schema["paths"]
    assert {"drain_reason", "drained_by", "drained_at", "jobs_holding_devices"} <= set(
        schema["components"]["schemas"]["Node"]["properties"])


def test_the_node_list_with_drains_costs_constant_queries(api_client_for, alice, admin_user, fleet,
                                                          django_assert_max_num_queries):
    for node in Node.objects.all():
        node_drain(node=node, by=admin_user, reason="all of them")
    with django_assert_max_num_queries(2):
        body = api_client_for(alice).get("/api/nodes/").json()
    assert body["count"] == 3 and {n["drain_reason"] for n in body["results"]} == {"all of them"}


# --- the node's page ------------------------------------------------------------------------------


def page_client(user, **kwargs):
    client = Client(**kwargs)
    client.force_login(user)
    return client


def test_the_node_page_drains_with_a_reason_and_the_csrf_token_then_undrains(node, admin_user):
    client = page_client(admin_user, enforce_csrf_checks=True)
    page = client.get(reverse("pages:fleet"), {"node": node.pk})
    assert page.status_code == 200 and b'data-testid="drain"' in page.content
    assert client.post(reverse("pages:node-drain", args=[node.pk]), {"reason": "x"}).status_code == 403  # no token
    token = str(page.context["csrf_token"])
    response = client.post(reverse("pages:node-drain", args=[node.pk]),
                           {"reason": "swap PSU", "csrfmiddlewaretoken": token})
    assert response.status_code == 302 and response["Location"].endswith(f"?node={node.pk}")
    node.refresh_from_db()
    assert (node.state, node.drain_reason, node.drained_by) == (Node.State.DRAINING, "swap PSU", "admin")
    page = client.get(reverse("pages:fleet"), {"node": node.pk})
    assert b"swap PSU" in page.content and b'data-testid="undrain"' in page.content
    assert b"is draining" in page.content  # the message after the redirect
    response = client.post(reverse("pages:node-undrain", args=[node.pk]), {"csrfmiddlewaretoken": token})
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.state == Node.State.READY


def test_the_node_page_without_a_reason_says_so_and_drains_nothing(node, admin_user):
    client = page_client(admin_user)
    response = client.post(reverse("pages:node-drain", args=[node.pk]), {"reason": ""}, follow=True)
    assert b"not drained: say why" in response.content
    node.refresh_from_db()
    assert node.state == Node.State.READY


def test_the_node_page_shows_the_drain_to_everyone_and_the_buttons_to_admins_only(node, admin_user, carol):
    node_drain(node=node, by=admin_user, reason="firmware update")
    page = page_client(carol).get(reverse("pages:fleet"), {"node": node.pk})
    assert b"firmware update" in page.content and b'data-testid="undrain"' not in page.content
    assert page_client(carol).post(reverse("pages:node-undrain", args=[node.pk])).status_code == 403
    assert page_client(carol).post(reverse("pages:node-drain", args=[node.pk]), {"reason": "x"}).status_code == 403
    assert page_client(admin_user).post(reverse("pages:node-drain", args=[999999]), {"reason": "x"}).status_code == 404
    node.refresh_from_db()
    assert node.state == Node.State.DRAINING


def test_the_admin_shows_the_drain_read_only_and_undrains_through_the_service(node, admin_user):
    node_drain(node=node, by=admin_user, reason="fan noise")
    client = page_client(admin_user)
    change = client.get(reverse("admin:fleet_node_change", args=[node.pk]))
    assert change.status_code == 200 and b"fan noise" in change.content and b'name="state"' not in change.content
    response = client.post(reverse("admin:fleet_node_changelist"),
                           {"action": "undrain", "_selected_action": [node.pk]}, follow=True)
    assert response.status_code == 200 and b"1 selected node(s) ready" in response.content
    node.refresh_from_db()
    assert (node.state, node.drain_reason) == (Node.State.READY, "")
