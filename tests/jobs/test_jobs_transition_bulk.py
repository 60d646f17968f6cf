"""The bulk twin of job_transition (jobs_transition_bulk): the same table, the same writes, the same
events, in a constant number of statements; an illegal or stale move changes nothing."""
import itertools

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs.models import Job, JobEvent
from jobs.services import (
    TRANSITIONS,
    IllegalTransition,
    StaleJobState,
    job_submit,
    job_transition,
    jobs_transition_bulk,
)

S = Job.State
LEGAL = sorted((a, b) for a, targets in TRANSITIONS.items() for b in targets)
ILLEGAL = sorted((a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a])
COLUMNS = ("state", "state_changed_at", "updated_at", "started_at", "last_started_at", "finished_at", "device_count",
           "region_id", "queue_position", "wait_reason", "preemption_count", "migration_count", "resize_count")


@pytest.fixture
def jobs_in(team_a, alice, job_spec):
    def make(state, count=1):
        made = []
        for _ in range(count):
            job = job_submit(team=team_a, submitted_by=alice, spec=job_spec())
            # Test setup, not the behaviour under test: put the row straight into `state`, queued.
            Job.objects.filter(pk=job.pk).update(state=state, queue_position=3, wait_reason="waits")
            job.refresh_from_db()
            made.append(job)
        return made

    return make


def _row(job):
    return Job.objects.filter(pk=job.pk).values(*COLUMNS).get()


@pytest.mark.parametrize(("from_state", "to_state"), LEGAL, ids=[f"{a}->{b}" for a, b in LEGAL])
def test_it_writes_what_job_transition_writes(jobs_in, alice, from_state, to_state):
    single, *bulk = jobs_in(from_state, count=3)
    now = timezone.now()

    job_transition(job=single, to=to_state, reason="one", by=alice, extra={"code": "c"}, now=now)
    moved = jobs_transition_bulk(jobs=bulk, to=to_state, reasons={j.pk: "many" for j in bulk},
                                 extras={j.pk: {"code": "c"} for j in bulk}, by=alice, now=now)

    expected = _row(single)
    for job in moved:
        assert _row(job) == expected
        assert {c: getattr(job, c) for c in COLUMNS} == {c: getattr(single, c) for c in COLUMNS}
        event = JobEvent.objects.filter(job=job, type=JobEvent.Type.STATE_CHANGED).get()
        assert (event.from_state, event.to_state, event.reason, event.actor, event.extra_data) == (
            from_state, to_state, "many", alice, {"code": "c"})


@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_it_refuses_an_illegal_move_and_writes_nothing(jobs_in, from_state, to_state):
    legal_from = next(s for s in S if to_state in TRANSITIONS[s])
    legal, = jobs_in(legal_from)
    illegal, = jobs_in(from_state)

    with pytest.raises(IllegalTransition, match=f"cannot go from {from_state} to {to_state}"):
        jobs_transition_bulk(jobs=[legal, illegal], to=to_state)

    assert Job.objects.get(pk=legal.pk).state == legal_from
    assert Job.objects.get(pk=illegal.pk).state == from_state
    assert not JobEvent.objects.filter(job__in=[legal, illegal], type=JobEvent.Type.STATE_CHANGED).exists()


def test_it_refuses_a_stale_move_and_writes_nothing(jobs_in):
    first, second = jobs_in(S.PENDING, count=2)
    job_transition(job=Job.objects.get(pk=second.pk), to=S.CANCELLED)  # another worker got there first

    with pytest.raises(StaleJobState, match=f"job {second.pk} is no longer pending"):
        with transaction.atomic():  # the caller's transaction: it ends with the error
            jobs_transition_bulk(jobs=[first, second], to=S.SCHEDULED)

    assert Job.objects.get(pk=first.pk).state == S.PENDING
    assert not JobEvent.objects.filter(job=first, type=JobEvent.Type.STATE_CHANGED).exists()


def test_it_writes_the_callers_events_with_its_own(jobs_in):
    job, = jobs_in(S.PREEMPTED)
    placed = JobEvent(job_id=job.pk, type=JobEvent.Type.PLACED, reason="placed", extra_data={"devices": [1]})

    jobs_transition_bulk(jobs=[job], to=S.SCHEDULED, events=[placed])

    types = list(JobEvent.objects.filter(job=job).exclude(type=JobEvent.Type.SUBMITTED)
                 .order_by("id").values_list("type", flat=True))
    assert types == [JobEvent.Type.STATE_CHANGED, JobEvent.Type.PLACED]


def test_it_costs_the_same_statements_for_two_jobs_or_twenty(jobs_in):
    few, many = jobs_in(S.PENDING, count=2), jobs_in(S.PENDING, count=20)

    with CaptureQueriesContext(connection) as for_few:
        jobs_transition_bulk(jobs=few, to=S.SCHEDULED, publish_max=0)
    with CaptureQueriesContext(connection) as for_many:
        jobs_transition_bulk(jobs=many, to=S.SCHEDULED, publish_max=0)

    assert len(for_many.captured_queries) == len(for_few.captured_queries)


def test_it_pushes_each_job_unless_there_are_more_than_publish_max(jobs_in, monkeypatch):
    two, three = jobs_in(S.PENDING, count=2), jobs_in(S.PENDING, count=3)
    pushed = []
    monkeypatch.setattr("jobs.services.events_publish", lambda **message: pushed.append(message))
    two[0].device_count = 4  # what the start path sets before: the push carries the new placement

    jobs_transition_bulk(jobs=two, to=S.SCHEDULED, publish_max=2)
    assert sorted(m["payload"]["job"]["job_id"] for m in pushed) == sorted(j.pk for j in two)
    assert all(m["type"] == "jobs.job_updated" and "fleet" in m["groups"] for m in pushed)
    assert {m["payload"]["job"]["job_id"]: m["payload"]["job"]["device_count"] for m in pushed}[two[0].pk] == 4

    pushed.clear()
    jobs_transition_bulk(jobs=three, to=S.SCHEDULED, publish_max=2)
    assert pushed == []
