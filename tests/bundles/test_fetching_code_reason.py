"""The control plane's side of the agent's background bundle fetch: a placed job whose copy is
starting while its node fetches the code says so (its wait reason, an event each time the reason
changes), and the reason goes once the copy runs."""
import pytest
from rest_framework.test import APIClient

from fleet.models import Node
from jobs.models import Job, JobEvent
from jobs.services import job_submit
from jobs.tick import tick_run

ENROLL = "fetch-enrollment-token"
pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def policy(settings, tmp_path):
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ENROLL
    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")


def node_client(hostname):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Enroll {ENROLL}")
    token = client.post("/api/agent/register/", {"hostname": hostname, "region": "eu", "cluster": "c1",
                                                 "devices": [{"type": "CPU"}]}, format="json").json()["token"]
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return client


def report(client, job, **fields):
    answer = client.post("/api/agent/heartbeat/", {"jobs": [{"job_id": job.pk, "generation": job.generation,
                                                             **fields}]}, format="json")
    assert answer.status_code == 200, answer.content
    job.refresh_from_db()
    return answer.json()


def test_a_job_whose_node_fetches_its_code_says_so_until_it_runs(alice, team_a, job_spec):
    client = node_client("node-a")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1))
    tick_run()
    job.refresh_from_db()
    assert job.state == Job.State.SCHEDULED and Node.objects.filter(accelerators__replicas__job=job).exists()
    fetching = "fetching code (bundle 0123456789ab…)"

    assert report(client, job, state="starting", waiting=fetching)["accepted"] == [job.pk]
    assert job.wait_reason == f"{fetching} on node-a"
    report(client, job, state="starting", waiting=fetching)  # the same reason: no second event
    failed = f"{fetching}: the last try failed: HTTP 503; trying again"
    report(client, job, state="starting", waiting=failed)
    messages = list(JobEvent.objects.filter(job=job, type=JobEvent.Type.MESSAGE).values_list("reason", flat=True))
    assert messages == [f"{fetching} on node-a", f"{failed} on node-a"]

    report(client, job, state="running", step=1)
    assert job.state == Job.State.RUNNING and job.wait_reason == ""
