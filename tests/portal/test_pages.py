"""The dashboard pages through Django's test client: roles and isolation, the submit
form's errors at their fields, cancel with CSRF, approvals, the fleet data levels.

Cast (tests/conftest.py): alice and bob on team A, charlie on team B, carol a capacity
manager of A and B, admin a superuser.
"""
import json

import pytest
from django.test import Client
from django.urls import reverse

from fleet.models import Accelerator, Cluster, Node
from fleet.selectors import fleet_summary
from fleet.services import fleet_generate
from jobs.models import Job, JobEvent, PreemptionRequest, Replica
from jobs.services import job_event_add, job_transition, preemption_request_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_for():
    def make(user, **kwargs):
        client = Client(**kwargs)
        client.force_login(user)
        return client

    return make


@pytest.fixture
def small_fleet(db):
    # 2 regions × 2 clusters × 3 nodes × 4 CPU devices = 48 devices
    fleet_generate(regions=2, clusters=2, nodes=3, devices=4, accelerator_type="CPU", prefix="t")
    return Accelerator.objects.order_by("id")


def place(job, devices):
    """Puts the job's ranks on `devices` (round robin) and marks it scheduled, as the
    control loop's apply does (jobs/tick.py plan_apply), in one transaction."""
    from django.db import transaction

    with transaction.atomic():
        job = job_transition(job=job, to="scheduled", reason="test placement")
        replicas = list(Replica.objects.filter(job=job).order_by("rank"))
        for replica in replicas:
            replica.device = devices[replica.rank % len(devices)]
        Replica.objects.bulk_update(replicas, ["device"])
        Job.objects.filter(pk=job.pk).update(device_count=len(devices))
        job_event_add(
            job=job, type=JobEvent.Type.PLACED,
            extra={"devices": [d.pk for d in devices], "nodes": sorted({d.node_id for d in devices})},
        )
    job.refresh_from_db()
    return job


def test_every_page_needs_a_login(client):
    for name in ("pages:fleet", "pages:job-list", "pages:job-submit", "pages:approvals", "pages:teams"):
        response = client.get(reverse(name))
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("login"))


def test_pages_render_for_a_member(client_for, alice, small_fleet):
    client = client_for(alice)
    for name in ("pages:fleet", "pages:job-list", "pages:job-submit", "pages:teams"):
        response = client.get(reverse(name))
        assert response.status_code == 200, name
        assert b"Approvals</a>" not in response.content


def test_a_submitter_is_refused_the_approvals_page(client_for, alice, carol):
    assert client_for(alice).get(reverse("pages:approvals")).status_code == 403
    response = client_for(carol).get(reverse("pages:approvals"))
    assert response.status_code == 200
    assert b'data-testid="nav-approvals"' in response.content


def test_another_teams_job_is_a_404(client_for, alice, charlie, team_a, submit):
    job = submit(team_a, alice)
    assert client_for(charlie).get(reverse("pages:job-detail", args=[job.pk])).status_code == 404
    assert client_for(charlie).get(reverse("pages:job-detail", args=[job.pk]) + "?format=json").status_code == 404
    assert client_for(charlie).post(reverse("pages:job-cancel", args=[job.pk])).status_code == 404
    response = client_for(charlie).get(reverse("pages:job-list"))
    assert job.name.encode() not in response.content or f'data-job-id="{job.pk}"'.encode() not in response.content
    assert f'data-job-id="{job.pk}"'.encode() not in response.content


