"""A job's choice when the framework engine refuses its resume (if_resume_refused), in the control
plane (jobs.workflows): the desired state carries it to the agent, and a copy whose launcher started
the script again from scratch is one event on the job's timeline, whatever the number of reports.

Agents are played by node_report_apply (what their heartbeat API calls)."""
import pytest
from django.conf import settings
from rest_framework.test import APIClient

from fleet.agent_services import node_register
from jobs.models import Job, JobEvent
from jobs.services import job_submit
from jobs.tick import tick_run
from jobs.workflows import node_desired_state, node_report_apply

# What runtime.launcher's resume_refused puts in the restarted copy's started event.
RESTARTED = ("restarted from scratch (--if-resume-refused restart): the resume was refused: rank 0's initial "
             "parameters differ from the run that was cut (an unseeded script?)")


@pytest.fixture(autouse=True)
def policy(short_policy):
    """short_policy (tests/jobs/conftest.py)."""


def make_node(hostname, devices=2):
    node, _token = node_register(enrollment=settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN, hostname=hostname,
                                 region="eu", cluster="c1", devices=[{"type": "CPU"}] * devices)
    return node


def report(node, job, state, *, step, restarted=None):
    entry = {"job_id": job.pk, "generation": job.generation, "state": state, "step": step, "devices": 1}
    if restarted is not None:
        entry["restarted"] = restarted
    return node_report_apply(node=node, report={"jobs": [entry]})


@pytest.mark.django_db
def test_the_desired_state_tells_the_agent_which_jobs_start_again_when_their_resume_is_refused(alice, team_a,
                                                                                             job_spec):
    node = make_node("n1")
    restart = job_submit(team=team_a, submitted_by=alice, spec=job_spec(
        name="own-snapshots", world_size=1, min_devices=1, tier="basic", if_resume_refused="restart"))
    fail = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="seeded", world_size=1, min_devices=1,
                                                                     tier="basic"))
    tick_run()

    entries = {entry["job_id"]: entry for entry in node_desired_state(node=node)["jobs"]}

    assert entries[restart.pk]["if_resume_refused"] == "restart"
    assert entries[fail.pk]["if_resume_refused"] == "fail"


@pytest.mark.django_db
def test_a_copy_restarted_from_scratch_is_one_event_its_owner_sees(alice, team_a, job_spec):
    node = make_node("n1")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1, tier="basic",
                                                                     if_resume_refused="restart"))
    tick_run()
    job.refresh_from_db()
    report(node, job, "running", step=40)
    restarts = JobEvent.objects.filter(job=job, type=JobEvent.Type.RESTARTED_FROM_SCRATCH)
    assert not restarts.exists()  # a copy that resumed

    for step in (0, 1, 2):  # the agent says so on every report of the copy
        assert report(node, job, "running", step=step, restarted=RESTARTED)["accepted"] == [job.pk]

    assert [(e.reason, e.extra_data["generation"], e.extra_data["step"]) for e in restarts] == [
        (f"on n1: {RESTARTED}", job.generation, 0)]
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and job.progress_step == 2
    # What `meridian events` and the job page read.
    client = APIClient()
    client.force_authenticate(alice)
    events = client.get(f"/api/jobs/{job.pk}/events/").json()["results"]
    assert [e["reason"] for e in events if e["type"] == "restarted_from_scratch"] == [restarts[0].reason]
