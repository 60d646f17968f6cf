"""Findings High 3 and Medium 6 (user side) and the Low input findings of the security review
(issue 15): every bad input is a 4xx naming the field with a message, never a 500.

Each case here was a 500 (or an accepted job the fleet could never run) on the code before."""
import json

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, Replica

JOBS = "/api/jobs/"


# --- High 3: world_size --------------------------------------------------------------------------


def test_a_huge_world_size_is_refused_with_the_limit(client_for, alice, job_spec, settings):
    settings.MERIDIAN_MAX_WORLD_SIZE = 4096
    response = client_for(alice).post(JOBS, job_spec(world_size=100_000, min_devices=100_000), format="json")

    assert response.status_code == 400
    message = response.json()["world_size"][0]
    assert "at most 4096" in message and "MERIDIAN_MAX_WORLD_SIZE" in message
    assert not Job.objects.exists() and not Replica.objects.exists()


def test_world_size_is_bounded_by_ranks_per_device_times_min_devices(client_for, alice, job_spec, settings):
    settings.MERIDIAN_MAX_RANKS_PER_DEVICE = 8
    client = client_for(alice)

    refused = client.post(JOBS, job_spec(world_size=32, min_devices=2), format="json")
    assert refused.status_code == 400
    assert "at most 16" in refused.json()["world_size"][0]
    assert "MERIDIAN_MAX_RANKS_PER_DEVICE" in refused.json()["world_size"][0]
    assert client.post(JOBS, job_spec(world_size=16, min_devices=2), format="json").status_code == 201


def test_the_fleet_bounds_min_devices_and_world_size(client_for, alice, job_spec, cpu_fleet, settings):
    # jobs may not span nodes (MERIDIAN_JOB_MAX_SPREAD=node): 4 CPU devices under one node at most
    settings.MERIDIAN_JOB_MAX_SPREAD = "node"
    settings.MERIDIAN_MAX_RANKS_PER_DEVICE = 4
    client = client_for(alice)

    too_many_devices = client.post(JOBS, job_spec(world_size=8, min_devices=8), format="json")
    assert too_many_devices.status_code == 400
    assert "at most 4 CPU device(s) in one node" in too_many_devices.json()["min_devices"][0]

    # at most 4 devices and 4 ranks on each: W=32 can never run, whatever min_devices says
    too_many_ranks = client.post(JOBS, job_spec(world_size=32, min_devices=8), format="json")
    assert too_many_ranks.status_code == 400
    assert "at most 4 CPU device(s)" in too_many_ranks.json()["min_devices"][0]
    assert client.post(JOBS, job_spec(world_size=32, min_devices=4), format="json").status_code == 400

    assert client.post(JOBS, job_spec(world_size=16, min_devices=4), format="json").status_code == 201


def test_a_wider_spread_counts_a_wider_group(client_for, alice, job_spec, cpu_fleet, settings):
    settings.MERIDIAN_JOB_MAX_SPREAD = "cluster"  # both nodes: 8 devices
    assert client_for(alice).post(JOBS, job_spec(world_size=8, min_devices=8), format="json").status_code == 201


def test_the_form_refuses_a_huge_world_size_too(client, alice, settings):
    client.force_login(alice)
    settings.MERIDIAN_MAX_WORLD_SIZE = 64
    response = client.post("/jobs/submit/", {
        "team": str(alice.memberships.get().team_id), "name": "big", "entrypoint": "train.py", "args": "",
        "world_size": "128", "min_devices": "128", "tier": "standard", "accelerator_type": "CPU", "env": ""})

    assert response.status_code == 200  # the form again, with the error at its field
    assert "at most 64" in response.content.decode()
    assert not Job.objects.exists()


# --- Medium 6: user input that was a 500 ---------------------------------------------------------


@pytest.mark.parametrize("total_steps", [2**63, 10**30])
def test_total_steps_beyond_the_column_is_a_400_in_the_api(client_for, alice, job_spec, total_steps):
    response = client_for(alice).post(JOBS, job_spec(total_steps=total_steps), format="json")

    assert response.status_code == 400
    assert "total_steps must be at most" in response.json()["total_steps"][0]


