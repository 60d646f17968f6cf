"""jobs.bulk: the tick's bulk writes (COPY for events, one-parameter id sets, UPDATE from arrays)
write exactly what the ORM's statements write, on SQLite and on PostgreSQL."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import bulk
from jobs.bulk import EventRow, events_insert, rows_update
from jobs.models import Job, JobEvent, Replica
from jobs.services import jobs_transition_bulk

S = Job.State
EVENT_FIELDS = ("job_id", "type", "from_state", "to_state", "reason", "actor_id", "extra_data", "created_at")
# What COPY's text format must escape: tabs, newlines, backslashes, quotes, "\N" and non-ASCII.
AWKWARD = 'tab\there\nnew line \\ back\\slash "quoted" \\N not null ünïcödé 🚀'


@pytest.fixture
def many_jobs(team_a, alice):
    def make(count, state=S.PENDING, world_size=2):
        jobs = Job.objects.bulk_create([
            Job(name=f"bulk-{i}", team=team_a, submitted_by=alice, tier="basic", accelerator_type="CPU",
                world_size=world_size, min_devices=1, entrypoint="train.py", state=state) for i in range(count)])
        Replica.objects.bulk_create([Replica(job=j, rank=r) for j in jobs for r in range(world_size)])
        return list(Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("pk"))

    return make


def test_any_of_selects_what_in_selects(many_jobs):
    jobs = many_jobs(300)
    some = [j.pk for j in jobs[::3]]
    assert sorted(Job.objects.filter(pk__any_of=some).values_list("pk", flat=True)) == sorted(some)
    assert sorted(Replica.objects.filter(job_id__any_of=some).values_list("pk", flat=True)) == sorted(
        Replica.objects.filter(job_id__in=some).values_list("pk", flat=True))
    assert not Job.objects.filter(pk__any_of=[]).exists()
    # ids that match nothing, and one id many times
    assert Job.objects.filter(pk__any_of=[some[0]] * 5 + [10 ** 12]).count() == 1


def test_any_of_binds_many_ids_as_one_parameter(many_jobs):
    """40,000 ids: more than SQLite takes as separate parameters (32,766); one statement either way."""
    jobs = many_jobs(5)
    ids = [j.pk for j in jobs] + list(range(10 ** 9, 10 ** 9 + 40_000))
    with CaptureQueriesContext(connection) as queries:
        assert Job.objects.filter(pk__any_of=ids).count() == 5
    assert len(queries) == 1


def test_any_of_refuses_what_is_not_a_whole_number(many_jobs):
    many_jobs(1)
    with pytest.raises((ValueError, TypeError)):
        list(Job.objects.filter(pk__any_of=["1) OR (1=1"]))


def test_events_insert_writes_what_bulk_create_writes(many_jobs, alice, monkeypatch):
    """Above COPY_MIN_ROWS on PostgreSQL the rows go through COPY; the same events written in small
    batches (the ORM's bulk_create on every database) must read back identical."""
    jobs = many_jobs(bulk.COPY_MIN_ROWS + 10)
    now = timezone.now()

    def events(tag):
        made = []
        for i, job in enumerate(jobs):
            extra = {"tag": tag, "i": i, "nested": {"s": AWKWARD, "list": [1, 2.5, None, True]}}
            if i % 2:
                made.append(EventRow(job_id=job.pk, type=JobEvent.Type.PLACED, reason=AWKWARD + "x" * 600,
                                     extra_data=extra, from_state="a", to_state="b", actor_id=alice.pk))
            else:
                made.append(JobEvent(job_id=job.pk, type=JobEvent.Type.PLACED, reason=AWKWARD, extra_data=extra,
                                     created_at=now, actor=alice))
        return made

    events_insert(events("many"), now=now)
    for i in range(0, len(jobs), 50):  # below COPY_MIN_ROWS: bulk_create
        events_insert(events("few")[i:i + 50], now=now)

    def rows(tag):
        got = list(JobEvent.objects.filter(extra_data__tag=tag).order_by("job_id").values(*EVENT_FIELDS))
        for row in got:
            row["extra_data"].pop("tag")
        return got

    many, few = rows("many"), rows("few")
    assert len(many) == len(jobs) and many == few
    assert many[1]["reason"] == (AWKWARD + "x" * 600)[:500] and many[0]["reason"] == AWKWARD
    assert many[1]["created_at"] == now and many[1]["extra_data"]["nested"]["s"] == AWKWARD


def test_rows_update_writes_each_row_its_values_and_the_shared_ones(many_jobs):
    jobs = many_jobs(bulk.COPY_MIN_ROWS + 10, world_size=1)
    replicas = list(Replica.objects.filter(job__in=jobs).order_by("pk"))
    when = timezone.now()
    # made-up device ids (the column's type is what matters); every third row gets NULL
    values = [None if i % 3 == 0 else 7_000_000_000 + i for i in range(len(replicas))]
    rows_update(Replica._meta.db_table, set_sql="rank = v.c2, updated_at = %s, device_id = v.c1",
                columns=[values, [i + 100 for i in range(len(replicas))]], ids=[r.pk for r in replicas],
                types=("bigint", "integer"), params=[when])
    got = list(Replica.objects.filter(pk__in=[r.pk for r in replicas]).order_by("pk")
               .values_list("device_id", "rank", "updated_at"))
    # the foreign key is checked at commit (deferred); these made-up device ids must not reach it
    Replica.objects.filter(pk__in=[r.pk for r in replicas]).update(device=None)
    assert got == [(values[i], i + 100, when) for i in range(len(replicas))]


def test_transition_of_many_jobs_writes_one_event_each(many_jobs, alice):
    """jobs_transition_bulk above COPY_MIN_ROWS (the COPY path on PostgreSQL)."""
    jobs = many_jobs(bulk.COPY_MIN_ROWS + 5)
    now = timezone.now()
    jobs_transition_bulk(jobs=jobs, to=S.SCHEDULED, now=now, reasons={j.pk: f"why {j.pk}" for j in jobs},
                         extras={j.pk: {"code": "placed"} for j in jobs}, by=alice,
                         events=[EventRow(job_id=j.pk, type=JobEvent.Type.PLACED, extra_data={"n": j.pk})
                                 for j in jobs])
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {S.SCHEDULED}
    changed = {e.job_id: e for e in JobEvent.objects.filter(job__in=jobs, type=JobEvent.Type.STATE_CHANGED)}
    placed = {e.job_id: e for e in JobEvent.objects.filter(job__in=jobs, type=JobEvent.Type.PLACED)}
    assert set(changed) == set(placed) == {j.pk for j in jobs}
    for job in jobs:
        event = changed[job.pk]
        assert (event.from_state, event.to_state, event.reason, event.actor_id, event.extra_data,
                event.created_at) == (S.PENDING, S.SCHEDULED, f"why {job.pk}", alice.pk, {"code": "placed"}, now)
        assert placed[job.pk].extra_data == {"n": job.pk} and placed[job.pk].created_at == now
