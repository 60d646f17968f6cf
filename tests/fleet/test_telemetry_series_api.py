"""GET /api/fleet/utilization/: the history of a scope for anyone signed in; bad parameters are
a 400 naming the parameter; an unknown node, cluster or region is a 404."""
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from rest_framework.test import APIClient

from fleet.models import Node
from fleet.services import fleet_generate, node_heartbeat_record

URL = "/api/fleet/utilization/"


@pytest.fixture
def reporting_fleet(db):
    """2 regions × 1 cluster × 2 nodes × 2 H100s; every node reported 3 times in the last minutes."""
    fleet_generate(regions=2, clusters=1, nodes=2, devices=2, accelerator_type="H100-80GB", prefix="api")
    now = timezone.now()
    for node in Node.objects.all():
        for k in range(3):
            with transaction.atomic():
                node_heartbeat_record(node=node, now=now - timedelta(minutes=k), telemetry={"devices": [
                    {"index": i, "utilization": 0.25 * (i + 1), "memory_used_gb": 40.0} for i in range(2)]})
    return {n.hostname: n for n in Node.objects.all()}


def test_a_member_sees_the_fleets_utilization_by_minute(
    api_client_for, alice, reporting_fleet, django_assert_max_num_queries
):
    with django_assert_max_num_queries(4):
        response = api_client_for(alice).get(URL)

    body = response.json()
    assert response.status_code == 200
    assert (body["resolution"], body["resolution_seconds"], body["scope"]) == ("minute", 60, {})
    assert 3 <= len(body["points"]) <= 4  # three minutes (four if the clock crossed one meanwhile)
    assert {p["utilization_mean"] for p in body["points"]} == {0.375}
    assert {p["utilization_max"] for p in body["points"]} == {0.5}
    assert sum(p["device_samples"] for p in body["points"]) == 3 * 4 * 2


def test_another_teams_user_sees_the_same_fleet_history(api_client_for, alice, charlie, reporting_fleet):
    # Telemetry belongs to the fleet, not to a team: it names no job.
    node = reporting_fleet["api-r01-c00-n0001"]
    as_alice = api_client_for(alice).get(URL, {"node": node.pk}).json()
    as_charlie = api_client_for(charlie).get(URL, {"node": node.pk}).json()

    assert as_alice["points"] == as_charlie["points"] and as_alice["points"]
    assert "job" not in str(as_charlie)


def test_anonymous_callers_are_refused(db):
    assert APIClient().get(URL).status_code in (401, 403)


def test_scopes_narrow_the_series(api_client_for, alice, reporting_fleet):
    client = api_client_for(alice)
    node = reporting_fleet["api-r00-c00-n0000"]

    by_region = client.get(URL, {"region": "api-r00"}).json()
    by_cluster = client.get(URL, {"cluster": node.cluster_id, "accelerator_type": "H100-80GB"}).json()
    by_node = client.get(URL, {"node": node.pk, "hours": 1}).json()

    assert sum(p["device_samples"] for p in by_region["points"]) == 3 * 2 * 2
    assert by_cluster["scope"] == {"cluster": node.cluster_id, "accelerator_type": "H100-80GB"}
    assert sum(p["device_samples"] for p in by_cluster["points"]) == 3 * 2 * 2
    assert sum(p["device_samples"] for p in by_node["points"]) == 3 * 2
    assert client.get(URL, {"accelerator_type": "A100-80GB"}).json()["points"] == []


def test_a_week_comes_back_by_the_hour(api_client_for, alice, reporting_fleet):
    body = api_client_for(alice).get(URL, {"hours": 24 * 7}).json()

    assert body["resolution"] == "hour"
    assert sum(p["device_samples"] for p in body["points"]) == 3 * 4 * 2


@pytest.mark.parametrize("params, field, words", [
    ({"hours": "abc"}, "hours", "number"),
    ({"hours": 0}, "hours", "greater than or equal"),
    ({"since": "yesterday"}, "since", "format"),
    ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "since", "must be before"),
    ({"since": "2026-01-01T00:00:00Z", "hours": 2}, "hours", "either since or hours"),
    ({"resolution": "second"}, "resolution", "minute or hour"),
    ({"hours": 24 * 30, "resolution": "minute"}, "resolution", "too many"),
    ({"accelerator_type": "TPU"}, "accelerator_type", "known types"),
    ({"node": 1, "cluster": 1}, "node", "drop cluster and region"),
    ({"cluster": "x"}, "cluster", "integer"),
], ids=["hours-not-a-number", "hours-zero", "since-garbled", "reversed", "since-and-hours", "resolution",
        "too-many-points", "type", "node-and-cluster", "cluster-not-an-id"])
def test_bad_parameters_are_a_400_naming_the_parameter(api_client_for, alice, reporting_fleet, params, field, words):
    response = api_client_for(alice).get(URL, params)

    assert response.status_code == 400
    assert words in " ".join(response.json()[field])


@pytest.mark.parametrize("params", [{"node": 999999}, {"cluster": 999999}, {"region": "atlantis"}],
                         ids=["node", "cluster", "region"])
def test_an_unknown_scope_is_a_404_naming_it(api_client_for, alice, reporting_fleet, params):
    response = api_client_for(alice).get(URL, params)

    assert response.status_code == 404
    assert str(list(params.values())[0]) in response.json()["detail"]
