"""A heartbeat's job reports are applied with a fixed number of statements: the progress of all
its jobs in one UPDATE, its repeated checkpoints looked up in one query, whatever the job count;
and with the same rules as one report at a time (a stopped copy never moves progress back, a
checkpoint is recorded once)."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet.models import Accelerator, Node
from fleet.services import fleet_generate
from jobs.models import Checkpoint, Job, Replica
from jobs.workflows import job_store_uri, node_report_apply

SHA = "a" * 64


@pytest.fixture
def node(db):
    fleet_generate(regions=1, clusters=1, nodes=1, devices=4, accelerator_type="H100-80GB", prefix="rw")
    return Node.objects.get()


def running_jobs(node, team, user, submit, count):
    jobs = []
    for index in range(count):
        job = submit(team, user, accelerator_type="H100-80GB", world_size=1, min_devices=1)
        Replica.objects.filter(job=job).update(device=Accelerator.objects.get(node=node, index=index))
        Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING, progress_step=100)
        jobs.append(job)
    return jobs


def report(job, **fields):
    return {"job_id": job.pk, "state": "running", "generation": 0, **fields}


def statements(node, reports):
    with CaptureQueriesContext(connection) as captured:
        outcome = node_report_apply(node=node, report={"jobs": reports})
    return outcome, [q["sql"] for q in captured.captured_queries]


@pytest.mark.parametrize("count", [1, 4], ids=["one job", "four jobs"])
def test_the_progress_of_every_job_is_one_statement(node, team_a, alice, submit, count):
    jobs = running_jobs(node, team_a, alice, submit, count)

    outcome, sql = statements(node, [report(job, step=200 + i, steps_per_s=2.0) for i, job in enumerate(jobs)])

    assert sorted(outcome["accepted"]) == sorted(job.pk for job in jobs)
    progress_writes = [s for s in sql if "jobs_job" in s and s.lstrip().upper().startswith(("UPDATE", "WITH"))]
    assert len(progress_writes) == 1, progress_writes
    assert {j.pk: (j.progress_step, j.steps_per_second) for j in Job.objects.filter(pk__in=[j.pk for j in jobs])} \
        == {job.pk: (200 + i, 2.0) for i, job in enumerate(jobs)}


def test_a_stopped_copy_never_moves_progress_back_but_a_live_one_does(node, team_a, alice, submit):
    live, stopped = running_jobs(node, team_a, alice, submit, 2)

    node_report_apply(node=node, report={"jobs": [report(live, step=40, steps_per_s=1.0),
                                                  report(stopped, state="stopped", step=40, steps_per_s=0.0)]})

    assert Job.objects.get(pk=live.pk).progress_step == 40  # a restore from an older checkpoint
    assert Job.objects.get(pk=stopped.pk).progress_step == 100
    assert Job.objects.get(pk=stopped.pk).steps_per_second == 0.0


def test_a_checkpoint_is_recorded_once_and_its_repeats_cost_one_lookup(node, team_a, alice, submit):
    jobs = running_jobs(node, team_a, alice, submit, 3)
    reports = [report(job, step=150, checkpoint={
        "step": 150, "uri": f"{job_store_uri(job.pk, generation=0)}/ckpt-000000000150-1", "bytes": 1,
        "engine": "framework", "sha256": SHA}) for job in jobs]

    first = node_report_apply(node=node, report={"jobs": reports + reports[:1]})  # the first job's report twice
    assert not first["rejected"], first
    _, sql = statements(node, reports)  # the next heartbeat repeats them all

    assert Checkpoint.objects.filter(job__in=jobs).count() == 3
    assert len([s for s in sql if "jobs_checkpoint" in s]) == 1
    assert not [s for s in sql if s.lstrip().upper().startswith("INSERT")]
