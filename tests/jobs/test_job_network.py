"""A job's network (issue 13): isolated (loopback only) unless it asks for the node's network, which
the control plane grants only where the operator allows it (MERIDIAN_JOB_HOST_NETWORK=allow); a
refused request is a 400 naming the setting. The desired state carries the choice to the agent
(which writes it into the job's sandbox.json: tests/sandbox/test_network.py runs it)."""
import pytest
from django.conf import settings
from rest_framework.test import APIClient

from fleet.agent_services import node_register
from jobs.models import Job
from jobs.services import HOST_NETWORK_DENIED, job_submit
from jobs.tick import tick_run
from jobs.workflows import node_desired_state

URL = "/api/jobs/"


@pytest.fixture(autouse=True)
def policy(short_policy):
    """short_policy (tests/jobs/conftest.py)."""


def _client(user):
    client = APIClient()
    client.force_authenticate(user)
    return client


def _desired_network(job):
    """Returns the network the desired state tells the job's node (after a tick placed the job)."""
    node, _token = node_register(enrollment=settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN, hostname="n1", region="eu",
                                 cluster="c1", devices=[{"type": "CPU"}])
    tick_run()
    return {e["job_id"]: e for e in node_desired_state(node=node)["jobs"]}[job.pk]["network"]


def test_a_job_is_isolated_unless_it_asks(alice, job_spec):
    response = _client(alice).post(URL, job_spec(world_size=1, min_devices=1), format="json")

    assert response.status_code == 201, response.content
    assert response.json()["network"] == "isolated"
    assert _desired_network(Job.objects.get(pk=response.json()["id"])) == "isolated"


def test_the_host_network_is_refused_where_the_operator_denies_it_naming_the_setting(alice, job_spec):
    assert settings.MERIDIAN_JOB_HOST_NETWORK == "deny"  # the default a security-minded operator expects
    response = _client(alice).post(URL, job_spec(network="host"), format="json")

    assert response.status_code == 400
    assert response.json()["network"] == [HOST_NETWORK_DENIED]
    assert "MERIDIAN_JOB_HOST_NETWORK" in HOST_NETWORK_DENIED
    assert not Job.objects.exists()


def test_the_host_network_is_granted_where_the_operator_allows_it(alice, job_spec, settings):
    settings.MERIDIAN_JOB_HOST_NETWORK = "allow"
    response = _client(alice).post(URL, job_spec(world_size=1, min_devices=1, network="host"), format="json")

    assert response.status_code == 201, response.content
    assert response.json()["network"] == "host"
    assert _desired_network(Job.objects.get(pk=response.json()["id"])) == "host"


def test_an_unknown_network_is_a_400_that_lists_the_choices(alice, job_spec):
    response = _client(alice).post(URL, job_spec(network="none"), format="json")

    assert response.status_code == 400
    assert response.json()["network"] == ['network must be one of isolated, host, got "none"']


def test_the_service_refuses_what_the_api_refuses(alice, team_a, job_spec):
    """Every entry point (the portal form, bulk submissions) goes through job_spec_clean."""
    from django.core.exceptions import ValidationError
    with pytest.raises(ValidationError, match="MERIDIAN_JOB_HOST_NETWORK"):
        job_submit(team=team_a, submitted_by=alice, spec=job_spec(network="host"))


def test_the_submit_page_refuses_the_host_network_on_the_field(alice, team_a, job_spec, client):
    client.force_login(alice)
    spec = job_spec(world_size=1, min_devices=1)
    form = {"team": str(team_a.pk), "name": spec["name"],
            "entrypoint": spec["entrypoint"], "args": "", "world_size": 1, "min_devices": 1, "tier": "standard",
            "accelerator_type": "CPU", "env": "", "network": "host"}
    response = client.post("/jobs/submit/", form)

    assert response.status_code == 200  # the form again, with the reason on its field
    assert "MERIDIAN_JOB_HOST_NETWORK" in response.content.decode()
    assert not Job.objects.exists()


def test_the_job_page_shows_its_network(alice, job_spec, client):
    client.force_login(alice)
    job_id = _client(alice).post(URL, job_spec(), format="json").json()["id"]
    page = client.get(f"/jobs/{job_id}/").content.decode()

    assert 'data-testid="job-network">Isolated (loopback only)</td>' in page
