"""Per-job device telemetry (issue 17 §4): where a job runs now, per host, with the latest readings
of its own devices (a GPU is held by one job at a time, so its NVML utilization and memory are the
job's), on the job page and at GET /api/jobs/<id>/placement/. The readings arrive as a real agent
sends them: its heartbeat, through the API with its node token."""
import pytest
from django.urls import reverse
from node_reports import make_node
from rest_framework.test import APIClient

from fleet.services import node_token_issue
from jobs.services import job_submit
from jobs.tick import tick_run


@pytest.fixture(autouse=True)
def policy(short_policy):
    return short_policy


def heartbeat(node, readings):
    """Sends `node`'s heartbeat with `readings` [(utilization, memory GiB)] of its devices 0, 1, ..."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {node_token_issue(node=node)}")
    body = {"telemetry": {"utilization": 0.5, "devices": [
        {"index": i, "utilization": u, "memory_used_gb": m} for i, (u, m) in enumerate(readings)]}, "jobs": []}
    response = client.post("/api/agent/heartbeat/", body, format="json")
    assert response.status_code == 200, response.content


def placement(user, job_id):
    client = APIClient()
    client.force_authenticate(user)
    return client.get(f"/api/jobs/{job_id}/placement/")


def gpu_job(alice, team, job_spec, **spec):
    job = job_submit(team=team, submitted_by=alice, spec=job_spec(accelerator_type="H100-80GB", **spec))
    tick_run()
    job.refresh_from_db()
    return job


READINGS = [(0.9, 10.0), (0.8, 20.0), (0.7, 30.0), (0.6, 40.0)]


@pytest.mark.django_db
def test_a_spliced_jobs_readings_count_each_of_its_gpus_once(alice, team_a, job_spec, client):
    node = make_node("g1", accelerator_type="H100-80GB")
    job = gpu_job(alice, team_a, job_spec, name="spliced", world_size=8, min_devices=4)
    assert job.device_count == 4  # 8 ranks, 2 on each GPU
    assert placement(alice, job.pk).json()[0]["reporting"] == 0  # nothing read yet
    heartbeat(node, READINGS)
    (row,) = placement(alice, job.pk).json()
    assert {k: row[k] for k in ("host", "first_rank", "last_rank", "devices", "utilization", "memory_used_gb",
                                "reporting")} == {
        "host": "g1", "first_rank": 0, "last_rank": 7, "devices": 4, "utilization": 0.75, "memory_used_gb": 100.0,
        "reporting": 4}  # 100 GiB, not 200: two ranks' replicas on each GPU
    assert row["read_at"] is not None
    client.force_login(alice)
    html = client.get(reverse("pages:job-detail", args=[job.pk])).content.decode()
    assert "75% busy, 100.0 GiB of device memory" in html and "(4 of 4 devices reporting)" in html


@pytest.mark.django_db
def test_a_job_spanning_hosts_shows_each_hosts_share_and_what_it_reported(alice, charlie, team_a, job_spec):
    make_node("g1", accelerator_type="H100-80GB")
    second = make_node("g2", accelerator_type="H100-80GB")
    other = make_node("c1")  # CPU slots: another type, never the job's
    job = gpu_job(alice, team_a, job_spec, name="wide", world_size=8, min_devices=8)
    heartbeat(second, [(0.5, 70.0)] * 4)
    heartbeat(other, [(1.0, 9.0)] * 4)  # not the job's devices: in none of its rows
    rows = placement(alice, job.pk).json()
    assert [(r["host"], r["first_rank"], r["last_rank"], r["devices"]) for r in rows] == [
        ("g1", 0, 3, 4), ("g2", 4, 7, 4)]
    assert [(r["utilization"], r["memory_used_gb"], r["reporting"]) for r in rows] == [
        (None, None, 0), (0.5, 280.0, 4)]
    # another team's job is none of charlie's business: not found, as every job API answers
    assert placement(charlie, job.pk).status_code == 404
