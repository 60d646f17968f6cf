"""POST /api/jobs/: a valid spec makes a pending job; each bad input is a 400 that says
what to fix; nothing is ever a 500."""
import json

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, JobEvent

URL = "/api/jobs/"


@pytest.fixture
def client_for():
    def make(user):
        client = APIClient()
        client.force_authenticate(user)
        return client

    return make


def test_it_submits_a_job_with_w_unplaced_replicas(client_for, alice, team_a, job_spec):
    response = client_for(alice).post(URL, job_spec(world_size=8, min_devices=2, tier="premium"), format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["tier"], body["world_size"], body["is_elastic"]) == ("pending", "premium", 8, True)
    assert body["team"]["slug"] == "team-a" and body["submitted_by"] == "alice"
    job = Job.objects.get(pk=body["id"])
    assert list(job.replicas.values_list("rank", "device")) == [(r, None) for r in range(8)]
    assert JobEvent.objects.filter(job=job, type=JobEvent.Type.SUBMITTED, actor=alice).exists()


def test_a_job_may_ask_to_start_again_from_scratch_when_its_resume_is_refused(client_for, alice, job_spec):
    response = client_for(alice).post(URL, job_spec(if_resume_refused="restart"), format="json")

    assert response.status_code == 201, response.content
    assert response.json()["if_resume_refused"] == "restart"
    assert Job.objects.get(pk=response.json()["id"]).if_resume_refused == Job.ResumeRefused.RESTART
    # Left out, a refused resume fails the job (what every job did before it could choose).
    default = client_for(alice).post(URL, job_spec(), format="json").json()
    assert default["if_resume_refused"] == "fail"
    assert client_for(alice).get(f"/api/jobs/{default['id']}/").json()["if_resume_refused"] == "fail"


def test_a_user_on_two_teams_names_the_team(client_for, carol, job_spec):
    response = client_for(carol).post(URL, job_spec(), format="json")

    assert response.status_code == 400
    assert "say which team" in response.json()["team"][0]
    assert client_for(carol).post(URL, job_spec(team="team-b"), format="json").status_code == 201


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"tier": "gold"}, "tier", 'unknown tier "gold"; choose one of premium, standard, basic'),
        ({"accelerator_type": "H900"}, "accelerator_type", 'unknown accelerator type "H900"; known types: H100-80GB'),
        ({"world_size": 0}, "world_size", "world_size (W, logical ranks) must be at least 1"),
        ({"world_size": -3}, "world_size", "world_size (W, logical ranks) must be at least 1"),
        ({"world_size": "eight"}, "world_size", "A valid integer is required"),
        ({"world_size": 8, "min_devices": 3}, "min_devices", "min_devices must divide world_size 8"),
        ({"world_size": 4, "min_devices": 8}, "min_devices", "min_devices must be between 1 and world_size (4)"),
        ({"args": "--epochs 3"}, "args", "Expected a list"),
        ({"env": {"1BAD": "x"}}, "env", "invalid environment variable name"),
        ({"entrypoint": ""}, "entrypoint", "may not be blank"),
        ({"team": "team-b"}, "team", 'you are not on a team "team-b"; your teams: team-a'),
        ({"if_resume_refused": "retry"}, "if_resume_refused", 'if_resume_refused must be one of fail, restart'),
        ({"if_resume_refused": None}, "if_resume_refused", "may not be null"),
    ],
    ids=["unknown-tier", "unknown-type", "zero-ranks", "negative-ranks", "ranks-not-a-number",
         "min-devices-not-dividing-w", "min-devices-above-w", "args-not-a-list", "bad-env-name",
         "empty-entrypoint", "someone-elses-team", "unknown-resume-policy", "null-resume-policy"],
)
def test_it_rejects_bad_input_with_an_actionable_message(client_for, alice, job_spec, overrides, field, message):
    response = client_for(alice).post(URL, job_spec(**overrides), format="json")

    assert response.status_code == 400, response.content
    assert message in " ".join(map(str, response.json()[field]))
    assert not Job.objects.exists()


def test_it_rejects_a_job_over_the_team_quota(client_for, alice, team_a, job_spec):
    team_a.quotas = {"CPU": 6}
    team_a.save()
    assert client_for(alice).post(URL, job_spec(world_size=4, min_devices=4), format="json").status_code == 201

    response = client_for(alice).post(URL, job_spec(world_size=4, min_devices=4), format="json")

    assert response.status_code == 400
    assert (
        "over team quota: team Team A may claim 6 CPU device(s); its unfinished jobs already claim 4"
        in response.json()["min_devices"][0]
    )
    assert Job.objects.count() == 1


def test_a_type_without_quota_is_rejected(client_for, alice, team_a, job_spec):
    team_a.quotas = {"CPU": 8}
    team_a.save()

    response = client_for(alice).post(URL, job_spec(accelerator_type="H200-141GB"), format="json")

    assert response.status_code == 400
    assert "may claim 0 H200-141GB" in response.json()["min_devices"][0]


def test_it_rejects_malformed_json(client_for, alice):
    response = client_for(alice).post(URL, '{"name": "x", ', content_type="application/json")

    assert response.status_code == 400
    assert "malformed JSON" in response.json()["detail"]


def test_it_rejects_a_json_body_that_is_not_an_object(client_for, alice):
    response = client_for(alice).post(URL, "[1, 2]", content_type="application/json")

    assert response.status_code == 400
    assert "Expected a dictionary" in json.dumps(response.json())


def test_it_refuses_an_oversized_body_with_413_not_500(client_for, alice, job_spec, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    body = json.dumps(job_spec(args=["x" * 20_000]))

    response = client_for(alice).post(URL, body, content_type="application/json")

    assert response.status_code == 413
    assert "larger than 10000 bytes" in response.json()["detail"]
    assert not Job.objects.exists()


def test_an_anonymous_caller_is_asked_to_authenticate(job_spec, db):
    response = APIClient().post(URL, job_spec(), format="json")

    assert response.status_code in (401, 403)
    assert "credentials were not provided" in response.json()["detail"]


def test_a_token_authenticates(alice, job_spec):
    client = APIClient()
    token = client.post(
        "/api/auth/token/", {"username": "alice", "password": "alice-demo-pass"}, format="json"
    ).json()["token"]
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")

    assert client.post(URL, job_spec(), format="json").status_code == 201
