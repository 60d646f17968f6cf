"""checkpoints_record: several checkpoints in four statements, with the rules of one at a time:
each job's last checkpoint moves forward only (of equal steps, the last one counts), one event per
checkpoint, the job instances given are refreshed."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs.models import Checkpoint, Job, JobEvent
from jobs.services import CheckpointNew, checkpoint_record, checkpoints_record


@pytest.fixture
def jobs(team_a, alice, submit):
    return [submit(team_a, alice, world_size=1, min_devices=1) for _ in range(2)]


def test_each_job_moves_to_its_highest_step_whatever_the_order(jobs):
    first, second = jobs
    checkpoint_record(job=second, step=50, engine="framework", uri="file:///s/50", size_bytes=5)

    with CaptureQueriesContext(connection) as captured:
        rows = checkpoints_record(checkpoints=[
            CheckpointNew(job=first, step=30, engine="framework", uri="file:///f/30", size_bytes=3),
            CheckpointNew(job=first, step=10, engine="framework", uri="file:///f/10", size_bytes=1),
            CheckpointNew(job=first, step=30, engine="criu", uri="file:///f/30b", size_bytes=4),
            CheckpointNew(job=second, step=40, engine="framework", uri="file:///s/40", size_bytes=9)])

    writes = [q["sql"] for q in captured.captured_queries
              if q["sql"].split()[0].upper() not in ("SAVEPOINT", "RELEASE", "BEGIN", "COMMIT")]
    assert len(writes) == 4, writes
    assert [row.uri for row in rows] == ["file:///f/30", "file:///f/10", "file:///f/30b", "file:///s/40"]
    assert all(row.pk for row in rows)
    # the instances were refreshed, as the database has them
    assert (first.last_checkpoint_step, first.checkpoint_bytes) == (30, 4)  # equal steps: the last one
    assert (second.last_checkpoint_step, second.checkpoint_bytes) == (50, 5)  # never backward
    assert Job.objects.get(pk=first.pk).last_checkpoint_step == 30
    assert Checkpoint.objects.filter(job=first).count() == 3
    assert list(JobEvent.objects.filter(job=first, type=JobEvent.Type.CHECKPOINTED)
                .order_by("id").values_list("extra_data__step", flat=True)) == [30, 10, 30]


def test_nothing_to_record_writes_nothing(jobs):
    with CaptureQueriesContext(connection) as captured:
        assert checkpoints_record(checkpoints=[]) == []
    assert not captured.captured_queries
