"""Fleet read API: summary, nodes, accelerators; aggregated, paginated, constant queries."""
import pytest

from fleet.models import Accelerator, Node
from fleet.selectors import node_get_by_token
from fleet.services import fleet_generate, node_token_issue


@pytest.fixture
def fleet(db):
    fleet_generate(regions=2, clusters=2, nodes=3, devices=4, accelerator_type="H100-80GB")


def test_the_summary_counts_by_type_and_cluster(
    api_client_for, alice, fleet, submit, team_a, django_assert_max_num_queries
):
    Accelerator.objects.filter(pk__in=Accelerator.objects.values("pk")[:2]).update(healthy=False)
    Node.objects.filter(hostname="gen-r00-c00-n0000").update(state=Node.State.DRAINING)
    job = submit(team_a, alice, accelerator_type="H100-80GB", world_size=4, min_devices=1)
    devices = list(Accelerator.objects.filter(node__hostname="gen-r01-c01-n0002"))
    for replica, device in zip(job.replicas.order_by("rank"), devices):
        replica.device = device
        replica.save()
    job.replicas.filter(rank=3).update(device=devices[0])  # two ranks share device 0

    with django_assert_max_num_queries(5):
        body = api_client_for(alice).get("/api/fleet/summary/").json()

    totals = body["totals"]
    # 48 devices; 2 unhealthy on n0000 (draining); 3 allocated devices on n0002.
    assert (totals["accelerators"], totals["healthy"], totals["allocated"]) == (48, 46, 3)
    assert totals["free"] == 48 - 4 - 3  # draining node's 4 devices are not free
    assert totals["nodes_by_state"] == {"ready": 11, "draining": 1, "lost": 0}
    assert body["by_type"] == [
        {"type": "H100-80GB", "accelerators": 48, "healthy": 46, "allocated": 3, "free": 41, "mean_utilization": None}
    ]
    assert len(body["clusters"]) == 4
    assert sum(c["allocated"] for c in body["clusters"]) == 3


def test_nodes_list_filters_and_costs_constant_queries(api_client_for, alice, fleet, django_assert_max_num_queries):
    with django_assert_max_num_queries(2):
        body = api_client_for(alice).get("/api/nodes/", {"region": "gen-r01"}).json()

    assert body["count"] == 6
    assert {n["region"] for n in body["results"]} == {"gen-r01"}
    assert body["results"][0]["accelerator_count"] == 4


def test_node_detail_lists_its_devices(api_client_for, alice, fleet):
    node = Node.objects.get(hostname="gen-r00-c01-n0001")

    body = api_client_for(alice).get(f"/api/nodes/{node.pk}/").json()

    assert [a["index"] for a in body["accelerators"]] == [0, 1, 2, 3]
    assert "agent_token_hash" not in body
    assert api_client_for(alice).get("/api/nodes/999999/").status_code == 404


def test_accelerators_are_paginated_and_filtered(api_client_for, alice, fleet, django_assert_max_num_queries):
    with django_assert_max_num_queries(2):
        body = api_client_for(alice).get(
            "/api/accelerators/", {"page_size": 10, "type": "H100-80GB", "healthy": "true"}
        ).json()

    assert (body["count"], len(body["results"])) == (48, 10)
    assert api_client_for(alice).get("/api/accelerators/", {"type": "TPU"}).status_code == 400


def test_agent_tokens_are_stored_hashed_and_rotate(fleet):
    node = Node.objects.first()

    token = node_token_issue(node=node)

    node.refresh_from_db()
    assert token not in node.agent_token_hash and len(node.agent_token_hash) == 64
    assert node_get_by_token(token=token) == node and node.token_matches(token)
    node_token_issue(node=node)
    assert node_get_by_token(token=token) is None
