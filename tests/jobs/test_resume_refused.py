"""A job's choice when the framework engine refuses its resume (if_resume_refused), in the control
plane (jobs.workflows): the desired state carries it to the agent, and a copy whose launcher started
the script again from scratch is one event on the job's timeline, whatever the number of reports;
the refused run's checkpoints are retired then, so later resumes use the new run's.

Agents are played by node_report_apply (what their heartbeat API calls)."""
from types import SimpleNamespace

import node_reports
import pytest
from django.conf import settings
from django.utils import timezone
from node_reports import copy_checkpoint_uri, worker
from rest_framework.test import APIClient

from fleet.agent_services import node_register
from fleet.models import Accelerator
from jobs.models import Checkpoint, Job, JobEvent, Move
from jobs.plan_apply import _migrate
from jobs.services import job_submit
from jobs.tick import tick_run
from jobs.workflows import checkpoint_rows_prune, node_desired_state

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


def report(node, job, state, *, step, generation=None, **fields):
    """node_reports.report of `job`'s copy of its current generation (unless told), on one device."""
    return node_reports.report(node, job.pk, state, step=step, devices=1,
                               generation=job.generation if generation is None else generation, **fields)


def migrate(job, to_node):
    """Moves `job` live to `to_node` as the defragmenter would (the job migrates, its generation + 1)."""
    job.refresh_from_db()
    devices = list(Accelerator.objects.filter(node=to_node).values_list("id", flat=True))
    decision = SimpleNamespace(reason="defragment", code="defragment", from_checkpoint=False, restart_step=None,
                               kept=0)
    _migrate(job=job, decision=decision, devices=devices, region=to_node.cluster.region_id,
             nodes=[to_node.hostname], now=timezone.now())
    job.refresh_from_db()


def restore_from(node, job):
    return {e["job_id"]: e for e in node_desired_state(node=node)["jobs"]}[job.pk].get("restore_from")


def _migrated_to_n2_after_a_stop_at_30(alice, team_a, job_spec, *, running_checkpoint_step):
    """Returns (job, n1, n2): a job (if_resume_refused "restart") that ran on n1 with a checkpoint at
    `running_checkpoint_step`, was migrated to n2 and whose old copy stopped at a cut at step 30."""
    n1 = make_node("n1", devices=1)
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1, tier="basic",
                                                                     if_resume_refused="restart"))
    tick_run()
    job.refresh_from_db()
    report(n1, job, "running", step=running_checkpoint_step, checkpoint_step=running_checkpoint_step)
    n2 = make_node("n2", devices=1)
    migrate(job, n2)
    report(n1, job, "stopped", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    worker()
    return job, n1, n2


@pytest.fixture
def restarted_after_a_migration(alice, team_a, job_spec):
    """Returns (job, n1, n2): a job (if_resume_refused "restart") that ran on n1 (generation 1) with
    checkpoints at steps 20 and 30, migrated to n2 (generation 2) whose launcher refused the resume
    of step 30 and started the script again from scratch."""
    job, n1, n2 = _migrated_to_n2_after_a_stop_at_30(alice, team_a, job_spec, running_checkpoint_step=20)
    assert job.generation == 2
    job.refresh_from_db()
    assert job.last_checkpoint_step == 30
    assert restore_from(n2, job) == copy_checkpoint_uri(n1, job.pk, 30, generation=1)  # what n2 resumes from
    report(n2, job, "running", step=3, restarted=RESTARTED)
    worker()
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and Move.objects.get(job=job).state == Move.State.DONE
    return job, n1, n2


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


@pytest.mark.django_db
def test_a_restart_retires_the_refused_runs_checkpoints_once(restarted_after_a_migration):
    job, _n1, n2 = restarted_after_a_migration
    for step in (4, 5):  # the agent says so on every report of the copy
        report(n2, job, "running", step=step, restarted=RESTARTED)

    job.refresh_from_db()
    assert job.last_checkpoint_step is None  # the job page's and lost-work estimates' step
    assert sorted(Checkpoint.objects.filter(job=job, retired_at__isnull=False).values_list("step", flat=True)) == [
        20, 30]
    assert restore_from(n2, job) is None  # preempted now, it would start afresh, not be refused again
    retired = JobEvent.objects.filter(job=job, extra_data__has_key="retired_checkpoints")
    assert [(e.reason, e.extra_data["retired_steps"]) for e in retired] == [
        ("restarted from scratch: 2 checkpoint(s) of the refused run retired (newest step 30); it resumes from "
         "the new run's checkpoints", [20, 30])]


@pytest.mark.django_db
def test_the_next_placement_restores_from_the_new_runs_checkpoint_though_its_step_is_lower(
        restarted_after_a_migration):
    job, n1, n2 = restarted_after_a_migration
    assert report(n2, job, "running", step=12, restarted=RESTARTED, checkpoint_step=10)["accepted"] == [job.pk]

    job.refresh_from_db()
    assert job.last_checkpoint_step == 10
    new_run = copy_checkpoint_uri(n2, job.pk, 10, generation=2)
    assert Checkpoint.objects.get(job=job, retired_at__isnull=True).uri == new_run

    migrate(job, n1)  # the next placement: back on n1, generation 3
    assert job.generation == 3
    assert restore_from(n1, job) == new_run


@pytest.mark.django_db
def test_a_checkpoint_in_the_restart_report_itself_is_the_new_runs_latest(alice, team_a, job_spec):
    job, n1, n2 = _migrated_to_n2_after_a_stop_at_30(alice, team_a, job_spec, running_checkpoint_step=30)

    # The first report the control plane hears of the restarted copy already carries its checkpoint.
    report(n2, job, "running", step=6, restarted=RESTARTED, checkpoint_step=5)

    job.refresh_from_db()
    assert job.last_checkpoint_step == 5
    assert restore_from(n2, job) == copy_checkpoint_uri(n2, job.pk, 5, generation=2)


@pytest.mark.django_db
def test_retention_keeps_the_new_runs_checkpoints_and_drops_the_retired_ones(restarted_after_a_migration):
    job, _n1, n2 = restarted_after_a_migration
    for step in (5, 10, 15):
        report(n2, job, "running", step=step, restarted=RESTARTED, checkpoint_step=step)

    checkpoint_rows_prune(keep=3)

    assert sorted(Checkpoint.objects.filter(job=job).values_list("step", flat=True)) == [5, 10, 15]
    assert restore_from(n2, job) == copy_checkpoint_uri(n2, job.pk, 15, generation=2)
