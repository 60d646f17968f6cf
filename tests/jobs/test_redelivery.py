"""Celery's Redis transport redelivers a task its worker did not acknowledge within the visibility
timeout (celery#5935, #3430), and a crashed worker's tasks run again: every move-chain task must
be safe run twice, out of order, and at the same time. These run the real tasks (jobs.tasks)
against the real database (SQLite here, PostgreSQL in CI's second pass) and check that one
outcome comes out: each step completed once, one event per step, one state change, one fence."""
import random
import threading

import pytest
from celery.exceptions import Retry
from django.conf import settings
from django.db import connection

from jobs import tasks
from jobs.models import Job, JobEvent, Move
from tests.jobs.test_moves import (  # noqa: F401  (fixtures and helpers)
    live_migration,
    moves_policy,
    preempted_victim,
    report,
    running,
    step_events,
)

S = Job.State
STEPS = ("barrier", "checkpoint", "store", "release")


def _deliver(queue, rng, move):
    """Runs the queued task calls in a shuffled order, each possibly twice (a redelivery); a call
    that raises Retry goes back in the queue (the broker would run it again after its countdown).
    Returns how many calls ran."""
    ran = 0
    while queue and ran < 200:
        rng.shuffle(queue)
        call = queue.pop()
        for _delivery in range(rng.choice([1, 2])):
            ran += 1
            try:
                call()
            except Retry:
                queue.append(call)
                break
    return ran


def _state_changes(job, to):
    return JobEvent.objects.filter(job=job, type=JobEvent.Type.STATE_CHANGED, to_state=to).count()


@pytest.mark.django_db
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_preemption_chain_delivered_twice_and_out_of_order_has_one_outcome(running, alice, team_a, job_spec,  # noqa: F811
                                                                            seed):
    victim, n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    generation = Job.objects.get(pk=victim.pk).generation
    # the agent's evidence for every step at once (and repeated: heartbeats repeat)
    for _ in range(2):
        report(n1, victim.pk, "stopped", generation=1, step=42, cut={"action": "stop", "step": 42}, checkpoint_step=42)
    chain = move.chain_id
    queue = [lambda step=step: tasks.move_step(move.pk, step, chain) for step in STEPS]
    queue += [lambda: tasks.move_advance(move.pk)] * 3
    _deliver(queue, random.Random(seed), move)

    move.refresh_from_db()
    victim.refresh_from_db()
    assert move.state == Move.State.DONE and victim.state == S.PREEMPTED
    assert [step for step, _node, _cut in step_events(victim)] == ["started", *STEPS]
    assert _state_changes(victim, S.PREEMPTED) == 1
    assert victim.generation == generation  # ended once, normally: no fence bump from a duplicate
    # late redeliveries after the end change nothing
    events = JobEvent.objects.filter(job=victim).count()
    for step in STEPS:
        tasks.move_step(move.pk, step, chain)
    tasks.move_advance(move.pk)
    assert JobEvent.objects.filter(job=victim).count() == events


@pytest.mark.django_db
@pytest.mark.parametrize("seed", [4, 5])
def test_a_migration_chain_delivered_twice_and_out_of_order_has_one_outcome(running, seed):  # noqa: F811
    job, n1, n2 = live_migration(running)
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    rng = random.Random(seed)
    steps = ("barrier", "checkpoint", "store", "restore", "release")
    queue = [lambda step=step: tasks.move_step(move.pk, step, move.chain_id) for step in steps]
    report(n1, job.pk, "stopped", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    _deliver(queue[:3] + [lambda: tasks.move_advance(move.pk)] * 2, rng, move)
    assert Move.objects.get(pk=move.pk).step == Move.Step.RESTORE
    report(n2, job.pk, "running", generation=2, step=31)
    _deliver(queue + [lambda: tasks.move_advance(move.pk)] * 2, rng, move)

    job.refresh_from_db()
    assert Move.objects.get(pk=move.pk).state == Move.State.DONE
    assert job.state == S.RUNNING and job.generation == 2
    assert [step for step, _node, _cut in step_events(job)] == ["started", *steps]
    assert _state_changes(job, S.RUNNING) == 2  # its first start, and the migration's release: once


@pytest.mark.django_db(transaction=True)
def test_the_same_step_delivered_to_two_workers_at_once_completes_once(running, alice, team_a, job_spec):  # noqa: F811
    if connection.vendor == "sqlite" and "memory" in str(settings.DATABASES["default"].get("TEST", {}).get("NAME")
                                                         or connection.settings_dict["NAME"]):
        pytest.skip("threads need a database file or server (CI's PostgreSQL pass runs this)")
    victim, n1, _premium = preempted_victim(running, alice, team_a, job_spec)
    move = Move.objects.get(job=victim, state=Move.State.ACTIVE)
    report(n1, victim.pk, "stopped", generation=1, step=42, cut={"action": "stop", "step": 42}, checkpoint_step=42)
    barrier = threading.Barrier(4)
    outcomes, errors = [], []

    def worker():
        try:
            barrier.wait(timeout=30)
            outcomes.append(tasks.move_advance(move.pk))
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(repr(error))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    done = sorted(step for outcome in outcomes for step in outcome)
    assert done == sorted(STEPS)  # every step completed by exactly one of the workers
    victim.refresh_from_db()
    assert victim.state == S.PREEMPTED and _state_changes(victim, S.PREEMPTED) == 1
    assert [step for step, _node, _cut in step_events(victim)] == ["started", *STEPS]
