"""jobs.bulk: the tick's bulk writes (COPY for events, one-parameter id sets, UPDATE from arrays)
write exactly what the ORM's statements write, on SQLite and on PostgreSQL."""
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import bulk
from jobs.bulk import EventRow, RowWrites, events_insert, rows_update
from jobs.models import Job, JobEvent, Replica
from jobs.services import StaleJobState, jobs_transition_bulk

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


def test_rows_update_by_keys_writes_the_row_each_key_names(many_jobs):
    """keys= names rows by (job_id, rank); a key with no row writes nothing and is not counted."""
    jobs = many_jobs(bulk.COPY_MIN_ROWS + 10, world_size=2)
    replicas = list(Replica.objects.filter(job__in=jobs).order_by("pk").values_list("pk", "job_id", "rank"))
    when = timezone.now()
    # every replica but the first, in reverse (the keys' order is not the table's), and one rank
    # no job has
    named = replicas[1:][::-1]
    job_ids = [job_id for _, job_id, _ in named] + [jobs[0].pk]
    ranks = [rank for _, _, rank in named] + [99]
    values = [7_000_000_000 + job_id * 10 + rank for job_id, rank in zip(job_ids, ranks)]
    updated = rows_update(Replica._meta.db_table, set_sql="device_id = v.c1, updated_at = %s", columns=[values],
                          keys={"job_id": job_ids, "rank": ranks}, types=("bigint",), params=[when])
    got = dict(Replica.objects.filter(pk__in=[pk for pk, _, _ in replicas]).values_list("pk", "device_id"))
    # the foreign key is checked at commit (deferred); these made-up device ids must not reach it
    Replica.objects.filter(pk__in=[pk for pk, _, _ in replicas]).update(device=None)
    assert updated == len(named)
    first_pk = replicas[0][0]
    assert got[first_pk] is None
    assert {pk: got[pk] for pk, _, _ in named} == {pk: 7_000_000_000 + job_id * 10 + rank for pk, job_id, rank in named}


def test_rows_update_takes_ids_or_keys_not_both():
    with pytest.raises(TypeError):
        rows_update(Replica._meta.db_table, set_sql="device_id = v.c1", columns=[[1]], ids=[1],
                    keys={"job_id": [1], "rank": [0]}, types=("bigint",))


def test_instances_loaded_are_what_the_orm_loads(many_jobs):
    """instances_loaded makes of values_list rows what .only() makes of the same rows: the loaded
    fields, the others deferred and read on access, a saved row that saves what it is told."""
    jobs = many_jobs(3)
    fields = ("id", "team_id", "world_size", "state")
    by_orm = list(Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("pk").only(*fields))
    loaded = bulk.instances_loaded(Job, fields, Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("pk")
                                   .values_list(*fields))
    assert [type(j) for j in loaded] == [Job] * 3
    for mine, theirs in zip(loaded, by_orm):
        assert {k: v for k, v in vars(mine).items() if k != "_state"} == \
            {k: v for k, v in vars(theirs).items() if k != "_state"}
        assert (mine._state.adding, mine._state.db) == (theirs._state.adding, theirs._state.db) == (False, "default")
        assert mine.get_deferred_fields() == theirs.get_deferred_fields()
        assert mine.name == theirs.name and mine.team == theirs.team  # deferred: loaded on access
    loaded[0].world_size = 6
    loaded[0].save(update_fields=["world_size"])
    assert Job.objects.get(pk=loaded[0].pk).world_size == 6


def test_instances_loaded_names_a_field_the_model_lacks():
    with pytest.raises(ValueError, match="team"):
        bulk.instances_loaded(Job, ("id", "team"), [(1, 1)])


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


JOB_COLUMNS = ("state", "state_changed_at", "updated_at", "queue_position", "wait_reason", "device_count", "region_id",
               "generation", "started_at", "last_started_at")


