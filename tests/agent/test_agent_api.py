"""The agent API: enrollment, per-node tokens, and a node reading and writing only its own state."""
import pytest
from rest_framework.test import APIClient

from fleet.models import Node
from fleet.services import node_token_revoke
from jobs.models import Job
from jobs.services import job_submit
from jobs.tick import tick_run

ENROLL = "enroll-secret"
DEVICES = [{"type": "CPU"}, {"type": "CPU"}]


@pytest.fixture(autouse=True)
def enrollment(settings):
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ENROLL
    settings.MERIDIAN_MIN_RUN_SECONDS = 0.0


def register(hostname, *, enroll=ENROLL, devices=DEVICES):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Enroll {enroll}")
    return client.post("/api/agent/register/", {"hostname": hostname, "region": "eu", "cluster": "c1",
                                                "devices": devices}, format="json")


def as_node(token):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return client


@pytest.mark.django_db
def test_registration_with_the_enrollment_token_returns_the_nodes_own_token():
    response = register("n1")

    assert response.status_code == 201, response.content
    node = Node.objects.get(hostname="n1")
    assert response.json()["node_id"] == node.pk and node.accelerators.count() == 2
    assert node.token_matches(response.json()["token"])


@pytest.mark.django_db
def test_registration_without_or_with_a_wrong_enrollment_token_is_refused():
    assert register("n1", enroll="guess").status_code == 403
    assert APIClient().post("/api/agent/register/", {"hostname": "n1"}, format="json").status_code == 401
    assert not Node.objects.filter(hostname="n1").exists()


@pytest.mark.django_db
def test_registration_is_disabled_without_a_configured_enrollment_token(settings):
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ""
    response = register("n1", enroll="anything")
    assert response.status_code == 403 and "MERIDIAN_AGENT_ENROLLMENT_TOKEN" in response.json()["detail"]


@pytest.mark.django_db
def test_a_bad_device_list_is_a_400_naming_the_device():
    response = register("n1", devices=[{"type": "TPU-9000"}])
    assert response.status_code == 400 and "TPU-9000" in str(response.json())


@pytest.mark.django_db
def test_heartbeat_with_a_wrong_or_revoked_token_is_a_401():
    token = register("n1").json()["token"]
    assert as_node("not-a-token").post("/api/agent/heartbeat/", {"jobs": []}, format="json").status_code == 401
    assert APIClient().post("/api/agent/heartbeat/", {"jobs": []}, format="json").status_code in (401, 403)
    node_token_revoke(node=Node.objects.get(hostname="n1"))
    assert as_node(token).post("/api/agent/heartbeat/", {"jobs": []}, format="json").status_code == 401


@pytest.mark.django_db
def test_registering_an_enrolled_node_again_takes_its_own_token_and_keeps_it():
    token = register("n1").json()["token"]
    # issue 15: the enrollment token used to re-issue an enrolled node's token (a takeover)
    assert register("n1").status_code == 403
    again = as_node(token).post("/api/agent/register/", {"hostname": "n1", "region": "eu", "cluster": "c1",
                                                         "devices": DEVICES}, format="json")
    assert again.status_code == 201 and again.json()["token"] == token
    assert as_node(token).get("/api/agent/desired/").status_code == 200


@pytest.mark.django_db
def test_a_node_reads_only_its_own_desired_state():
    first = register("n1").json()
    second = register("n2").json()
    client = as_node(first["token"])
    assert client.get(f"/api/agent/nodes/{first['node_id']}/desired/").status_code == 200
    assert client.get(f"/api/agent/nodes/{second['node_id']}/desired/").status_code == 403


@pytest.mark.django_db
def test_a_node_cannot_report_on_a_job_placed_on_another_node(alice, team_a, job_spec):
    first = register("n1", devices=[{"type": "CPU"}]).json()
    second = register("n2", devices=[{"type": "CPU"}]).json()
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1, tier="basic"))
    tick_run()
    job.refresh_from_db()
    owner, intruder = (first, second) if job.replicas.first().device.node_id == first["node_id"] else (second, first)

    response = as_node(intruder["token"]).post("/api/agent/heartbeat/", {"jobs": [
        {"job_id": job.pk, "state": "finished", "step": 99}]}, format="json")

    job.refresh_from_db()
    assert response.status_code == 200
    assert response.json()["rejected"][0]["job_id"] == job.pk and response.json()["accepted"] == []
    assert job.state == Job.State.SCHEDULED and job.progress_step == 0
    answer = as_node(owner["token"]).post("/api/agent/heartbeat/", {"jobs": [
        {"job_id": job.pk, "state": "running", "step": 5, "devices": 1}], "telemetry": {"utilization": 0.25}},
        format="json").json()
    job.refresh_from_db()
    assert answer["accepted"] == [job.pk] and job.state == Job.State.RUNNING and job.progress_step == 5
    assert [e["job_id"] for e in answer["desired"]["jobs"]] == [job.pk]
    assert Node.objects.get(pk=owner["node_id"]).utilization == 0.25


