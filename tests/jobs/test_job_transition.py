"""The job state machine: every legal arrow works and writes an event; every other move
raises IllegalTransition and changes nothing."""
import itertools

import pytest

from jobs.models import Job, JobEvent
from jobs.services import TRANSITIONS, IllegalTransition, StaleJobState, job_submit, job_transition

S = Job.State
LEGAL = sorted((a, b) for a, targets in TRANSITIONS.items() for b in targets)
ILLEGAL = sorted((a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a])


@pytest.fixture
def job_in(team_a, alice, job_spec):
    def make(state):
        job = job_submit(team=team_a, submitted_by=alice, spec=job_spec())
        # Test setup, not the behaviour under test: put the row straight into `state`.
        Job.objects.filter(pk=job.pk).update(state=state)
        job.refresh_from_db()
        return job

    return make


def test_the_table_names_every_state():
    assert set(TRANSITIONS) == set(S)
    assert all(not TRANSITIONS[s] for s in Job.TERMINAL_STATES)


@pytest.mark.parametrize(("from_state", "to_state"), LEGAL, ids=[f"{a}->{b}" for a, b in LEGAL])
def test_it_allows_a_legal_move_and_records_it(job_in, alice, from_state, to_state):
    job = job_in(from_state)

    job_transition(job=job, to=to_state, reason="table test", by=alice)

    job.refresh_from_db()
    assert job.state == to_state
    event = JobEvent.objects.filter(job=job, type=JobEvent.Type.STATE_CHANGED).get()
    assert (event.from_state, event.to_state, event.reason, event.actor) == (from_state, to_state, "table test", alice)


@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_it_refuses_an_illegal_move_and_writes_nothing(job_in, from_state, to_state):
    job = job_in(from_state)

    with pytest.raises(IllegalTransition, match=f"cannot go from {from_state} to {to_state}"):
        job_transition(job=job, to=to_state)

    job.refresh_from_db()
    assert job.state == from_state
    assert not JobEvent.objects.filter(job=job, type=JobEvent.Type.STATE_CHANGED).exists()


def test_it_refuses_a_stale_move_when_someone_else_moved_the_job_first(job_in):
    job = job_in(S.PENDING)
    other_worker_copy = Job.objects.get(pk=job.pk)
    job_transition(job=other_worker_copy, to=S.SCHEDULED)

    with pytest.raises(StaleJobState, match="no longer pending"):
        job_transition(job=job, to=S.CANCELLED)

    assert Job.objects.get(pk=job.pk).state == S.SCHEDULED


def test_entering_running_sets_start_times_once(job_in):
    job = job_in(S.SCHEDULED)
    job_transition(job=job, to=S.RUNNING)
    first_start = job.started_at
    job_transition(job=job, to=S.RESIZING)
    job_transition(job=job, to=S.RUNNING)

    job.refresh_from_db()
    assert job.started_at == first_start
    assert job.last_started_at > first_start
    assert job.resize_count == 1


def test_a_terminal_state_releases_devices_and_sets_finished_at(job_in, db):
    from fleet.models import Accelerator, Cluster, Node, Region

    # submitted before the one-device fleet exists: a fleet of 1 CPU device refuses min_devices 2
    job = job_in(S.RUNNING)
    region = Region.objects.create(name="r1")
    node = Node.objects.create(cluster=Cluster.objects.create(region=region, name="c1"), hostname="n1")
    device = Accelerator.objects.create(node=node, index=0, type="CPU")
    job.replicas.update(device=device)
    Job.objects.filter(pk=job.pk).update(device_count=1, region=region)
    job.refresh_from_db()

    job_transition(job=job, to=S.SUCCEEDED)

    job.refresh_from_db()
    assert job.finished_at is not None
    assert (job.device_count, job.region_id) == (0, None)
    assert not job.replicas.filter(device__isnull=False).exists()