def test_the_job_list_filters_by_state_tier_team_and_type(client_for, alice, carol, team_a, team_b, submit):
    premium = submit(team_a, alice, name="premium-one", tier="premium")
    basic = submit(team_a, alice, name="basic-one", tier="basic")
    other = submit(team_b, carol, name="team-b-one", tier="basic")
    client = client_for(carol)
    content = client.get(reverse("pages:job-list") + "?tier=premium").content.decode()
    assert f'data-job-id="{premium.pk}"' in content and f'data-job-id="{basic.pk}"' not in content
    content = client.get(reverse("pages:job-list") + f"?team={team_b.pk}").content.decode()
    assert f'data-job-id="{other.pk}"' in content and f'data-job-id="{premium.pk}"' not in content
    content = client.get(reverse("pages:job-list") + "?state=running").content.decode()
    assert "No jobs match." in content
    content = client.get(reverse("pages:job-list") + "?accelerator_type=CPU&fragment=rows").content.decode()
    assert "<html" not in content and f'data-job-id="{premium.pk}"' in content


def test_the_job_list_costs_a_constant_number_of_queries(
    client_for, alice, team_a, submit, django_assert_max_num_queries
):
    for i in range(12):
        submit(team_a, alice, name=f"job-{i}", min_devices=1)
    client = client_for(alice)
    with django_assert_max_num_queries(10):
        response = client.get(reverse("pages:job-list"))
    assert response.content.count(b"data-job-id=") == 12


def test_submit_creates_the_job_through_the_service(client_for, alice, team_a):
    response = client_for(alice).post(
        reverse("pages:job-submit"),
        {
            "team": team_a.pk, "name": "from-the-form", "entrypoint": "train.py", "args": '--lr "0.1" --epochs 3',
            "world_size": 8, "min_devices": 2, "tier": "premium", "accelerator_type": "CPU", "env": "SEED=1\nMODE=fast",
        },
    )
    job = Job.objects.get(name="from-the-form")
    assert response.status_code == 302 and response["Location"] == reverse("pages:job-detail", args=[job.pk])
    assert job.args == ["--lr", "0.1", "--epochs", "3"]
    assert job.env == {"SEED": "1", "MODE": "fast"}
    assert (job.world_size, job.min_devices, job.tier, job.submitted_by) == (8, 2, "premium", alice)
    assert job.events.filter(type=JobEvent.Type.SUBMITTED).exists()


def test_submit_lets_a_job_start_again_from_scratch_and_its_page_says_so(client_for, alice, team_a):
    fields = {"team": team_a.pk, "entrypoint": "train.py", "world_size": 2, "min_devices": 1, "tier": "basic",
              "accelerator_type": "CPU"}
    client = client_for(alice)
    client.post(reverse("pages:job-submit"), {**fields, "name": "own-snapshots", "if_resume_refused": "restart"})
    client.post(reverse("pages:job-submit"), {**fields, "name": "seeded"})
    refused = client.post(reverse("pages:job-submit"), {**fields, "name": "odd", "if_resume_refused": "retry"})

    restart, seeded = Job.objects.get(name="own-snapshots"), Job.objects.get(name="seeded")
    assert (restart.if_resume_refused, seeded.if_resume_refused) == ("restart", "fail")
    assert refused.status_code == 200 and "retry" in " ".join(refused.context["form"].errors["if_resume_refused"])
    page = client.get(reverse("pages:job-detail", args=[restart.pk])).content.decode()
    assert '<td data-testid="job-if-resume-refused">Start again from scratch</td>' in page


def test_submit_shows_the_services_errors_at_their_fields(client_for, alice, team_a):
    response = client_for(alice).post(
        reverse("pages:job-submit"),
        {"team": team_a.pk, "name": "bad", "entrypoint": "train.py", "world_size": 6, "min_devices": 4,
         "tier": "standard", "accelerator_type": "CPU", "env": "1BAD=x"},
    )
    assert response.status_code == 200
    form = response.context["form"]
    assert "must divide world_size 6" in " ".join(form.errors["min_devices"])
    assert 'data-testid="error-min_devices"' in response.content.decode()
    assert not Job.objects.filter(name="bad").exists()