@pytest.mark.django_db
def test_a_report_of_a_stale_generation_is_rejected_with_fence_and_changes_nothing(alice, team_a, job_spec):
    owner = register("n1", devices=[{"type": "CPU"}]).json()
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1, tier="basic"))
    tick_run()
    job.refresh_from_db()
    desired = as_node(owner["token"]).get("/api/agent/desired/").json()
    assert desired["jobs"][0]["generation"] == job.generation == 1 and desired["lost_after_seconds"] > 0

    answer = as_node(owner["token"]).post("/api/agent/heartbeat/", {"jobs": [
        {"job_id": job.pk, "generation": 0, "state": "running", "step": 50, "devices": 1,
         "checkpoint": {"step": 50, "uri": "file:///stale/50", "bytes": 1, "engine": "framework"}}]},
        format="json").json()

    job.refresh_from_db()
    assert answer["accepted"] == [] and answer["rejected"][0]["fence"] is True
    assert job.state == Job.State.SCHEDULED and job.progress_step == 0 and job.last_checkpoint_step is None


@pytest.mark.django_db
def test_a_running_copy_of_a_cancelled_job_is_rejected_with_cancel_and_its_stop_accepted(alice, team_a, job_spec):
    from jobs.services import job_cancel

    owner = register("n1", devices=[{"type": "CPU"}]).json()
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1, tier="basic"))
    tick_run()
    node = as_node(owner["token"])
    node.post("/api/agent/heartbeat/", {"jobs": [{"job_id": job.pk, "generation": 1, "state": "running", "step": 5,
                                                   "devices": 1}]}, format="json")
    job_cancel(job=Job.objects.get(pk=job.pk), by=alice)

    answer = node.post("/api/agent/heartbeat/", {"jobs": [
        {"job_id": job.pk, "generation": 1, "state": "running", "step": 9, "devices": 1}]}, format="json").json()

    assert answer["accepted"] == [] and answer["rejected"][0]["cancel"] is True
    assert "cancelled" in answer["rejected"][0]["error"] and answer["desired"]["jobs"] == []
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED and job.progress_step == 5
    # An agent that had stopped it already reports the stop: accepted, nothing to kill.
    stopped = node.post("/api/agent/heartbeat/", {"jobs": [
        {"job_id": job.pk, "generation": 1, "state": "stopped", "step": 9, "devices": 1}]}, format="json").json()
    assert stopped["accepted"] == [job.pk] and stopped["rejected"] == []


@pytest.mark.django_db
@pytest.mark.parametrize("body, field", [
    ({"jobs": [{"job_id": "abc"}]}, "jobs.0.job_id"),
    ({"telemetry": []}, "telemetry"),
    ({"jobs": [{"job_id": 1, "state": "running", "step": -1}]}, "jobs.0.step"),
    ({"jobs": [{"job_id": 1, "state": "running"}] * 1025}, "jobs"),
    ([{"job_id": 1, "state": "running"}], "non_field_errors"),
    ({"v": 2, "jobs": []}, "v"),
], ids=["string-job-id", "list-for-telemetry", "negative-step", "too-many-jobs", "non-object", "newer-version"])
def test_a_malformed_heartbeat_is_a_400_naming_the_field_and_changes_nothing(body, field):
    node = as_node(register("n1").json()["token"])
    before = Node.objects.get(hostname="n1").last_heartbeat

    response = node.post("/api/agent/heartbeat/", body, format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == [field] and response.json()[field][0]
    assert Node.objects.get(hostname="n1").last_heartbeat == before


@pytest.mark.django_db
@pytest.mark.parametrize("devices, field", [
    ("CPU", "devices"),
    ([{"type": 5}], "devices.0.type"),
    ([{"memory_gb": 80}], "devices.0.type"),
    ([{"type": "CPU"}] * 65, "devices"),
], ids=["string", "number-type", "no-type", "too-many"])
def test_registration_with_a_malformed_device_list_is_a_400_naming_the_field(devices, field):
    response = register("n1", devices=devices)

    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Node.objects.filter(hostname="n1").exists()


@pytest.mark.django_db
def test_registration_with_a_wrong_enrollment_token_is_refused_before_its_body_is_read():
    assert register("n1", enroll="guess", devices="CPU").status_code == 403


@pytest.mark.django_db
def test_the_heartbeat_answer_is_a_heartbeat_answer_with_the_jobs_device_indices(alice, team_a, job_spec):
    from protocol.node import HeartbeatAnswer

    owner = register("n1", devices=[{"type": "CPU"}] * 3).json()
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=2, min_devices=2, tier="basic"))
    tick_run()

    wire = as_node(owner["token"]).post("/api/agent/heartbeat/", {"jobs": []}, format="json").json()

    answer = HeartbeatAnswer.from_dict(wire)
    entry = answer.desired.jobs[0]
    held = sorted(job.replicas.values_list("device__index", flat=True).distinct())
    assert entry.job_id == job.pk and entry.devices == 2 and list(entry.device_indices) == held
    assert answer.heartbeat_seconds == 5.0 and answer.desired.node_id == owner["node_id"]


@pytest.mark.django_db
def test_the_openapi_schema_names_the_agent_messages(client):
    schema = client.get("/api/schema/", {"format": "json"}).json()

    heartbeat = schema["paths"]["/api/agent/heartbeat/"]["post"]
    assert heartbeat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/HeartbeatRequest")
    components = schema["components"]["schemas"]
    assert components["HeartbeatRequest"]["properties"]["jobs"]["maxItems"] == 1024
    assert {"RegistrationRequest", "RegistrationAnswer", "HeartbeatAnswer", "DesiredState"} <= set(components)
