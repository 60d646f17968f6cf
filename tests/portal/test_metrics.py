"""GET /metrics: Prometheus' exposition of the tick, heartbeats, queue, devices and moves, for an
operator token only, read from the metric files without a database query."""
import re

import pytest
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.models import Region
from jobs.services import job_submit
from jobs.tick import tick_run
from observability import metrics

TOKEN = "operator-metrics-token-for-tests"
ENROLL = "metrics-enroll"


@pytest.fixture(autouse=True)
def operator_token(settings):
    settings.MERIDIAN_METRICS_TOKEN = TOKEN
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ENROLL


def scrape(token=TOKEN):
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return response.content.decode()


def sample(text, name, **labels):
    """Returns the value of sample `name` with exactly `labels` in a scrape (0 when absent)."""
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if found == {k: str(v) for k, v in labels.items()}:
            return float(match.group(3))
    return 0.0


def register(hostname):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Enroll {ENROLL}")
    response = client.post("/api/agent/register/", {"hostname": hostname, "region": "eu", "cluster": "c1",
                                                    "devices": [{"type": "CPU"}, {"type": "CPU"}]}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["token"]


@pytest.mark.django_db
def test_a_tick_and_heartbeats_move_the_counters_and_gauges(alice, team_a, job_spec):
    node_token = register("m1")
    job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=2, min_devices=2, tier="basic"))
    job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=2, min_devices=2, tier="basic",
                                                               name="second"))
    before = scrape()

    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {node_token}")
    assert agent.post("/api/agent/heartbeat/", {"jobs": []}, format="json").status_code == 200
    intruder = APIClient()
    intruder.credentials(HTTP_AUTHORIZATION="Node not-a-token")
    assert intruder.post("/api/agent/heartbeat/", {"jobs": []}, format="json").status_code == 401
    result = tick_run()
    assert result.ran and result.counts["start"] == 1
    tick_run()  # its snapshot sees the devices the first one gave
    after = scrape()

    def moved(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("meridian_heartbeats_received_total") == 2
    assert moved("meridian_heartbeats_rejected_total", status=401) == 1
    for phase in ("snapshot", "plan", "apply", "total"):
        assert moved("meridian_tick_duration_seconds_count", phase=phase) == 2
    assert moved("meridian_tick_decisions_total", kind="start") == 1
    region = Region.objects.get(name="eu").pk
    # the second job finds the node's 2 devices taken: it waits
    assert sample(after, "meridian_queue_depth", tier="basic", accelerator_type="CPU") == 1
    assert sample(after, "meridian_queue_depth", tier="premium", accelerator_type="CPU") == 0
    assert sample(after, "meridian_queue_wait_seconds", tier="basic", accelerator_type="CPU", stat="max") > 0
    assert sample(after, "meridian_devices", accelerator_type="CPU", region=region, state="allocated") == 2
    assert sample(after, "meridian_devices", accelerator_type="CPU", region=region, state="free") == 0


def test_move_metrics_count_by_kind_and_outcome():
    before = scrape()
    metrics.move_step_observed(kind="migration", step="cut", seconds=1.5, last=False)
    metrics.move_step_observed(kind="migration", step="release", seconds=0.2, last=True)
    metrics.move_ended(kind="preemption", outcome="timed_out")
    after = scrape()
    assert sample(after, "meridian_move_step_duration_seconds_count", kind="migration", step="cut") - \
        sample(before, "meridian_move_step_duration_seconds_count", kind="migration", step="cut") == 1
    assert sample(after, "meridian_moves_total", kind="migration", outcome="done") - \
        sample(before, "meridian_moves_total", kind="migration", outcome="done") == 1
    assert sample(after, "meridian_moves_total", kind="preemption", outcome="timed_out") - \
        sample(before, "meridian_moves_total", kind="preemption", outcome="timed_out") == 1


@pytest.mark.django_db
def test_a_scrape_queries_no_database(django_assert_num_queries):
    with django_assert_num_queries(0):
        scrape()


@pytest.mark.django_db
def test_only_the_operator_token_opens_it(admin_user, settings):
    anonymous = Client().get("/metrics")
    assert anonymous.status_code == 401 and anonymous.has_header("WWW-Authenticate")
    session = Client()
    session.force_login(admin_user)  # a global admin's session is not the operator token
    assert session.get("/metrics").status_code == 401
    user_token = Token.objects.create(user=admin_user).key
    assert Client().get("/metrics", HTTP_AUTHORIZATION=f"Token {user_token}").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {user_token}").status_code == 403
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    assert Client().post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405
    settings.MERIDIAN_METRICS_TOKEN = ""
    refused = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert refused.status_code == 403 and "MERIDIAN_METRICS_TOKEN" in refused.json()["detail"]
