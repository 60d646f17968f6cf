"""A GPU job is resized by a relaunch, on one host too (issue 17). Its ranks' GPUs were fixed when
they started (CUDA_VISIBLE_DEVICES, LOCAL_RANK, the tensors on them), so the in-place resize a CPU
job gets (the agent re-splices its running ranks onto other cores) would leave them computing on
GPUs the job no longer holds; the launcher refuses it (runtime/launcher.py GPU_RESIZE_REFUSAL).
The control plane makes the resize a new generation instead: the old copy stops at a cut with a
checkpoint, the new one is relaunched from it on the new GPUs. Agents are played by
node_report_apply, the Celery worker by move_advance (tests/node_reports.py)."""
import pytest
from node_reports import entry_of, hosts_of, make_node, report, step_names, worker

from jobs.models import Job, JobEvent, Move
from jobs.moves import RELAUNCH_RESIZE_STEPS, move_steps
from jobs.services import job_submit
from jobs.tick import tick_run

S = Job.State


@pytest.fixture(autouse=True)
def policy(short_policy, settings):
    settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS = 60.0
    settings.MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS = 0.0


def shrunk_for_a_premium_job(alice, team, job_spec, accelerator_type):
    """Returns (node, elastic job, its resize move): an elastic W = 4 job on the one 4-device node,
    running, shrunk to 2 devices for a premium 2-device job."""
    node = make_node("g1", accelerator_type=accelerator_type)
    job = job_submit(team=team, submitted_by=alice, spec=job_spec(
        name="elastic", world_size=4, min_devices=2, tier="basic", accelerator_type=accelerator_type))
    tick_run()
    job.refresh_from_db()
    report(node, job.pk, "running", generation=job.generation, step=5, devices=4)
    job_submit(team=team, submitted_by=alice, spec=job_spec(
        name="urgent", world_size=2, min_devices=2, tier="premium", accelerator_type=accelerator_type))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.RESIZING and job.device_count == 2, job.wait_reason
    return node, job, Move.objects.get(job=job, state=Move.State.ACTIVE)


@pytest.mark.django_db
def test_a_gpu_job_is_shrunk_on_its_host_by_a_cut_a_checkpoint_and_a_relaunch(alice, team_a, job_spec):
    node, job, move = shrunk_for_a_premium_job(alice, team_a, job_spec, "H100-80GB")
    assert hosts_of(job) == ["g1"]
    assert (move.kind, move.from_generation, move.to_generation, move.from_devices, move.to_devices) == (
        "resize", 1, 2, 4, 2)
    assert move_steps(move) == RELAUNCH_RESIZE_STEPS
    resizing = JobEvent.objects.filter(job=job, to_state=S.RESIZING).latest("id")
    assert resizing.extra_data["relaunch"] is True and resizing.extra_data["across_hosts"] is False
    # The host is told to stop the old copy (generation 1) and that the new one (2 devices) waits
    # for the checkpoint: its agent stops the old copy (a newer generation is wanted), no live resize.
    entry = entry_of(node, job.pk)
    assert (entry["action"], entry["generation"], entry["devices"]) == ("wait", 2, 2)
    report(node, job.pk, "stopped", generation=1, step=12, devices=4, cut={"action": "stop", "step": 12},
           checkpoint_step=12)
    worker()
    move.refresh_from_db()
    entry = entry_of(node, job.pk)
    assert (entry["action"], entry["generation"], entry["devices"]) == ("run", 2, 2)
    assert entry["restore_from"].endswith("ckpt-000000000012-1")
    report(node, job.pk, "running", generation=2, step=13, devices=2)
    worker()
    job.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.DONE and job.state == S.RUNNING and job.device_count == 2
    assert step_names(job, move) == ["started", "barrier", "checkpoint", "store", "restore", "release"]
    assert job.last_checkpoint_step == 12
    done = JobEvent.objects.filter(job=job, to_state=S.RUNNING).latest("id")
    assert "by a relaunch: restored from checkpoint step 12" in done.reason
    # the old copy is fenced from now on
    assert report(node, job.pk, "running", generation=1)["rejected"][0]["fence"] is True


@pytest.mark.django_db
def test_a_cpu_job_is_still_resized_in_place(alice, team_a, job_spec):
    node, job, move = shrunk_for_a_premium_job(alice, team_a, job_spec, "CPU")
    assert move.from_generation == move.to_generation == job.generation == 1
    entry = entry_of(node, job.pk)
    assert (entry["action"], entry["generation"], entry["devices"]) == ("run", 1, 2)  # the agent splices


@pytest.mark.django_db
def test_a_gpu_job_resized_before_it_reports_running_is_a_new_generation(alice, team_a, job_spec):
    # Its agent may have launched it on the old GPUs already: that copy is fenced, never resized in place.
    node = make_node("g1", accelerator_type="H100-80GB")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(
        name="elastic", world_size=4, min_devices=2, tier="basic", accelerator_type="H100-80GB"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and job.device_count == 4 and job.generation == 1
    job_submit(team=team_a, submitted_by=alice, spec=job_spec(
        name="urgent", world_size=2, min_devices=2, tier="premium", accelerator_type="H100-80GB"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and job.device_count == 2 and job.generation == 2, job.wait_reason
    entry = entry_of(node, job.pk)
    assert (entry["action"], entry["generation"], entry["devices"]) == ("run", 2, 2)
    assert report(node, job.pk, "running", generation=1, devices=4)["rejected"][0]["fence"] is True
