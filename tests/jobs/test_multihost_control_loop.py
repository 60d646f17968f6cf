"""The control loop for jobs that span hosts (issue 14 §4): the default spread lets topology
decide, desired state tells each host its share (ranks, devices, leader, rendezvous), the leader
speaks for the job, a preemption steps through every host of the job, and a host that held some
of a job's ranks is fenced once the job's generation moved on.

Agents are played by node_report_apply (what their heartbeat API calls), the Celery worker by
move_advance, as in tests/jobs/test_moves.py."""
import pytest
from django.conf import settings
from django.utils import timezone
from node_reports import FAKE_MANIFEST_SHA256, copy_checkpoint_uri

from fleet.agent_services import node_register
from fleet.models import Node
from jobs.models import Job, Move, Replica
from jobs.moves import move_advance
from jobs.services import job_submit
from jobs.tick import tick_run
from jobs.workflows import NOT_YOURS, job_store_uri, node_desired_state, node_report_apply

S = Job.State


@pytest.fixture(autouse=True)
def policy(short_policy, settings):
    settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS = 60.0


def make_node(hostname, devices=4):
    node, _token = node_register(enrollment=settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN, hostname=hostname,
                                 region="eu", cluster="c1", devices=[{"type": "CPU"}] * devices)
    return node


def report(node, job_id, state, *, generation, step=10, devices=4, cut=None, checkpoint_step=None, error=None):
    entry = {"job_id": job_id, "state": state, "step": step, "devices": devices, "generation": generation}
    if cut is not None:
        entry["cut"] = cut
    if error is not None:
        entry["error"] = error
    if checkpoint_step is not None:
        entry["checkpoint"] = {"step": checkpoint_step, "bytes": 100, "engine": "framework",
                               "uri": copy_checkpoint_uri(node, job_id, checkpoint_step, generation=generation),
                               "sha256": FAKE_MANIFEST_SHA256}
    return node_report_apply(node=node, report={"jobs": [entry]})


def worker():
    """Plays the Celery worker: runs the move_advance tasks the reports enqueued."""
    for move_id in Move.objects.filter(state=Move.State.ACTIVE).values_list("id", flat=True):
        move_advance(move_id=move_id)


def entry_of(node, job_id):
    return next((e for e in node_desired_state(node=node)["jobs"] if e["job_id"] == job_id), None)


def hosts_of(job):
    return sorted(set(Replica.objects.filter(job=job).values_list("device__node__hostname", flat=True)))


@pytest.fixture
def wide(alice, team_a, job_spec):
    """Two 4-device hosts n1, n2 and a W=8 job on 8 devices (bigger than a node), running."""
    n1, n2 = make_node("n1"), make_node("n2")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="wide", world_size=8, min_devices=8,
                                                                    tier="basic"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED, job.wait_reason  # old default spread "node": it never fits
    assert hosts_of(job) == ["n1", "n2"]
    return job, n1, n2


@pytest.mark.django_db
def test_a_job_bigger_than_a_node_spans_hosts_and_each_host_is_told_its_share(wide, alice, team_a, job_spec):
    job, n1, n2 = wide
    first, second = entry_of(n1, job.pk), entry_of(n2, job.pk)
    rendezvous = f"{job_store_uri(job.pk, generation=job.generation)}/rendezvous"
    assert first["action"] == second["action"] == "run"
    assert (first["devices"], second["devices"]) == (4, 4)
    assert first["span"] == {"nodes": 2, "node_rank": 0, "first_rank": 0, "ranks": 4, "job_devices": 8,
                             "leader": "n1", "rendezvous": rendezvous}
    assert second["span"] == {**first["span"], "node_rank": 1, "first_rank": 4}
    # A job that fits one node is packed onto one (topology decides) and its entry has no span.
    make_node("n3")
    small = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="small", world_size=4, min_devices=4))
    tick_run()
    small.refresh_from_db()
    assert hosts_of(small) == ["n3"]
    assert entry_of(Node.objects.get(hostname="n3"), small.pk).get("span") is None