def test_submit_over_quota_names_min_devices(client_for, alice, team_a):
    team_a.quotas = {"CPU": 2}
    team_a.save()
    response = client_for(alice).post(
        reverse("pages:job-submit"),
        {"team": team_a.pk, "name": "big", "entrypoint": "t.py", "world_size": 4, "min_devices": 4,
         "tier": "basic", "accelerator_type": "CPU"},
    )
    assert "over team quota" in " ".join(response.context["form"].errors["min_devices"])


def test_submit_refuses_a_team_the_user_is_not_on(client_for, alice, team_b):
    response = client_for(alice).post(
        reverse("pages:job-submit"),
        {"team": team_b.pk, "name": "sneaky", "entrypoint": "t.py", "world_size": 1, "min_devices": 1,
         "tier": "basic", "accelerator_type": "CPU"},
    )
    assert response.status_code == 200 and "team" in response.context["form"].errors
    assert not Job.objects.filter(name="sneaky").exists()


def test_cancel_needs_the_csrf_token(client_for, alice, team_a, submit):
    job = submit(team_a, alice)
    client = client_for(alice, enforce_csrf_checks=True)
    assert client.post(reverse("pages:job-cancel", args=[job.pk])).status_code == 403
    job.refresh_from_db()
    assert job.state == "pending"
    page = client.get(reverse("pages:job-detail", args=[job.pk]))
    token = page.context["csrf_token"]
    response = client.post(reverse("pages:job-cancel", args=[job.pk]), {"csrfmiddlewaretoken": str(token)})
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == "cancelled"


def test_a_pending_job_shows_its_place_in_line_and_reason(client_for, alice, team_a, submit):
    first = submit(team_a, alice, name="first")
    second = submit(team_a, alice, name="second")
    data = client_for(alice).get(reverse("pages:job-detail", args=[second.pk]) + "?format=json").json()
    assert data["job"]["queue_position"] == 2 and data["job"]["queue_position_source"] == "submission order"
    Job.objects.filter(pk=first.pk).update(queue_position=7, wait_reason="waiting for 2 free CPU devices")
    page = client_for(alice).get(reverse("pages:job-detail", args=[first.pk])).content.decode()
    assert "waiting for 2 free CPU devices" in page and 'data-testid="queue-position">7' in page


def test_the_timeline_has_state_and_placement_lanes(client_for, alice, team_a, submit, small_fleet):
    job = submit(team_a, alice, world_size=4, min_devices=2)
    devices = list(small_fleet[:2])
    job = place(job, devices)
    job = job_transition(job=job, to="running")
    data = client_for(alice).get(reverse("pages:job-detail", args=[job.pk]) + "?format=json").json()
    lanes = [(s["lane"], s["label"]) for s in data["timeline"]["segments"]]
    assert ("state", "pending") in lanes and ("state", "running") in lanes
    hostname = Node.objects.get(pk=devices[0].node_id).hostname
    assert any(lane == "placement" and hostname in label and "2 devices" in label for lane, label in lanes)
    assert "summary_html" in data and "events_html" in data


def test_approvals_show_the_blast_radius_and_decide(client_for, alice, carol, team_a, submit, small_fleet):
    job = place(submit(team_a, alice, tier="standard"), list(small_fleet[:4]))
    job = job_transition(job=job, to="running")
    Job.objects.filter(pk=job.pk).update(
        progress_step=1500, last_checkpoint_step=1200, attained_device_seconds=50, ideal_device_seconds=100
    )
    request = preemption_request_create(job=job, reason="premium job needs CPU devices", lost_work_seconds=321.0)
    client = client_for(carol)
    page = client.get(reverse("pages:approvals")).content.decode()
    assert f'data-request-id="{request.pk}"' in page
    assert "321 device-s" in page and "(300 steps)" in page and "0.500" in page and "Standard" in page
    response = client.post(
        reverse("pages:approval-decide", args=[request.pk]), {"decision": "approve", "note": "ok, go"}
    )
    assert response.status_code == 302
    request.refresh_from_db()
    assert (request.state, request.decided_by, request.note) == ("approved", carol, "ok, go")
    trail = client.get(reverse("pages:approvals") + "?fragment=rows").content.decode()
    assert "ok, go" in trail and "approved" in trail and "No preemption waits for a decision." in trail


