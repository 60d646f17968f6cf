"""A drain through the API (what `meridian drain` and the node's page call) is acted on by the next
tick: the running job on the node migrates live to another node, nothing new lands there, and an
undrain lets jobs be placed on it again. Agents are played by node_report_apply, as in
tests/jobs/test_multihost_control_loop.py."""
import pytest
from node_reports import hosts_of, make_node

from fleet.models import Node
from jobs.models import Job, Move
from jobs.services import job_submit
from jobs.tick import tick_run
from jobs.workflows import node_report_apply

S = Job.State


@pytest.fixture(autouse=True)
def policy(short_policy, settings):
    settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS = 60.0




@pytest.mark.django_db
def test_a_drain_through_the_api_moves_the_running_job_off_at_the_next_tick(api_client_for, admin_user, alice,
                                                                           team_a, job_spec):
    make_node("n1"), make_node("n2")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="one", world_size=4, min_devices=4,
                                                                   tier="basic"))
    tick_run()
    job.refresh_from_db()
    (here,) = hosts_of(job)
    (there,) = {"n1", "n2"} - {here}
    node = Node.objects.get(hostname=here)
    node_report_apply(node=node, report={"jobs": [{"job_id": job.pk, "state": "running", "step": 5, "devices": 4,
                                                   "generation": job.generation}]})
    job.refresh_from_db()
    assert job.state == S.RUNNING

    admin = api_client_for(admin_user)
    drained = admin.post(f"/api/nodes/{node.pk}/drain/", {"reason": "replace a fan"}, format="json")
    assert drained.status_code == 200, drained.content
    assert (drained.json()["state"], drained.json()["jobs_holding_devices"]) == ("draining", 1)
    tick_run()
    job.refresh_from_db()
    assert job.state == S.MIGRATING and hosts_of(job) == [there]  # live: a cut, a checkpoint, a restore there
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert (move.kind, move.from_node.hostname, move.to_node.hostname) == ("migration", here, there)
    assert admin.get(f"/api/nodes/{node.pk}/").json()["jobs_holding_devices"] == 0

    # Nothing new lands on the draining node, and the other node is full: a second job waits.
    other = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="two", world_size=4, min_devices=4,
                                                                     tier="basic"))
    tick_run()
    other.refresh_from_db()
    assert other.state == S.PENDING and hosts_of(other) == [None]
    assert admin.post(f"/api/nodes/{node.pk}/undrain/").json()["state"] == "ready"
    tick_run()
    other.refresh_from_db()
    assert other.state == S.SCHEDULED and hosts_of(other) == [here]
