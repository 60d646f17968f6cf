"""Full heartbeats queued and folded in batches (MERIDIAN_HEARTBEAT_FOLD=async, jobs/heartbeat_fold.py):
a queued report is answered "deferred" until the folder recorded it, then with the folder's outcome;
what it leads to is what recording it in the request leads to; the folder loses nothing when it dies
before or after its commit, records a duplicate once, and records nothing a node may not say. The
queue is the tests' real Redis and the folder the real one (drained by calling it)."""
import json

import pytest
import redis

from fleet import leases
from fleet.models import Accelerator, Node, NodeTelemetryBucket
from fleet.services import fleet_generate
from jobs import heartbeat_fold
from jobs.heartbeat_fold import OUTCOME_KEY, STREAM_KEY, heartbeats_fold, heartbeats_fold_all
from jobs.heartbeats import node_heartbeat_answer
from jobs.models import Checkpoint, ControlLoopLease, Job, JobEvent, Replica
from jobs.workflows import NodeBeat, job_store_uri, node_reports_record
from protocol.node import Heartbeat

SHA = "b" * 64


@pytest.fixture
def queue(redis_url, settings):
    """The real Redis of the tests, its heartbeat queue, outcomes and leases empty; async mode."""
    settings.REDIS_URL = redis_url
    settings.MERIDIAN_HEARTBEAT_FOLD = "async"
    leases._down_until = 0.0
    store = leases.lease_store()

    def empty():
        store.delete(STREAM_KEY, leases.LEASE_KEY, leases.DESIRED_SERIAL_KEY, leases.DESIRED_NODES_KEY,
                     *store.keys(OUTCOME_KEY.format(node_id="*")))

    empty()
    yield store
    empty()


@pytest.fixture
def nodes(db):
    fleet_generate(regions=1, clusters=1, nodes=2, devices=2, accelerator_type="H100-80GB", prefix="hf")
    return list(Node.objects.order_by("hostname"))


def running_on(node, team, user, submit, *, index=0):
    """A job running on `node`'s device `index`, generation 0."""
    job = submit(team, user, accelerator_type="H100-80GB", world_size=1, min_devices=1)
    Replica.objects.filter(job=job).update(device=Accelerator.objects.get(node=node, index=index))
    Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING)
    return Job.objects.get(pk=job.pk)


def checkpoint(job, step, *, generation=0):
    return {"uri": f"{job_store_uri(job.pk, generation=generation)}/ckpt-{step:012d}-1", "step": step,
            "bytes": 10, "engine": "framework", "sha256": SHA}


HELD: dict[int, str] = {}  # node id -> the desired version its agent holds (from its last answer)


@pytest.fixture(autouse=True)
def agents_hold_nothing():
    HELD.clear()


def beat(node, *reports, utilization=0.5):
    """Sends one full heartbeat of `node` through the heartbeat service (what both the DRF view and
    the path before Django call), naming the desired version its last answer gave, as an agent
    does; returns its answer as a wire dict. Only a heartbeat whose agent holds the current desired
    state is queued: a node's first one is recorded in its request."""
    wire = {"telemetry": {"utilization": utilization,
                          "devices": [{"index": 0, "utilization": utilization, "memory_used_gb": 9.0}]},
            "jobs": list(reports)}
    if node.pk in HELD:
        wire["desired_version"] = HELD[node.pk]
    node = Node.objects.get(pk=node.pk)
    answer = node_heartbeat_answer(node=node, heartbeat=Heartbeat.from_dict(wire), wire=wire).to_dict()
    HELD[node.pk] = answer["desired_version"]
    return answer


def synced(*nodes):
    """Each node's agent fetches its current desired state (a heartbeat without reports), and
    whatever that queued is recorded: the next heartbeats are queued while nothing changes."""
    answers = [beat(node) for node in nodes]
    heartbeats_fold_all()
    return answers


def buckets():
    return dict(NodeTelemetryBucket.objects.values_list("node_id", "heartbeats"))