@pytest.mark.django_db
def test_the_leader_speaks_for_a_job_that_spans_hosts(wide):
    job, n1, n2 = wide
    assert report(n2, job.pk, "running", generation=1, step=0)["accepted"] == [job.pk]
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and job.progress_step == 0  # a follower's report moves nothing
    report(n1, job.pk, "running", generation=1, step=12)
    report(n2, job.pk, "running", generation=1, step=0)
    job.refresh_from_db()
    assert job.state == S.RUNNING and job.progress_step == 12  # the follower's own step 0 is not the job's
    report(n2, job.pk, "failed", generation=1, error="the job failed on another host")
    job.refresh_from_db()
    assert job.state == S.RUNNING  # the leader's report decides
    report(n1, job.pk, "finished", generation=1, step=20)
    job.refresh_from_db()
    assert job.state == S.SUCCEEDED


@pytest.mark.django_db
def test_a_leaders_failure_waits_while_another_host_of_the_job_is_silent(wide):
    job, n1, n2 = wide
    report(n1, job.pk, "running", generation=1, step=5)
    Node.objects.filter(pk=n2.pk).update(last_heartbeat=timezone.now() - timezone.timedelta(seconds=25))
    answer = report(n1, job.pk, "failed", generation=1, error="node 1 lost")
    assert answer["deferred"] == [job.pk]
    job.refresh_from_db()
    assert job.state == S.RUNNING  # the lost-node sweep restarts it from its last checkpoint instead


@pytest.mark.django_db
def test_a_preemption_steps_through_every_host_and_fences_a_host_left_behind(wide, alice, team_a, job_spec):
    job, n1, n2 = wide
    report(n1, job.pk, "running", generation=1, step=5)
    premium = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=8, min_devices=8,
                                                                        tier="premium"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.PREEMPTING
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert move.from_node == n1 and move.observed["from_nodes"] == [n2.pk]
    assert entry_of(n1, job.pk)["action"] == "stop"  # the leader cuts every host's ranks
    assert entry_of(n2, job.pk) is None  # not listed: the follower's share ends with the leader's cut

    # The follower's report on its old copy is the move's (accepted), not a stranger's (fenced).
    assert report(n2, job.pk, "running", generation=1, step=0)["accepted"] == [job.pk]
    stopped = dict(generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    report(n1, job.pk, "stopped", **stopped)
    worker()
    move.refresh_from_db()
    assert move.step == Move.Step.RELEASE  # the follower's share still runs: its devices are not free
    job.refresh_from_db()
    assert job.state == S.PREEMPTING
    report(n2, job.pk, "stopped", generation=1, step=30)
    worker()
    job.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.DONE and job.state == S.PREEMPTED and job.last_checkpoint_step == 30
    assert entry_of(n1, premium.pk)["span"]["node_rank"] == 0

    # Resumed on two other hosts as generation 3: a report of generation 1 from n2 is fenced.
    Node.objects.filter(pk__in=[n1.pk, n2.pk]).update(state=Node.State.DRAINING)
    make_node("n3"), make_node("n4")
    Job.objects.filter(pk=premium.pk).update(state=S.CANCELLED)
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and hosts_of(job) == ["n3", "n4"]
    new = entry_of(Node.objects.get(hostname="n3"), job.pk)
    assert new["restore_from"].endswith("ckpt-000000000030-1") and new["span"]["leader"] == "n3"
    late = report(n2, job.pk, "running", generation=1, step=31)
    assert late["rejected"] == [{"job_id": job.pk, "fence": True, "cancel": False,
                                 "error": NOT_YOURS.format(job_id=job.pk)}]


@pytest.mark.django_db
def test_the_job_page_shows_the_placement_per_host(wide, alice):
    from django.test import Client
    from django.urls import reverse

    job, _n1, _n2 = wide
    client = Client()
    client.force_login(alice)
    page = client.get(reverse("pages:job-detail", args=[job.pk]))
    assert page.status_code == 200
    assert page.context["data"]["job"]["placement"] == [
        {"host": "n1", "first_rank": 0, "last_rank": 3, "devices": 4},
        {"host": "n2", "first_rank": 4, "last_rank": 7, "devices": 4}]
    html = page.content.decode()
    assert "n1: ranks 0–3 on 4 devices" in html and "n2: ranks 4–7 on 4 devices" in html
