"""The heartbeat path end to end (token auth, node_report_apply with node_heartbeat_record,
node_desired_state) has a query budget: the telemetry history costs no extra statement, and
nothing grows with the number of devices a node reports."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from fleet.models import Accelerator, Node, NodeTelemetryBucket
from fleet.services import fleet_generate, node_token_issue
from jobs.models import Replica

# auth 1 · report: node 1, devices 1, history 1, jobs 2, progress 1 per job · refetch 1 ·
# desired state 2 = 10 (BEGIN/COMMIT and PostgreSQL's SET LOCAL not counted), plus headroom
# for the moves being added to jobs/workflows.py (an active-move lookup each in the report
# and in the desired state).
HEARTBEAT_BUDGET_ONE_JOB = 12
# The fleet's share, whatever the device count: the node, its devices, its history bucket.
FLEET_WRITES = ('UPDATE "fleet_node"', "UPDATE fleet_accelerator", "INSERT INTO fleet_nodetelemetrybucket")


@pytest.fixture
def nodes(db):
    fleet_generate(regions=1, clusters=1, nodes=2, devices=8, accelerator_type="H100-80GB", prefix="qb")
    return list(Node.objects.order_by("hostname"))


def heartbeat(node, *, devices, jobs=()):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {node_token_issue(node=node)}")
    body = {"telemetry": {"utilization": 0.5, "devices": [
        {"index": i, "utilization": 0.5, "memory_used_gb": 40.0} for i in range(devices)]},
        "jobs": [{"job_id": j.pk, "state": "running", "step": 3, "steps_per_s": 1.0, "devices": 1} for j in jobs]}
    with CaptureQueriesContext(connection) as captured:
        response = client.post("/api/agent/heartbeat/", body, format="json")
    assert response.status_code == 200, response.content
    return [q["sql"] for q in captured.captured_queries
            if q["sql"].split()[0].upper() not in ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE", "SET")]


def test_a_heartbeat_with_one_running_job_stays_within_its_query_budget(nodes, alice, team_a, submit):
    job = submit(team_a, alice, accelerator_type="H100-80GB", world_size=1, min_devices=1)
    Replica.objects.filter(job=job).update(device=Accelerator.objects.get(node=nodes[0], index=0))

    statements = heartbeat(nodes[0], devices=8, jobs=[job])

    assert len(statements) <= HEARTBEAT_BUDGET_ONE_JOB, "\n".join(statements)
    fleet_writes = [s for s in statements if any(w in s for w in FLEET_WRITES)]
    assert len(fleet_writes) == 3, "\n".join(fleet_writes)
    assert NodeTelemetryBucket.objects.get(node=nodes[0]).device_samples == 8


def test_a_heartbeat_costs_the_same_queries_for_one_device_or_eight(nodes):
    one = heartbeat(nodes[0], devices=1)
    eight = heartbeat(nodes[1], devices=8)

    assert len(one) == len(eight)