def report(job, state="running", **fields):
    return {"job_id": job.pk, "state": state, "generation": 0, **fields}


def test_a_queued_report_is_deferred_until_folded_then_answered_with_what_the_folder_decided(
        queue, nodes, team_a, alice, submit):
    job = running_on(nodes[0], team_a, alice, submit)
    [synced_answer] = synced(nodes[0])
    assert [j["job_id"] for j in synced_answer["desired"]["jobs"]] == [job.pk]

    first = beat(nodes[0], report(job, step=7, steps_per_s=1.5), report(job.__class__(pk=job.pk + 1000)))

    assert first["deferred"] == [job.pk, job.pk + 1000] and first["accepted"] == [] and first["rejected"] == []
    assert Job.objects.get(pk=job.pk).progress_step == 0  # not recorded yet
    assert first["desired"] is None  # the agent holds the current one
    result = heartbeats_fold_all()
    assert (result.entries, result.recorded) == (1, 1)
    assert Job.objects.get(pk=job.pk).progress_step == 7
    assert Node.objects.get(pk=nodes[0].pk).utilization == 0.5

    # the same reports, at another step: their outcomes are known now
    second = beat(nodes[0], report(job, step=9, steps_per_s=1.5), report(job.__class__(pk=job.pk + 1000)))
    assert second["accepted"] == [job.pk] and second["deferred"] == []
    assert [(r["job_id"], r["fence"]) for r in second["rejected"]] == [(job.pk + 1000, True)]
    # a report that says something new (a checkpoint) is deferred again
    third = beat(nodes[0], report(job, step=10, checkpoint=checkpoint(job, 10)))
    assert third["deferred"] == [job.pk]
    heartbeats_fold_all()
    assert Job.objects.get(pk=job.pk).last_checkpoint_step == 10


def test_folding_leads_to_the_state_recording_in_the_request_leads_to(queue, nodes, team_a, alice, submit, settings):
    sync_job = running_on(nodes[0], team_a, alice, submit, index=0)
    async_job = running_on(nodes[1], team_a, alice, submit, index=0)
    steps = [dict(step=5, steps_per_s=1.0), dict(step=20, checkpoint=checkpoint(sync_job, 20)),
             dict(step=30, checkpoint=checkpoint(sync_job, 20)), dict(state="finished", step=40)]

    def seen(job):
        job = Job.objects.get(pk=job.pk)
        return (job.state, job.progress_step, job.last_checkpoint_step, Checkpoint.objects.filter(job=job).count(),
                sorted(JobEvent.objects.filter(job=job).values_list("type", flat=True)))

    synced(nodes[1])
    queued = 0
    for fields in steps:
        settings.MERIDIAN_HEARTBEAT_FOLD = "sync"
        said = dict(fields, checkpoint=fields.get("checkpoint") and checkpoint(sync_job, fields["checkpoint"]["step"]))
        assert beat(nodes[0], report(sync_job, **{k: v for k, v in said.items() if v is not None}))["accepted"] \
            == [sync_job.pk]
        settings.MERIDIAN_HEARTBEAT_FOLD = "async"
        said = dict(fields, checkpoint=fields.get("checkpoint") and checkpoint(async_job, fields["checkpoint"]["step"]))
        answer = beat(nodes[1], report(async_job, **{k: v for k, v in said.items() if v is not None}))
        # queued (deferred, or accepted when it repeats a report already decided), or recorded in its
        # request when the last fold changed the desired state (a checkpoint changes restore_from)
        assert async_job.pk in answer["deferred"] + answer["accepted"]
        queued += heartbeats_fold_all().recorded
        assert seen(async_job) == seen(sync_job), fields
    assert queued >= 2
    assert seen(async_job)[:4] == (Job.State.SUCCEEDED, 40, 20, 1)