def test_a_member_cannot_decide_a_preemption(client_for, alice, team_a, submit, small_fleet):
    job = job_transition(job=place(submit(team_a, alice), list(small_fleet[:2])), to="running")
    request = preemption_request_create(job=job, reason="r", lost_work_seconds=1.0)
    response = client_for(alice).post(reverse("pages:approval-decide", args=[request.pk]), {"decision": "approve"})
    assert response.status_code == 403
    request.refresh_from_db()
    assert request.state == PreemptionRequest.State.PENDING


def test_the_fleet_page_drills_down_from_clusters_to_nodes_to_devices(client_for, alice, team_a, submit, small_fleet):
    devices = list(small_fleet[:2])
    place(submit(team_a, alice, world_size=2, min_devices=1), devices)
    client = client_for(alice)
    fleet = client.get(reverse("pages:fleet") + "?format=json").json()
    assert fleet["totals"]["accelerators"] == 48 and fleet["totals"]["allocated"] == 2
    heatmap = fleet["heatmap"]
    assert heatmap["level"] == "fleet" and heatmap["y"] == ["t-r00", "t-r01"] and len(heatmap["x"]) == 2
    cluster_id = Node.objects.get(pk=devices[0].node_id).cluster_id
    assert cluster_id in heatmap["ids"][0]
    row, col = next((r, c) for r, ids in enumerate(heatmap["ids"]) for c, i in enumerate(ids) if i == cluster_id)
    assert heatmap["allocated"][row][col] == round(2 / 12, 4)

    cluster = client.get(reverse("pages:fleet") + f"?cluster={cluster_id}&format=json").json()["heatmap"]
    assert cluster["level"] == "cluster" and cluster["drill"] == "node"
    cells = {i: a for ids, allocs in zip(cluster["ids"], cluster["allocated"]) for i, a in zip(ids, allocs) if i}
    assert cells[devices[0].node_id] == 0.5 and sorted(cells.values()).count(0.0) == 2

    node = client.get(reverse("pages:fleet") + f"?node={devices[0].node_id}&format=json").json()["heatmap"]
    assert node["level"] == "node" and node["allocated"][0][:4] == [1.0, 1.0, 0.0, 0.0]
    assert "resnet-tiny" in node["text"][0][0]


def test_the_fleet_page_hides_other_teams_job_names(client_for, charlie, alice, team_a, submit, small_fleet):
    devices = list(small_fleet[:1])
    place(submit(team_a, alice, name="secret-project", world_size=1, min_devices=1), devices)
    node = client_for(charlie).get(reverse("pages:fleet") + f"?node={devices[0].node_id}&format=json").json()
    assert "secret-project" not in json.dumps(node) and "another team's job" in node["heatmap"]["text"][0][0]


def test_the_fleet_page_lists_draining_and_lost_nodes(client_for, alice, small_fleet):
    Node.objects.filter(hostname="t-r00-c00-n0000").update(state="lost")
    Node.objects.filter(hostname="t-r01-c01-n0002").update(state="draining")
    data = client_for(alice).get(reverse("pages:fleet") + "?format=json").json()
    assert data["attention_total"] == 2
    assert [n["hostname"] for n in data["attention"]] == ["t-r00-c00-n0000", "t-r01-c01-n0002"]
    assert data["totals"]["free"] == 48 - 8


def test_the_fleet_page_costs_the_same_queries_whatever_the_fleet_size(client_for, alice, small_fleet):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client = client_for(alice)
    cluster = Cluster.objects.first()

    def queries(url):
        with CaptureQueriesContext(connection) as context:
            assert client.get(url).status_code == 200
        return len(context)

    before = [queries(reverse("pages:fleet")), queries(reverse("pages:fleet") + f"?cluster={cluster.pk}")]
    fleet_generate(regions=2, clusters=3, nodes=5, devices=8, accelerator_type="H100-80GB", prefix="more")
    after = [queries(reverse("pages:fleet")), queries(reverse("pages:fleet") + f"?cluster={cluster.pk}")]
    assert before == after and max(after) <= 16


