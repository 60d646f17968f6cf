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


def test_a_checkpoints_event_says_where_its_time_went_stage_by_stage(jobs):
    # Issue 17 §3: seconds and rates per stage, as the copy's node reported them; GPU state named.
    job, _ = jobs
    seconds = {"cut": 3.0, "save": 2.0, "dump": 0.0, "commit": 0.5, "total": 3.5}
    checkpoints_record(checkpoints=[
        CheckpointNew(job=job, step=8, engine="framework", uri="file:///f/8", size_bytes=2_000_000_000,
                      seconds=seconds, device_bytes=1_500_000_000),
        CheckpointNew(job=job, step=9, engine="criu", uri="file:///f/9", size_bytes=1_000_000_000,
                      seconds={**seconds, "save": None, "dump": 4.0}, left_out=("/tmp/x.sock: a socket",)),
        CheckpointNew(job=job, step=10, engine="criu", uri="file:///f/10", size_bytes=5),
        CheckpointNew(job=job, step=11, engine="criu", uri="file:///f/11", size_bytes=1_000_000_000,
                      seconds={**seconds, "save": None, "dump": 4.0, "device_out": 1.5, "device_in": 0.25})])
    framework, criu, unsaid, cuda = JobEvent.objects.filter(job=job, type=JobEvent.Type.CHECKPOINTED).order_by("id")
    assert framework.reason == (
        "2.000 GB in 3.50 s: cut 3.00 s; of which the ranks' writes (device -> host -> staging) 2.00 s, "
        "1.50 GB from devices, 0.75 GB/s; staging -> store 0.50 s, 4.00 GB/s")
    assert framework.extra_data["seconds"] == seconds and framework.extra_data["device_bytes"] == 1_500_000_000
    # what a checkpoint left out comes first: a person must hear that
    assert criu.reason.startswith("left out of the checkpoint: /tmp/x.sock: a socket; 1.000 GB in 3.50 s: ")
    assert "dump 4.00 s, 0.25 GB/s; staging -> store 0.50 s, 2.00 GB/s" in criu.reason
    assert "device_bytes" not in criu.extra_data
    assert unsaid.reason == "" and "seconds" not in unsaid.extra_data  # an agent that did not say
    # the CRIU engine on a GPU job: the driver's move of the ranks' CUDA state, out and back
    assert cuda.reason == ("1.000 GB in 3.50 s: cut 3.00 s; dump 4.00 s, 0.25 GB/s; of which the ranks' CUDA "
                           "state device -> host 1.50 s; then host -> device 0.25 s; staging -> store 0.50 s, "
                           "2.00 GB/s")
    assert "device -> host" not in criu.reason


def test_a_nodes_report_brings_its_checkpoints_stages_into_the_event_and_bounds_them(short_policy, alice, team_a,
                                                                                    job_spec):
    from node_reports import FAKE_MANIFEST_SHA256, copy_checkpoint_uri, make_node

    from jobs.services import job_submit
    from jobs.tick import tick_run
    from jobs.workflows import node_report_apply
    from protocol import ProtocolError
    from protocol.node import CheckpointReport

    node = make_node("n1")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1))
    tick_run()
    job.refresh_from_db()
    seconds = {"cut": 1.25, "save": 0.5, "dump": 0.0, "commit": 0.25, "total": 1.5}
    checkpoint = {"step": 8, "bytes": 100, "engine": "framework", "sha256": FAKE_MANIFEST_SHA256,
                  "uri": copy_checkpoint_uri(node, job.pk, 8, generation=job.generation),
                  "seconds": seconds, "device_bytes": 0}
    node_report_apply(node=node, report={"jobs": [{"job_id": job.pk, "state": "running", "step": 8, "devices": 1,
                                                   "generation": job.generation, "checkpoint": checkpoint}]})
    event = JobEvent.objects.get(job=job, type=JobEvent.Type.CHECKPOINTED)
    assert event.extra_data["seconds"] == seconds and event.extra_data["device_bytes"] == 0
    assert event.reason.startswith("0.000 GB in 1.50 s: cut 1.25 s; of which the ranks' writes")
    # a node's figures are bounded like everything it sends
    with pytest.raises(ProtocolError, match="cut"):
        CheckpointReport.from_dict({**checkpoint, "seconds": {**seconds, "cut": -1.0}})
