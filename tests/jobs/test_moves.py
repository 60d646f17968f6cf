"""Moves as persisted workflows (jobs/moves.py): each step, idempotence, timeouts with an injected
clock, the lost-chain sweep, one active move per job, stale-generation fencing.

Agents are played by node_report_apply (what their heartbeat API calls), the Celery worker by
the services its tasks call (move_step_run, move_advance) and by calling the task itself."""
import pathlib
from datetime import timedelta
from types import SimpleNamespace

import node_reports
import pytest
from celery.exceptions import Retry
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from node_reports import copy_checkpoint_uri, worker

from fleet.agent_services import node_register
from fleet.models import Accelerator, Node
from jobs import tasks
from jobs.models import Checkpoint, Job, JobEvent, Move, Replica
from jobs.moves import (
    DONE,
    ENDED,
    PASSED,
    RELAUNCH_RESIZE_STEPS,
    SUPERSEDED,
    WAITING,
    move_advance,
    move_create,
    move_step_run,
    move_steps,
    moves_sweep,
)
from jobs.plan_apply import _migrate
from jobs.services import job_generation_bump, job_submit, job_transition
from jobs.tick import tick_run
from jobs.workflows import NOT_YOURS, node_desired_state, node_report_apply

S = Job.State


@pytest.fixture(autouse=True)
def moves_policy(short_policy, settings):
    """short_policy (tests/jobs/conftest.py), and a workflow step times out after 60 s."""
    settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS = 60.0


def make_node(hostname, devices=1):
    enrollment = settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN  # what short_policy set
    node, _token = node_register(enrollment=enrollment, hostname=hostname, region="eu", cluster="c1",
                                 devices=[{"type": "CPU"}] * devices)
    return node


def report(node, job_id, state, *, devices=1, **fields):
    """node_reports.report, for these one-device nodes."""
    return node_reports.report(node, job_id, state, devices=devices, **fields)


def step_events(job):
    return [(e.extra_data["step"], e.extra_data.get("node"), e.extra_data.get("checkpoint_step"))
            for e in JobEvent.objects.filter(job=job, type=JobEvent.Type.MOVE_STEP).order_by("id")]


@pytest.fixture
def running(alice, team_a, job_spec):
    """Returns a function: running(name, tier, node) -> a job started by the tick and reported
    running (generation 1) by its node."""

    def start(name="b", tier="basic", world_size=1, min_devices=1, devices=1):
        job = job_submit(team=team_a, submitted_by=alice,
                         spec=job_spec(name=name, world_size=world_size, min_devices=min_devices, tier=tier))
        tick_run()
        job.refresh_from_db()
        node = Node.objects.get(pk=Replica.objects.filter(job=job, rank=0).values_list("device__node_id", flat=True)[0])
        report(node, job.pk, "running", generation=job.generation, devices=devices)
        job.refresh_from_db()
        assert job.state == S.RUNNING and job.generation == 1
        return job, node

    return start


def live_migration(running):
    """Returns (job, n1, n2): a job running on n1 (generation 1) that the tick's defragmenter has
    decided to move live to n2 (job migrating, generation 2)."""
    n1 = make_node("n1")
    job, _ = running("m")
    n2 = make_node("n2")
    devices = list(Accelerator.objects.filter(node=n2).values_list("id", flat=True))
    decision = SimpleNamespace(reason="defragment", code="defragment", from_checkpoint=False, restart_step=None,
                               kept=0)
    _migrate(job=job, decision=decision, devices=devices, region=n2.cluster.region_id, nodes=["n2"],
             now=timezone.now())
    job.refresh_from_db()
    return job, n1, n2