def test_an_unknown_cluster_is_a_404(client_for, alice, small_fleet):
    assert client_for(alice).get(reverse("pages:fleet") + "?cluster=999999").status_code == 404
    # a malformed id is bad input, not a missing object: 400 with what to send
    response = client_for(alice).get(reverse("pages:fleet") + "?node=abc")
    assert response.status_code == 400 and "node must be a whole number" in response.content.decode()


def test_teams_show_quota_and_usage_by_type(client_for, alice, charlie, team_a, submit):
    submit(team_a, alice, min_devices=2)
    page = client_for(alice).get(reverse("pages:teams")).content.decode()
    assert 'data-team="team-a"' in page and 'data-team="team-b"' not in page
    row = page[page.index("<td>CPU</td>"):][:200]
    assert "<td>64</td><td>2</td><td>0</td><td>1</td>" in row


def test_static_files_are_served(client_for, alice):
    response = client_for(alice).get("/static/pages/live.js")
    assert response.status_code == 200
    assert b"MeridianLive" in b"".join(response.streaming_content)


def test_the_fleet_summary_counts_allocated_free_unhealthy_and_draining(alice, team_a, submit, small_fleet):
    fleet_generate(regions=1, clusters=1, nodes=2, devices=2, accelerator_type="H100-80GB", prefix="h")
    devices = list(small_fleet[:3])
    place(submit(team_a, alice, world_size=4, min_devices=1), devices)  # 4 ranks on 3 devices: one shared
    Accelerator.objects.filter(pk=devices[1].pk).update(healthy=False)
    Node.objects.filter(pk=devices[0].node_id).update(state="draining")
    Accelerator.objects.filter(type="CPU").update(utilization=0.25)
    Accelerator.objects.filter(pk=devices[2].pk).update(utilization=None)
    summary = fleet_summary()
    cpu = next(row for row in summary["by_type"] if row["type"] == "CPU")
    cpu_total = Accelerator.objects.filter(type="CPU").count()
    cpu_free = Accelerator.objects.filter(type="CPU", healthy=True, node__state="ready", replicas__isnull=True).count()
    assert (cpu["accelerators"], cpu["allocated"], cpu["healthy"], cpu["free"]) == (
        cpu_total, 3, cpu_total - 1, cpu_free
    )
    assert {row["type"]: row["mean_utilization"] for row in summary["by_type"]} == {"CPU": 0.25, "H100-80GB": None}
    assert summary["totals"]["accelerators"] == cpu_total + 4
    assert summary["totals"]["allocated"] == 3
    assert summary["totals"]["nodes_by_state"]["draining"] == 1
    assert sum(c["accelerators"] for c in summary["clusters"]) == cpu_total + 4


def test_progress_reports_stay_out_of_the_timeline_and_the_events_table(client_for, alice, team_a, submit):
    job = submit(team_a, alice)
    JobEvent.objects.bulk_create(
        [JobEvent(job=job, type=JobEvent.Type.PROGRESS, extra_data={"step": i}) for i in range(300)]
    )
    data = client_for(alice).get(reverse("pages:job-detail", args=[job.pk]) + "?format=json").json()
    assert 'data-event-type="progress"' not in data["events_html"]
    assert data["events_html"].count("<tr") == 1  # submitted


def test_the_job_list_says_why_a_waiting_job_waits(client_for, alice, team_a, submit):
    job = submit(team_a, alice)
    Job.objects.filter(pk=job.pk).update(queue_position=3, wait_reason="needs 2 CPU devices; 1 free")
    content = client_for(alice).get(reverse("pages:job-list")).content.decode()
    assert "#3 in line: needs 2 CPU devices; 1 free" in content
