"""The fleet page's utilization-over-time chart: the level shown (fleet, cluster, node) picks
the scope; the page carries the default window and names the API query for other windows."""
from datetime import timedelta

import pytest
from django.db import transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from fleet.models import Node
from fleet.services import fleet_generate, node_heartbeat_record


@pytest.fixture
def reporting_fleet(db):
    fleet_generate(regions=1, clusters=2, nodes=2, devices=2, accelerator_type="H100-80GB", prefix="hp")
    now = timezone.now()
    for k, node in enumerate(Node.objects.order_by("hostname")):
        with transaction.atomic():
            node_heartbeat_record(node=node, now=now - timedelta(minutes=2), telemetry={"devices": [
                {"index": i, "utilization": 0.1 * (k + 1), "memory_used_gb": 8.0} for i in range(2)]})
    return list(Node.objects.order_by("hostname"))


def page_json(user, query=""):
    client = Client()
    client.force_login(user)
    response = client.get(reverse("pages:fleet") + "?format=json" + query)
    assert response.status_code == 200
    return response.json()["utilization_history"]


def test_the_fleet_level_charts_the_whole_fleet(alice, reporting_fleet):
    history = page_json(alice)

    assert history["scope_query"] == "" and history["resolution_seconds"] == 60
    [point] = history["points"]
    assert point["device_samples"] == 8 and point["utilization_mean"] == pytest.approx(0.25)
    assert point["utilization_max"] == pytest.approx(0.4)


def test_drilling_down_charts_the_cluster_then_the_node(alice, reporting_fleet):
    first = reporting_fleet[0]

    cluster = page_json(alice, f"&cluster={first.cluster_id}")
    node = page_json(alice, f"&node={first.pk}")

    assert cluster["scope_query"] == f"cluster={first.cluster_id}"
    assert [p["utilization_mean"] for p in cluster["points"]] == [pytest.approx(0.15)]
    assert node["scope_query"] == f"node={first.pk}"
    assert [p["utilization_mean"] for p in node["points"]] == [pytest.approx(0.1)]


def test_another_teams_member_sees_the_same_chart(alice, charlie, reporting_fleet):
    # Telemetry belongs to the fleet and names no job; since/until move with the clock.
    as_charlie = page_json(charlie)["points"]
    assert as_charlie and as_charlie == page_json(alice)["points"]


def test_the_page_draws_the_chart_and_its_window_choice(alice, reporting_fleet):
    client = Client()
    client.force_login(alice)
    html = client.get(reverse("pages:fleet")).content.decode()

    assert 'id="history-chart"' in html and 'id="history-window"' in html
    assert "utilization_history" in html  # the default window rides in the page's JSON