def test_a_report_the_node_may_not_make_is_recorded_by_no_one(queue, nodes, team_a, alice, submit):
    job = running_on(nodes[0], team_a, alice, submit)

    # another node reports the job finished, and its own copy a checkpoint outside its store
    beat(nodes[1], report(job, state="finished", step=99))
    beat(nodes[0], report(job, step=3, checkpoint={**checkpoint(job, 3), "uri": "/elsewhere/ckpt-000000000003-1"}))
    heartbeats_fold_all()

    job.refresh_from_db()
    assert (job.state, job.last_checkpoint_step) == (Job.State.RUNNING, None)
    stranger = beat(nodes[1], report(job, state="finished", step=99))
    assert [(r["job_id"], r["fence"]) for r in stranger["rejected"]] == [(job.pk, True)]
    planted = {**checkpoint(job, 3), "uri": "/elsewhere/ckpt-000000000003-1"}
    own = beat(nodes[0], report(job, step=3, checkpoint=planted))
    assert own["rejected"][0]["error"].startswith("checkpoint.uri:")


def test_several_beats_of_one_node_are_coalesced_and_recorded_in_their_order(queue, nodes, team_a, alice, submit):
    job = running_on(nodes[0], team_a, alice, submit)
    other = running_on(nodes[1], team_a, alice, submit)
    synced(*nodes)
    for step in (1, 2, 3):  # progress only: the first two are superseded by the third
        beat(nodes[0], report(job, step=step, steps_per_s=1.0))
    beat(nodes[1], report(other, step=4))
    beat(nodes[0], report(job, state="finished", step=5))  # a new state: recorded after the progress

    result = heartbeats_fold()

    assert (result.entries, result.recorded, result.coalesced, result.rounds) == (5, 3, 2, 2)
    job.refresh_from_db()
    assert (job.state, job.progress_step) == (Job.State.SUCCEEDED, 5)
    assert Job.objects.get(pk=other.pk).progress_step == 4
    said = json.loads(queue.get(OUTCOME_KEY.format(node_id=nodes[0].pk)))
    assert said == {str(job.pk): [heartbeat_fold.report_key(report(job, state="finished", step=5)), "a"]}


def test_a_folder_that_dies_before_its_commit_loses_nothing(queue, nodes, team_a, alice, submit, monkeypatch):
    job = running_on(nodes[0], team_a, alice, submit)
    synced(*nodes)
    before = buckets()
    beat(nodes[0], report(job, step=12, checkpoint=checkpoint(job, 12)))
    beat(nodes[1])
    crash = RuntimeError("the folder died mid-batch")

    def dies(**_):
        raise crash

    with monkeypatch.context() as patched:  # the batch fails after the telemetry was written
        patched.setattr("jobs.workflows.checkpoints_record", dies)
        with pytest.raises(RuntimeError):
            heartbeats_fold()
    assert Job.objects.get(pk=job.pk).last_checkpoint_step is None  # rolled back, all of it
    assert buckets() == before
    assert queue.xlen(STREAM_KEY) == 2

    result = heartbeats_fold_all()  # the next folder reads the pending entries again

    assert (result.entries, result.recorded) == (2, 2)
    assert Job.objects.get(pk=job.pk).last_checkpoint_step == 12
    assert buckets() == {node.pk: before[node.pk] + 1 for node in nodes}
    assert queue.xlen(STREAM_KEY) == 0


def test_a_folder_that_dies_after_its_commit_records_nothing_twice(queue, nodes, team_a, alice, submit, monkeypatch):
    job = running_on(nodes[0], team_a, alice, submit)
    synced(nodes[0])
    before = buckets()
    beat(nodes[0], report(job, step=12, checkpoint=checkpoint(job, 12)))

    def unacknowledged(store, **_):
        raise redis.ConnectionError("the folder died before acknowledging")

    with monkeypatch.context() as patched:
        patched.setattr(heartbeat_fold, "_acknowledge", unacknowledged)
        assert heartbeats_fold().recorded == 1
    assert queue.xlen(STREAM_KEY) == 1  # still pending

    again = heartbeats_fold()

    assert (again.entries, again.recorded, again.skipped) == (1, 0, 1)
    assert queue.xlen(STREAM_KEY) == 0
    assert Checkpoint.objects.filter(job=job).count() == 1
    assert JobEvent.objects.filter(job=job, type=JobEvent.Type.CHECKPOINTED).count() == 1
    assert buckets()[nodes[0].pk] == before[nodes[0].pk] + 1  # counted once