def test_total_steps_beyond_the_column_is_a_field_error_in_the_form(client, alice):
    client.force_login(alice)
    response = client.post("/jobs/submit/", {
        "team": str(alice.memberships.get().team_id), "name": "n", "entrypoint": "train.py", "args": "",
        "world_size": "4", "min_devices": "2", "tier": "standard", "accelerator_type": "CPU", "env": "",
        "total_steps": str(2**63)})

    assert response.status_code == 200
    assert "less than or equal to" in response.content.decode()
    assert not Job.objects.exists()


@pytest.mark.parametrize("url, field", [
    ("/api/jobs/?team=%C2%B2", None),  # "²": str.isdigit() is true, int() refuses it
    ("/api/jobs/?team=99999999999999999999999", None),
    ("/api/nodes/?cluster=1e20", "cluster"),
    ("/api/nodes/?cluster=99999999999999999999999", "cluster"),
    ("/api/accelerators/?node=1e20", "node"),
    ("/api/accelerators/?cluster=1e20", "cluster"),
    ("/api/accelerators/?node=99999999999999999999999", "node"),
    ("/api/fleet/utilization/?until=0001-01-01T00:00:00Z", "until"),
    ("/api/fleet/utilization/?node=99999999999999999999999", "node"),
])
def test_query_parameters_that_were_500s(client_for, alice, url, field):
    response = client_for(alice).get(url)

    if field is None:  # a team filter the user is not on: an empty list, not an error
        assert response.status_code == 200 and response.json()["results"] == []
    else:
        assert response.status_code == 400, response.content
        assert field in response.json()


@pytest.mark.parametrize("query", ["?cluster=%C2%B2", "?node=%C2%B2", "?cluster=99999999999999999999999"])
def test_page_drill_downs_that_were_500s(client, alice, query):
    client.force_login(alice)
    response = client.get("/" + query)

    assert response.status_code == 400
    assert "must be a whole number" in response.content.decode()


@pytest.mark.parametrize("url", [JOBS, "/api/auth/token/"])
def test_deeply_nested_json_is_a_400(client_for, alice, url):
    body = "[" * 100_000 + "]" * 100_000
    response = client_for(alice).post(url, body, content_type="application/json")

    assert response.status_code == 400
    assert "nested too deeply" in response.json()["detail"]


def test_json_a_little_too_deep_is_refused_before_any_field_sees_it(client_for, alice, job_spec):
    nested = "x"
    for _ in range(40):
        nested = [nested]
    response = client_for(alice).post(JOBS, json.dumps(job_spec(args=nested)), content_type="application/json")

    assert response.status_code == 400 and "at most 32 levels" in response.json()["detail"]


# --- Low ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["FOO\n", "FOO\nBAR", "1FOO", "FO-O", ""])
def test_a_bad_env_key_is_refused(client_for, alice, job_spec, key):
    response = client_for(alice).post(JOBS, job_spec(env={key: "x"}), format="json")

    assert response.status_code == 400
    assert "invalid environment variable name" in response.json()["env"][0]


def test_unknown_submit_fields_are_named_and_refused(client_for, alice, job_spec):
    response = client_for(alice).post(JOBS, job_spec(priority=99, gpus=8), format="json")

    assert response.status_code == 400
    message = response.json()["non_field_errors"][0]
    assert "'gpus'" in message and "'priority'" in message
    assert not Job.objects.exists()


def test_an_anonymous_api_call_is_a_401_with_a_challenge(db):
    response = APIClient().get(JOBS)

    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Token")


def test_an_api_error_that_is_a_bug_answers_json(client_for, alice, monkeypatch):
    import jobs.apis

    def broken(**kwargs):
        raise RuntimeError("a bug with a secret path /srv/x")

    monkeypatch.setattr(jobs.apis, "job_list_visible", broken)
    response = client_for(alice).get(JOBS)

    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert "internal error" in response.json()["detail"] and "/srv/x" not in response.content.decode()


def test_a_500_outside_the_api_views_is_json_under_api_too(rf):
    from portal.views import server_error

    api = server_error(rf.get("/api/jobs/"))
    page = server_error(rf.get("/jobs/"))

    assert api.status_code == 500 and api["Content-Type"] == "application/json"
    assert page.status_code == 500 and "html" in page["Content-Type"]