def preempted_victim(running, alice, team_a, job_spec):
    n1 = make_node("n1")
    victim, node = running("victim")
    premium = job_submit(team=team_a, submitted_by=alice,
                         spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium"))
    tick_run()
    victim.refresh_from_db()
    assert victim.state == S.PREEMPTING and node == n1
    return victim, n1, premium


@pytest.mark.django_db
def test_a_preemption_runs_barrier_checkpoint_store_release_each_with_its_event(running, alice, team_a, job_spec):
    victim, n1, premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    assert move.kind == Move.Kind.PREEMPTION and move.step == Move.Step.BARRIER and move.from_node == n1
    # The old node is told to stop its copy (generation 1); the premium job runs there next.
    entries = {e["job_id"]: e for e in node_desired_state(node=n1)["jobs"]}
    assert entries[victim.pk]["action"] == "stop" and entries[victim.pk]["generation"] == 1
    assert entries[premium.pk]["action"] == "run"

    assert move_step_run(move_id=move.pk, step="barrier") == WAITING  # nothing observed yet
    report(n1, victim.pk, "running", generation=1, step=41, cut={"action": "stop", "step": 42})
    assert move_step_run(move_id=move.pk, step="barrier") == DONE
    assert move_step_run(move_id=move.pk, step="checkpoint") == WAITING  # no checkpoint row at 42 yet
    report(n1, victim.pk, "running", generation=1, step=42, cut={"action": "stop", "step": 42}, checkpoint_step=42)
    assert move_step_run(move_id=move.pk, step="checkpoint") == DONE
    assert move_step_run(move_id=move.pk, step="store") == WAITING  # not visible, not yet stopped
    report(n1, victim.pk, "stopped", generation=1, step=42, cut={"action": "stop", "step": 42}, checkpoint_step=42)
    assert move_advance(move_id=move.pk) == ["store", "release"]

    victim.refresh_from_db()
    move.refresh_from_db()
    assert victim.state == S.PREEMPTED and victim.last_checkpoint_step == 42
    assert move.state == Move.State.DONE and move.step == Move.Step.DONE and move.cut_step == 42
    assert step_events(victim) == [("started", None, None), ("barrier", "n1", 42), ("checkpoint", "n1", 42),
                                   ("store", "n1", 42), ("release", "n1", 42)]
    assert [entry["step"] for entry in move.log] == ["barrier", "barrier", "checkpoint", "store", "release"]


@pytest.mark.django_db
def test_running_a_step_twice_is_a_no_op(running, alice, team_a, job_spec):
    victim, n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    stopped = dict(generation=1, step=42, cut={"action": "stop", "step": 42}, checkpoint_step=42)
    report(n1, victim.pk, "stopped", **stopped)
    assert move_step_run(move_id=move.pk, step="barrier") == DONE
    events = JobEvent.objects.filter(job=victim).count()

    assert move_step_run(move_id=move.pk, step="barrier") == PASSED
    report(n1, victim.pk, "stopped", **stopped)  # a repeated heartbeat
    assert Checkpoint.objects.filter(job=victim).count() == 1
    assert move_advance(move_id=move.pk) == ["checkpoint", "store", "release"]
    assert move_advance(move_id=move.pk) == []
    for step in ("barrier", "checkpoint", "store", "release"):
        assert move_step_run(move_id=move.pk, step=step) == ENDED
    assert JobEvent.objects.filter(job=victim).count() == events + 3 + 1  # 3 more steps and the state change


@pytest.mark.django_db
def test_a_live_migration_waits_for_the_restore_step_before_the_new_node_runs_it(running):
    job, n1, n2 = live_migration(running)
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert job.state == S.MIGRATING and job.generation == 2
    assert (move.from_node, move.to_node, move.from_generation, move.to_generation) == (n1, n2, 1, 2)

    def actions():
        return ({e["job_id"]: (e["action"], e["generation"]) for e in node_desired_state(node=n1)["jobs"]},
                {e["job_id"]: (e["action"], e["generation"]) for e in node_desired_state(node=n2)["jobs"]})

    assert actions() == ({job.pk: ("stop", 1)}, {job.pk: ("wait", 2)})
    report(n1, job.pk, "stopped", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    worker()
    assert Move.objects.get(pk=move.pk).step == Move.Step.RESTORE
    assert actions() == ({job.pk: ("stop", 1)}, {job.pk: ("run", 2)})
    report(n2, job.pk, "running", generation=2, step=29)  # still restoring: below the cut
    worker()
    assert Move.objects.get(pk=move.pk).step == Move.Step.RESTORE
    report(n2, job.pk, "running", generation=2, step=31)
    worker()

    job.refresh_from_db()
    assert job.state == S.RUNNING and job.progress_step == 31
    assert step_events(job) == [("started", None, None), ("barrier", "n1", 30), ("checkpoint", "n1", 30),
                                ("store", "n1", 30), ("restore", "n2", 30), ("release", "n1", 30)]
    assert actions() == ({}, {job.pk: ("run", 2)})


@pytest.mark.django_db
def test_a_migration_whose_new_copy_started_again_from_scratch_is_done_and_says_so(running):
    job, n1, n2 = live_migration(running)
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    report(n1, job.pk, "stopped", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    worker()
    assert Move.objects.get(pk=move.pk).step == Move.Step.RESTORE

    # The framework engine refused the resume and the job chose to start again: its step restarts at
    # 0 and would never pass the cut's before the restore step's deadline.
    report(n2, job.pk, "running", generation=2, step=3, restarted="restarted from scratch: the resume was refused")
    worker()

    job.refresh_from_db()
    assert job.state == S.RUNNING and Move.objects.get(pk=move.pk).state == Move.State.DONE
    restore = JobEvent.objects.get(job=job, type=JobEvent.Type.MOVE_STEP, extra_data__step="restore")
    assert "restarted from scratch at step 3: the resume of checkpoint step 30 was refused" in restore.reason
    released = JobEvent.objects.filter(job=job, type=JobEvent.Type.STATE_CHANGED, to_state=S.RUNNING).last()
    assert released.reason == "restarted from scratch (its resume was refused) on n2"
    assert JobEvent.objects.filter(job=job, type=JobEvent.Type.RESTARTED_FROM_SCRATCH).count() == 1


@pytest.mark.django_db
def test_a_resize_runs_barrier_resize_release(running, alice, team_a, job_spec):
    make_node("n1", devices=2)
    elastic, node = running("e", world_size=2, min_devices=1, devices=2)
    job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium"))
    tick_run()
    elastic.refresh_from_db()
    move = Move.objects.get(job=elastic, state=Move.State.ACTIVE)
    assert elastic.state == S.RESIZING and (move.kind, move.from_devices, move.to_devices) == ("resize", 2, 1)

    report(node, elastic.pk, "running", generation=1, step=20, devices=2)  # not spliced yet
    worker()
    assert Move.objects.get(pk=move.pk).step == Move.Step.BARRIER
    report(node, elastic.pk, "running", generation=1, step=21, devices=1,
           cut={"action": "resize", "step": 21, "devices": 1})
    worker()

    elastic.refresh_from_db()
    assert elastic.state == S.RUNNING and elastic.device_count == 1
    assert [s for s, _n, _c in step_events(elastic)] == ["started", "barrier", "resize", "release"]
    assert Move.objects.get(pk=move.pk).cut_step == 21


@pytest.mark.django_db
def test_a_step_past_its_deadline_ends_the_move_and_the_job_goes_back_in_line(running, alice, team_a, job_spec):
    victim, n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    report(n1, victim.pk, "running", generation=1, cut={"action": "stop", "step": 42})
    assert move_step_run(move_id=move.pk, step="barrier") == DONE
    later = move.step_started_at + timedelta(seconds=59)
    assert move_step_run(move_id=move.pk, step="checkpoint", now=later) == WAITING

    assert move_step_run(move_id=move.pk, step="checkpoint", now=later + timedelta(seconds=120)) == ENDED

    victim.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.TIMED_OUT and move.step == Move.Step.CHECKPOINT
    assert victim.state == S.PREEMPTED
    ended = JobEvent.objects.get(job=victim, type=JobEvent.Type.MOVE_ENDED)
    assert ended.extra_data["step"] == "checkpoint" and "timed_out at checkpoint" in ended.reason
    assert move_step_run(move_id=move.pk, step="checkpoint") == ENDED  # the chain's later tasks exit
    # Whatever is left of the slow copy is fenced: its late report changes nothing.
    assert victim.generation == 2
    late = report(n1, victim.pk, "stopped", generation=1, step=43, checkpoint_step=43)
    assert late["rejected"][0]["fence"] and not Checkpoint.objects.filter(job=victim, step=43).exists()


@pytest.mark.django_db
def test_the_sweep_requeues_a_lost_chain_and_times_out_a_move_past_its_deadline(running, alice, team_a, job_spec,
                                                                                 django_capture_on_commit_callbacks):
    victim, _n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    chain_before = move.chain_id
    assert moves_sweep(now=move.polled_at + timedelta(seconds=5)) == {"timed_out": 0, "requeued": 0}

    with django_capture_on_commit_callbacks() as callbacks:  # (not executed: no broker needed)
        with transaction.atomic():
            assert moves_sweep(now=move.polled_at + timedelta(seconds=20)) == {"timed_out": 0, "requeued": 1}
    move.refresh_from_db()
    assert len(callbacks) == 1 and move.chain_id != chain_before and move.log[-1]["note"] == "chain lost; re-enqueued"
    # The old chain's tasks, should they wake up, exit; the new chain's go on.
    assert move_step_run(move_id=move.pk, step="barrier", chain_id=chain_before) == SUPERSEDED
    assert move_step_run(move_id=move.pk, step="barrier", chain_id=move.chain_id) == WAITING

    assert moves_sweep(now=move.step_deadline + timedelta(seconds=1)) == {"timed_out": 1, "requeued": 0}
    victim.refresh_from_db()
    assert victim.state == S.PREEMPTED and Move.objects.get(pk=move.pk).state == Move.State.TIMED_OUT


@pytest.mark.django_db
def test_the_step_task_retries_until_its_step_is_observed(running, alice, team_a, job_spec):
    victim, n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)

    with pytest.raises(Retry):
        tasks.move_step(move.pk, "barrier", move.chain_id)
    report(n1, victim.pk, "running", generation=1, cut={"action": "stop", "step": 42})
    assert tasks.move_step(move.pk, "barrier", move.chain_id) == DONE
    assert tasks.move_step(move.pk, "barrier", move.chain_id) == PASSED
    assert tasks.move_step(move.pk, "barrier", "another-chain") == SUPERSEDED


@pytest.mark.django_db
def test_a_job_has_at_most_one_active_move(running):
    make_node("n1")
    job, node = running("j")
    now = timezone.now()
    first = move_create(job=job, kind="resize", reason="r1", now=now, from_node_id=node.pk, to_node_id=node.pk)
    with pytest.raises(IntegrityError), transaction.atomic():
        Move.objects.create(job=job, kind="resize", step="barrier", step_deadline=now)

    second = move_create(job=job, kind="resize", reason="r2", now=now, from_node_id=node.pk, to_node_id=node.pk)

    first.refresh_from_db()
    assert first.state == Move.State.FAILED and first.log[-1]["note"] == "superseded by a new move"
    assert list(Move.objects.filter(job=job, state=Move.State.ACTIVE)) == [second]


@pytest.mark.django_db
def test_a_node_lost_before_the_cut_ends_the_move_and_the_job_resumes_from_its_checkpoint(running, alice, team_a,
                                                                                          job_spec):
    victim, n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    Node.objects.filter(pk=n1.pk).update(state=Node.State.LOST)

    assert move_step_run(move_id=move.pk, step="barrier") == ENDED

    victim.refresh_from_db()
    assert victim.state == S.PREEMPTED and Move.objects.get(pk=move.pk).state == Move.State.FAILED


@pytest.mark.django_db
def test_a_follower_host_lost_before_the_cut_ends_the_move_at_once(running):
    # A job spanning n1 (leader) and n2 is preempted; n2 dies before the cut. The cut spans both
    # hosts and can never be taken; the barrier used to look at the leader's node only, so the move
    # waited for the leader's own report (its lost-host limit, or a cut's deadline: minutes).
    n1 = make_node("n1")
    job, _ = running("spanning")
    n2 = make_node("n2")
    job = job_transition(job=job, to=S.PREEMPTING, reason="for a premium job")
    move = move_create(job=job, kind=Move.Kind.PREEMPTION, reason="for a premium job", now=timezone.now(),
                       from_node_id=n1.pk, from_nodes=(n1.pk, n2.pk))
    assert move_step_run(move_id=move.pk, step="barrier") == WAITING
    Node.objects.filter(pk=n2.pk).update(state=Node.State.LOST)

    assert move_step_run(move_id=move.pk, step="barrier") == ENDED

    job.refresh_from_db()
    move.refresh_from_db()
    assert job.state == S.PREEMPTED and move.state == Move.State.FAILED
    assert move.log[-1]["note"] == "its host n2 was lost before the cut", move.log


@pytest.mark.django_db
def test_a_copy_that_finishes_before_the_cut_ends_the_move_and_the_job(running, alice, team_a, job_spec):
    victim, n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    report(n1, victim.pk, "finished", generation=1, step=100)
    move_advance(move_id=Move.objects.get(job=victim).pk)
    victim.refresh_from_db()
    assert victim.state == S.SUCCEEDED and Move.objects.get(job=victim).state == Move.State.DONE


@pytest.mark.django_db
def test_reports_and_checkpoints_of_a_stale_generation_are_rejected_and_change_nothing(running):
    n1 = make_node("n1")
    job, _ = running("j")
    report(n1, job.pk, "running", generation=1, step=7, checkpoint_step=7)
    t0 = timezone.now()
    n2 = make_node("n2")
    node_report_apply(node=n2, report={"jobs": []}, now=t0 + timedelta(seconds=60))
    tick_run(now=t0 + timedelta(seconds=61))  # n1 is lost; the job restarts on n2 as generation 2
    job.refresh_from_db()
    assert job.generation == 2 and job.state == S.MIGRATING
    report(n2, job.pk, "running", generation=2, step=8)
    worker()
    job.refresh_from_db()
    assert job.state == S.RUNNING

    # n1 comes back: its stale copy reports progress and a newer checkpoint.
    result = report(n1, job.pk, "running", generation=1, step=50, checkpoint_step=50,
                    now=t0 + timedelta(seconds=62))

    job.refresh_from_db()
    assert result["accepted"] == [] and result["rejected"][0]["fence"] is True
    # n1 holds no copy of the job any more: it is told nothing about it (not even its generation)
    assert result["rejected"][0]["error"] == NOT_YOURS.format(job_id=job.pk)
    assert job.progress_step == 8 and job.last_checkpoint_step == 7
    assert not Checkpoint.objects.filter(job=job, step=50).exists()
    # ... and is not told to run it
    assert node_desired_state(node=n1)["jobs"] == []
    assert node_desired_state(node=n1)["lost_after_seconds"] == 30.0


@pytest.mark.django_db
def test_a_job_that_finishes_on_its_new_node_mid_migration_is_deferred_until_the_move_is_released(running):
    job, n1, n2 = live_migration(running)
    report(n1, job.pk, "stopped", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    worker()

    first = report(n2, job.pk, "finished", generation=2, step=40)

    assert first["deferred"] == [job.pk] and first["accepted"] == []  # the agent reports it again
    job.refresh_from_db()
    assert job.state == S.MIGRATING
    worker()  # restore (a finished copy restored and ran), release
    job.refresh_from_db()
    assert job.state == S.RUNNING
    again = report(n2, job.pk, "finished", generation=2, step=40)
    job.refresh_from_db()
    assert again["accepted"] == [job.pk] and job.state == S.SUCCEEDED


@pytest.mark.django_db
def test_a_restored_copy_that_finished_is_the_result_when_the_old_copys_exit_is_never_confirmed(
        running, settings, tmp_path):
    """The chaos soak saw a job run its last steps twice: the new copy finished at 40/40, the old
    one never reported its exit, release timed out and the job went back in line from step 30."""
    settings.MERIDIAN_CHECKPOINT_STORE = str(tmp_path / "store")
    job, n1, n2 = live_migration(running)
    # The old copy cut and committed step 30 (its checkpoint is in the store), and is never heard
    # from again.
    committed = pathlib.Path(copy_checkpoint_uri(n1, job.pk, 30, generation=1).removeprefix("file://"))
    committed.mkdir(parents=True)
    (committed / "MANIFEST.json").write_text("{}")
    report(n1, job.pk, "running", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    worker()
    report(n2, job.pk, "finished", generation=2, step=40)
    worker()
    move = Move.objects.get(job=job)
    assert move.state == Move.State.ACTIVE and move.step == Move.Step.RELEASE  # waits for the old copy
    job.refresh_from_db()
    assert job.state == S.MIGRATING

    assert move_step_run(move_id=move.pk, step="release", now=move.step_deadline + timedelta(seconds=1)) == ENDED

    job.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.TIMED_OUT and move.step == Move.Step.RELEASE
    assert job.state == S.SUCCEEDED and job.generation == 2 and job.exit_code == 0
    succeeded = JobEvent.objects.get(job=job, type=JobEvent.Type.STATE_CHANGED, to_state=S.SUCCEEDED)
    assert "finished on n2 at step 40" in succeeded.reason and "never confirmed" in succeeded.reason
    # The old copy, if it ever speaks, is fenced; the new one's repeated report changes nothing.
    assert report(n1, job.pk, "running", generation=1, step=31)["rejected"][0]["fence"]
    assert report(n2, job.pk, "finished", generation=2, step=40)["accepted"] == [job.pk]
    job.refresh_from_db()
    assert job.state == S.SUCCEEDED


@pytest.mark.django_db
def test_a_cancelled_job_ends_its_move(running, alice, team_a, job_spec):
    from jobs.services import job_cancel

    victim, _n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    job_cancel(job=victim, by=alice)

    assert move_step_run(move_id=move.pk, step="barrier") == ENDED
    move.refresh_from_db()
    assert move.state == Move.State.FAILED and move.log[-1]["note"] == "the job is cancelled"


@pytest.mark.django_db
def test_a_move_records_the_typed_report_as_wire_words_and_reads_a_garbled_record_as_unseen(running, alice, team_a,
                                                                                            job_spec):
    victim, n1, premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    report(n1, victim.pk, "running", generation=1, step=41, cut={"action": "stop", "step": 42})
    move.refresh_from_db()
    record = move.observed["g1"]
    assert record["state"] == "running" and type(record["state"]) is str and record["hostname"] == "n1"
    assert record["cut"]["action"] == "stop" and record["cut"]["step"] == 42 and "v" not in record

    Move.objects.filter(pk=move.pk).update(observed={"g1": {"state": "exploded", "cut": {"action": "stop"}}})

    assert move_step_run(move_id=move.pk, step="barrier") == WAITING  # not seen: no crash, no step done
    report(n1, victim.pk, "running", generation=1, step=42, cut={"action": "stop", "step": 42})
    assert move_step_run(move_id=move.pk, step="barrier") == DONE


@pytest.mark.django_db
def test_the_barrier_event_names_the_kind_of_cut_the_node_took(running, alice, team_a, job_spec):
    victim, n1, _ = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    report(n1, victim.pk, "running", generation=1, step=41,
           cut={"action": "stop", "step": 42, "kind": "collective-boundary"})
    assert move_step_run(move_id=move.pk, step="barrier") == DONE
    barrier = JobEvent.objects.filter(job=victim, type=JobEvent.Type.MOVE_STEP,
                                      extra_data__step="barrier").get()
    assert barrier.extra_data["cut_kind"] == "collective-boundary"


@pytest.mark.django_db
def test_growing_onto_another_host_relaunches_so_the_running_copy_stops_before_a_new_one_starts(
        running, settings):
    # Found by the chaos soak (bench/chaos_soak.py): an elastic job grown from its one node onto a
    # device of a second node was applied as an in-place resize. The new node was told to run the
    # job at once (as host 0 of 2) while the old node's copy, which agents never splice across
    # hosts, ran on: two live copies of the job, and the old one's finished run was lost. A resize
    # across hosts is now a cut, a checkpoint and a relaunch as a new generation (jobs/moves.py).
    settings.MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS = 0.0
    n1 = make_node("n1")
    elastic, node = running("e", world_size=2, min_devices=1, devices=1)
    assert node == n1
    n2 = make_node("n2")

    tick_run()  # grows into n2's idle device

    elastic.refresh_from_db()
    move = Move.objects.get(job=elastic, state=Move.State.ACTIVE)
    assert elastic.state == S.RESIZING and move.kind == Move.Kind.RESIZE, (elastic.state, move.kind)
    assert move_steps(move) == RELAUNCH_RESIZE_STEPS
    assert elastic.device_count == 2 and elastic.generation == 2
    assert (move.from_generation, move.to_generation) == (1, 2)
    # Neither node runs the new copy before the old one stopped at a cut and checkpointed; the old
    # node's copy is outdated (generation 1 < 2), so its agent stops it with a checkpoint.
    for host in (n1, n2):
        entries = {e["job_id"]: e for e in node_desired_state(node=host)["jobs"]}
        assert entries[elastic.pk]["action"] == "wait" and entries[elastic.pk]["generation"] == 2, entries


@pytest.mark.django_db
def test_a_final_report_repeated_because_its_answer_was_lost_is_accepted_and_records_nothing(running):
    # Found by the chaos soak: a partition cut the connection after the control plane had recorded
    # the job's end. The agent reported "finished" again; it was fenced as a node holding no copy,
    # so it never removed the finished job's checkpoint store (an orphan store folder).
    n1 = make_node("n1")
    job, _ = running("f")
    first = report(n1, job.pk, "finished", generation=1, step=40)
    job.refresh_from_db()
    assert first["accepted"] == [job.pk] and job.state == S.SUCCEEDED
    events = JobEvent.objects.filter(job=job).count()

    again = report(n1, job.pk, "finished", generation=1, step=40)

    assert again["accepted"] == [job.pk] and again["rejected"] == [], again
    assert JobEvent.objects.filter(job=job).count() == events
    # Only the node it ended on, and only its final generation and outcome, are heard so.
    n2 = make_node("n2")
    assert report(n2, job.pk, "finished", generation=1, step=40)["rejected"][0]["error"] == NOT_YOURS.format(
        job_id=job.pk)
    assert report(n1, job.pk, "finished", generation=2, step=40)["rejected"][0]["fence"] is True
    assert report(n1, job.pk, "failed", generation=1, step=40)["rejected"][0]["fence"] is True


@pytest.mark.django_db
def test_a_follower_hosts_final_report_of_the_old_copy_after_its_move_ended_the_job_is_accepted(running):
    # Found by the chaos soak: a job spanning n1 (leader) and n2 was resized across hosts (a new
    # generation at once); its old copy finished before the cut, the leader's report ended the
    # move and the job, and n2's own "finished" of the old generation, heard after, was fenced as
    # a node holding no copy (its agent marked the finished copy fenced; its log tail was refused
    # too: tests/logs/test_log_api.py). Now it is accepted and records nothing; others are not.
    n1 = make_node("n1")
    job, _ = running("spanning")
    n2, n3 = make_node("n2"), make_node("n3")
    job = job_transition(job=job, to=S.RESIZING, reason="across hosts")
    job_generation_bump(job)
    move = move_create(job=job, kind=Move.Kind.RESIZE, reason="across hosts", now=timezone.now(),
                       from_node_id=n1.pk, from_nodes=(n1.pk, n2.pk), from_generation=1, to_generation=2)
    report(n1, job.pk, "finished", generation=1, step=100)
    move_advance(move_id=move.pk)
    job.refresh_from_db()
    assert job.state == S.SUCCEEDED and Move.objects.get(pk=move.pk).state == Move.State.DONE
    events = JobEvent.objects.filter(job=job).count()

    late = report(n2, job.pk, "finished", generation=1, step=100)

    assert late["accepted"] == [job.pk] and late["rejected"] == [], late
    assert JobEvent.objects.filter(job=job).count() == events
    assert report(n3, job.pk, "finished", generation=1, step=100)["rejected"][0]["error"] == NOT_YOURS.format(
        job_id=job.pk)
    assert report(n2, job.pk, "failed", generation=1, step=100)["rejected"][0]["fence"] is True


@pytest.mark.django_db
def test_a_final_report_that_loses_a_race_with_a_restart_is_deferred_then_fenced_not_accepted(running):
    # Found by the chaos soak: the leader's "finished" was read against the job as running while the
    # tick restarted it elsewhere from its checkpoint (its follower's node lost). The transition was
    # refused, yet the report was accepted: the agent took its outcome as heard and removed the job's
    # checkpoint store, and the new generation's restore was refused.
    from jobs.workflows import _observed_apply
    from protocol.node import JobReport

    n1 = make_node("n1")
    job, _ = running("r")
    stale = Job.objects.get(pk=job.pk)  # what the report read, a moment before the tick's commit
    n2 = make_node("n2")
    devices = list(Accelerator.objects.filter(node=n2).values_list("id", flat=True))
    decision = SimpleNamespace(reason="n1 is lost", code="restarted from checkpoint", from_checkpoint=True,
                               restart_step=0, kept=0)
    _migrate(job=job, decision=decision, devices=devices, region=n2.cluster.region_id, nodes=["n2"],
             now=timezone.now())
    finished = JobReport.from_dict({"job_id": job.pk, "state": "finished", "step": 40, "devices": 1,
                                    "generation": 1})

    assert _observed_apply(job=stale, entry=finished, current=True, node=n1, now=timezone.now()) == "deferred"
    job.refresh_from_db()
    assert job.state == S.MIGRATING and job.generation == 2
    # Heard again at the next beat: a copy its node no longer holds, fenced (the agent keeps the store).
    again = report(n1, job.pk, "finished", generation=1, step=40)
    assert again["accepted"] == [] and again["rejected"][0]["fence"] is True, again
