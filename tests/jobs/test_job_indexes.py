"""The indexes a placement tick writes (migration jobs/0013): Job has no team index of its own
(job_team_state leads with the team), JobEvent's actor is indexed where set only; both foreign keys
and what they do on delete stay."""
import pytest
from django.db import connection

from jobs.models import Job, JobEvent
from jobs.services import job_event_add, job_submit

pytestmark = pytest.mark.django_db


def _constraints(model):
    with connection.cursor() as cursor:
        return connection.introspection.get_constraints(cursor, model._meta.db_table)


def _index_sql(name):
    if connection.vendor == "postgresql":
        query = "SELECT indexdef FROM pg_indexes WHERE indexname = %s"
    else:
        query = "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = %s"
    with connection.cursor() as cursor:
        cursor.execute(query, [name])
        return cursor.fetchone()[0]


def test_a_jobs_team_is_looked_up_through_job_team_state_only():
    constraints = _constraints(Job)
    assert not [c for c in constraints.values() if c["columns"] == ["team_id"] and c["index"]]
    assert constraints["job_team_state"]["columns"] == ["team_id", "state"]
    assert any(c["foreign_key"] for c in constraints.values() if c["columns"] == ["team_id"])


def test_an_events_actor_is_indexed_where_set_only():
    constraints = _constraints(JobEvent)
    assert constraints["jobevent_actor"]["columns"] == ["actor_id"]
    assert "IS NOT NULL" in _index_sql("jobevent_actor").upper()
    assert len([c for c in constraints.values() if c["columns"] == ["actor_id"] and c["index"]]) == 1


def test_deleting_a_user_keeps_their_events_without_an_actor(team_a, alice, bob, job_spec):
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec())
    by_bob = job_event_add(job=job, type=JobEvent.Type.MESSAGE, reason="from bob", actor=bob)
    by_alice = job_event_add(job=job, type=JobEvent.Type.MESSAGE, reason="from alice", actor=alice)

    bob.delete()

    assert JobEvent.objects.get(pk=by_bob.pk).actor_id is None
    assert JobEvent.objects.get(pk=by_alice.pk).actor_id == alice.pk