def _placement(jobs, region_ids):
    return RowWrites(set_sql="device_count = v.c1, region_id = v.c2, generation = generation + 1",
                     columns=[[i % 4 + 1 for i in range(len(jobs))], [region_ids[i % 2] for i in range(len(jobs))]],
                     types=("integer", "bigint"))


def _job_rows(jobs):
    return list(Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("pk").values_list(*JOB_COLUMNS))


@pytest.mark.parametrize("moves", [(S.PENDING, S.SCHEDULED), (S.SCHEDULED, S.RUNNING)], ids=["start", "run"])
def test_row_writes_go_in_with_the_transition_as_a_second_update_would(many_jobs, moves):
    """jobs_transition_bulk(row_writes=...) writes each job row once (one UPDATE per from-state) and
    leaves the rows as the transition followed by rows_update leave them: the move's columns,
    started_at kept where it was set, the row's own values, generation + 1."""
    from fleet.models import Region
    from fleet.services import fleet_generate

    fleet_generate(regions=2, clusters=1, nodes=1, devices=2, accelerator_type="CPU", prefix="rw")
    region_ids = list(Region.objects.order_by("pk").values_list("pk", flat=True))
    from_state, to = moves
    now = timezone.now()
    pairs = []
    for _ in range(2):  # the same jobs twice: two UPDATEs, and the transition taking them along
        jobs = many_jobs(bulk.COPY_MIN_ROWS + 7, state=from_state)
        second = jobs[1::2]
        if from_state == S.PENDING:  # two from-states that write alike: one group, one UPDATE each
            Job.objects.filter(pk__in=[j.pk for j in second]).update(state=S.PREEMPTED)
        else:  # some started before: started_at stays
            Job.objects.filter(pk__in=[j.pk for j in second]).update(started_at=now - timedelta(hours=1))
        pairs.append(list(Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("pk")))
    two_updates, one_update = pairs

    jobs_transition_bulk(jobs=two_updates, to=to, now=now)
    written = _placement(two_updates, region_ids)
    rows_update(Job._meta.db_table, set_sql=written.set_sql, columns=written.columns,
                ids=[j.pk for j in two_updates], types=written.types)
    with CaptureQueriesContext(connection) as queries:
        jobs_transition_bulk(jobs=one_update, to=to, now=now, row_writes=_placement(one_update, region_ids))
    # SQLite's executemany is logged once, as "N times: UPDATE ..."
    job_updates = [q["sql"] for q in queries.captured_queries
                   if re.match(rf'(\d+ times: )?UPDATE "?{Job._meta.db_table}"? ', q["sql"])]
    from_states = 2 if from_state == S.PENDING else 1
    assert len(job_updates) == from_states
    assert _job_rows(one_update) == _job_rows(two_updates)
    got = _job_rows(one_update)
    assert {row[0] for row in got} == {to} and {row[7] for row in got} == {1}
    assert [row[5] for row in got] == [i % 4 + 1 for i in range(len(one_update))]


def test_row_writes_refuse_a_column_the_move_writes(many_jobs):
    jobs = many_jobs(2, state=S.RUNNING)
    clashing = RowWrites(set_sql="device_count = v.c1", columns=[[0, 0]], types=("integer",))
    with pytest.raises(ValueError, match="device_count"):
        jobs_transition_bulk(jobs=jobs, to=S.PREEMPTED, row_writes=clashing)


def test_row_writes_name_a_job_that_left_its_state(many_jobs):
    """The conditional UPDATE with row writes names the loser of a race as the ORM's does."""
    jobs = many_jobs(3)
    Job.objects.filter(pk=jobs[1].pk).update(state=S.CANCELLED)
    with pytest.raises(StaleJobState) as raised:
        jobs_transition_bulk(jobs=jobs, to=S.SCHEDULED,
                             row_writes=RowWrites(set_sql="device_count = v.c1", columns=[[1, 1, 1]],
                                                  types=("integer",)))
    assert raised.value.job_id == jobs[1].pk