def test_a_duplicated_report_recorded_twice_changes_nothing_twice(queue, nodes, team_a, alice, submit):
    job = running_on(nodes[0], team_a, alice, submit)
    synced(nodes[0])
    said = report(job, step=12, checkpoint=checkpoint(job, 12))
    beat(nodes[0], said)
    heartbeats_fold_all()
    job.refresh_from_db()
    before = (job.last_checkpoint_step, job.last_checkpoint_at, Checkpoint.objects.filter(job=job).count(),
              JobEvent.objects.filter(job=job).count())

    HELD[nodes[0].pk] = synced(nodes[0])[0]["desired_version"]
    beat(nodes[0], said)  # the agent sends it again (its answer was lost), folded in a later batch
    assert heartbeats_fold_all().recorded == 1

    job.refresh_from_db()
    assert (job.last_checkpoint_step, job.last_checkpoint_at, Checkpoint.objects.filter(job=job).count(),
            JobEvent.objects.filter(job=job).count()) == before


def test_with_redis_unreachable_the_heartbeat_is_recorded_in_the_request(nodes, team_a, alice, submit, settings, db):
    settings.MERIDIAN_HEARTBEAT_FOLD = "async"
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    leases._down_until = 0.0
    job = running_on(nodes[0], team_a, alice, submit)
    try:
        beat(nodes[0])  # the agent holds the current desired state
        answer = beat(nodes[0], report(job, step=8))
    finally:
        leases._down_until = 0.0

    assert answer["accepted"] == [job.pk] and answer["deferred"] == []
    assert Job.objects.get(pk=job.pk).progress_step == 8


def test_a_full_backlog_is_recorded_in_the_request(queue, nodes, team_a, alice, submit, settings):
    settings.MERIDIAN_HEARTBEAT_FOLD_BACKLOG = 1
    job = running_on(nodes[0], team_a, alice, submit)
    synced(nodes[0])
    assert beat(nodes[0], report(job, step=1))["deferred"] == [job.pk]

    answer = beat(nodes[0], report(job, step=2))  # the folder is behind: one entry waits

    assert answer["accepted"] == [job.pk]
    assert Job.objects.get(pk=job.pk).progress_step == 2
    assert queue.xlen(STREAM_KEY) == 1


def test_a_heartbeat_queued_is_a_lease_of_the_node_and_answers_its_serial(queue, nodes):
    synced(*nodes)
    queue.delete(leases.LEASE_KEY)
    leases.desired_serials_bump(node_ids=[nodes[0].pk, nodes[0].pk + 1000])
    leases.desired_serials_bump(node_ids=[nodes[0].pk])

    assert beat(nodes[0])["desired_serial"] == 2 == leases.desired_serial_of(node_id=nodes[0].pk)
    assert beat(nodes[1])["desired_serial"] == 0
    assert queue.xlen(STREAM_KEY) == 2  # both queued
    assert leases.leases_read(node_ids=[nodes[0].pk]).keys() == {nodes[0].pk}


def test_a_batch_may_not_hold_two_beats_of_one_node(nodes, db):
    heartbeat = Heartbeat.from_dict({"jobs": []})
    node = nodes[0]
    with pytest.raises(ValueError):
        node_reports_record(beats=[NodeBeat(node=node, heartbeat=heartbeat, now=None),
                                   NodeBeat(node=node, heartbeat=heartbeat, now=None)])


