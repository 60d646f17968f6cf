"""Hollow agents (the scale-test nodes) against the real agent API on a live server: they
register, run jobs by their model, get preempted and finish, through the same tick."""
import argparse
import threading

import pytest

from agent.hollow import HollowFleet
from jobs.heartbeat_fold import heartbeats_fold_all
from jobs.models import Job, Move
from jobs.moves import move_advance
from jobs.services import job_submit
from jobs.tick import tick_run

ENROLL = "hollow-enroll"


@pytest.fixture(autouse=True)
def enrollment(settings):
    settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN = ENROLL
    settings.MERIDIAN_MIN_RUN_SECONDS = 0.0
    settings.MERIDIAN_JOB_MAX_SPREAD = "region"


def run_move_tasks():
    """Plays the Celery worker: the move tasks the heartbeats enqueued."""
    for move_id in Move.objects.filter(state=Move.State.ACTIVE).values_list("id", flat=True):
        move_advance(move_id=move_id)


def beat_all(fleet):
    """Every hollow node beats once; then the folder records what was queued (with
    MERIDIAN_HEARTBEAT_FOLD=async the beat task does it every second), so the next beat hears the
    outcome, as it does when the report is recorded in its request (sync)."""
    fleet.beat_all()
    heartbeats_fold_all()


def hollow_fleet(url, nodes):
    options = argparse.Namespace(control_plane=url, enroll_token=ENROLL, hollow=nodes, hollow_type="CPU",
                                 hollow_devices=2, hollow_prefix="h", hollow_threads=1, interval=1.0,
                                 checkpoint_every=0.0)
    return HollowFleet(options, threading.Event())


@pytest.mark.django_db(transaction=True)
def test_hollow_nodes_run_jobs_to_completion_and_yield_to_a_premium_job(live_server, alice, team_a, job_spec):
    fleet = hollow_fleet(live_server.url, nodes=2)
    fleet.register_all()
    for node in fleet.nodes:
        node.rate = 1000.0  # steps per device-second: the model, not wall time, drives these jobs
    basics = [job_submit(team=team_a, submitted_by=alice,
                         spec=job_spec(name=f"b{i}", tier="basic", world_size=2, min_devices=2,
                                       args=["--steps", "1000000"])) for i in range(2)]
    tick_run()
    beat_all(fleet)  # start
    beat_all(fleet)  # report running
    assert {j.state for j in Job.objects.filter(pk__in=[b.pk for b in basics])} == {Job.State.RUNNING}

    premium = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="p", tier="premium", world_size=2,
                                                                        min_devices=2, args=["--steps", "10"]))
    tick_run()
    beat_all(fleet)  # the victim's node stops it with a checkpoint; the premium starts
    beat_all(fleet)  # ... and reports both
    run_move_tasks()
    states = sorted(Job.objects.filter(pk__in=[b.pk for b in basics]).values_list("state", flat=True))
    assert states == [Job.State.PREEMPTED, Job.State.RUNNING]
    victim = Job.objects.get(pk__in=[b.pk for b in basics], state=Job.State.PREEMPTED)
    assert victim.last_checkpoint_step > 0
    beat_all(fleet)  # the premium reaches its 10 steps and finishes
    beat_all(fleet)  # ... and reports it
    premium.refresh_from_db()
    assert premium.state == Job.State.SUCCEEDED
    assert fleet.stats["failures"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_hollow_gpu_job_is_resized_by_a_relaunch(live_server, alice, team_a, job_spec, settings):
    # A GPU job's resize is a new generation (jobs/plan_apply.py): the old copy stops at a cut with a
    # checkpoint and the new one starts from it. Hollow nodes resized it in place before and the move
    # waited for a stop that never came.
    settings.MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS = 0.0
    options = argparse.Namespace(control_plane=live_server.url, enroll_token=ENROLL, hollow=1,
                                 hollow_type="H100-80GB", hollow_devices=4, hollow_prefix="g", hollow_threads=1,
                                 interval=1.0, checkpoint_every=0.0)
    fleet = HollowFleet(options, threading.Event())
    fleet.register_all()
    fleet.nodes[0].rate = 1000.0
    elastic = job_submit(team=team_a, submitted_by=alice, spec=job_spec(
        name="elastic", tier="basic", world_size=4, min_devices=2, accelerator_type="H100-80GB",
        args=["--steps", "100000000"]))
    tick_run()
    beat_all(fleet)  # start
    beat_all(fleet)  # report running
    elastic.refresh_from_db()
    assert elastic.state == Job.State.RUNNING and elastic.generation == 1
    job_submit(team=team_a, submitted_by=alice, spec=job_spec(
        name="p", tier="premium", world_size=2, min_devices=2, accelerator_type="H100-80GB",
        args=["--steps", "100000000"]))
    tick_run()
    elastic.refresh_from_db()
    assert elastic.state == Job.State.RESIZING and elastic.generation == 2
    for _ in range(4):  # stop with a checkpoint, heard; the new copy starts from it; heard running
        beat_all(fleet)
        run_move_tasks()
    elastic.refresh_from_db()
    move = Move.objects.get(job=elastic)
    assert move.state == Move.State.DONE, move.log
    assert elastic.state == Job.State.RUNNING and elastic.device_count == 2
    assert elastic.progress_step >= move.cut_step > 0
    assert fleet.stats["failures"] == 0