def test_the_cursor_and_outcomes_are_what_the_folder_wrote(queue, nodes, team_a, alice, submit):
    job = running_on(nodes[0], team_a, alice, submit)
    synced(nodes[0])
    beat(nodes[0], report(job, step=1))
    entry = queue.xrange(STREAM_KEY)[0][0].decode()
    heartbeats_fold_all()
    assert ControlLoopLease.objects.get(name=heartbeat_fold.FOLD_DUTY).last_tick_stats["last_entry"] == entry
    said = json.loads(queue.get(OUTCOME_KEY.format(node_id=nodes[0].pk)))
    assert said == {str(job.pk): [heartbeat_fold.report_key(report(job, step=1)), "a"]}
    # the key leaves the progress out
    key = heartbeat_fold.report_key
    assert key(report(job, step=1)) == key(report(job, step=2, steps_per_s=3.0)) != key(report(job, state="stopped"))


def test_a_batchs_statements_do_not_grow_with_its_heartbeats(queue, nodes, team_a, alice, submit):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    jobs = [running_on(node, team_a, alice, submit) for node in nodes]
    ControlLoopLease.objects.get_or_create(name=heartbeat_fold.FOLD_DUTY)  # what the first fold creates

    def fold_statements(senders):
        synced(*(node for node, _job in senders))  # the last checkpoint changed the desired state
        for node, job in senders:
            beat(node, report(job, step=5 + len(senders), steps_per_s=1.0, checkpoint=checkpoint(job, len(senders))))
        with CaptureQueriesContext(connection) as captured:
            assert heartbeats_fold().recorded == len(senders)
        return [q["sql"].split()[0].upper() for q in captured.captured_queries
                if not q["sql"].upper().startswith(("SAVEPOINT", "RELEASE", "BEGIN", "COMMIT"))]

    one = fold_statements(list(zip(nodes[:1], jobs[:1], strict=True)))
    two = fold_statements(list(zip(nodes, jobs, strict=True)))

    assert len(two) == len(one), (one, two)
    assert [Job.objects.get(pk=job.pk).last_checkpoint_step for job in jobs] == [2, 2]


@pytest.mark.django_db(transaction=True)
def test_the_path_before_django_queues_the_heartbeat_as_it_received_it(queue, nodes, team_a, alice, submit, settings):
    from fleet.services import node_token_issue
    from tests.jobs.test_heartbeat_fast_path import post

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    job = running_on(nodes[0], team_a, alice, submit)
    token = node_token_issue(node=nodes[0])
    held = post({"jobs": []}, token=token)[2]["desired_version"]  # recorded in its request: no version held
    body = {"telemetry": {"utilization": 0.25}, "jobs": [report(job, step=3, steps_per_s=1.0)],
            "desired_version": held}

    status, _, answer, django_answered = post(body, token=token)

    assert (status, django_answered, answer["deferred"], answer["desired"]) == (200, False, [job.pk], None)
    assert [json.loads(fields[b"beat"]) for _id, fields in queue.xrange(STREAM_KEY)] == [body]  # as received
    heartbeats_fold_all()
    assert Job.objects.get(pk=job.pk).progress_step == 3
    assert post(body, token=token)[2]["accepted"] == [job.pk]


def test_a_cancelled_jobs_copy_hears_cancel_with_the_desired_state_that_drops_it(queue, nodes, team_a, alice, submit):
    from jobs.services import job_cancel, job_event_add

    job = running_on(nodes[0], team_a, alice, submit)
    job_event_add(job=job, type=JobEvent.Type.PLACED, reason="placed", extra={"nodes": [nodes[0].hostname]})
    synced(nodes[0])
    assert beat(nodes[0], report(job, step=4))["deferred"] == [job.pk]
    heartbeats_fold_all()
    assert beat(nodes[0], report(job, step=5))["accepted"] == [job.pk]  # the folder's outcome, queued again
    heartbeats_fold_all()

    job_cancel(job=Job.objects.get(pk=job.pk), by=alice)
    answer = beat(nodes[0], report(job, step=6))  # its agent holds the desired state that lists the job

    # Recorded in its request: from the new desired state alone the agent would stop the copy at a
    # cut (a checkpoint of a cancelled job); with "cancel" it kills it and removes its store.
    assert [(r["job_id"], r["cancel"]) for r in answer["rejected"]] == [(job.pk, True)]
    assert answer["accepted"] == [] and answer["desired"]["jobs"] == []
