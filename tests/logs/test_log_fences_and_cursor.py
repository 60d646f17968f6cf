"""Two ways a follower (`meridian logs -f`) could wait for ever on output a job printed:

- a fence that ends more than the copy it names: a batch holding the tail of an older copy of a
  job next to its current copy (the job resumed on this node) got every chunk of that job
  refused, and the agent stopped shipping every copy of it; each copy is now judged on its own;
- a cursor that passes a chunk committed later with a smaller id (PostgreSQL gives ids at insert,
  not at commit): every writer of a job's log now takes the job's row first.
"""
import json
import threading

import pytest
from django.db import connection, transaction
from log_nodes import enrollment, register  # noqa: F401 (enrollment: an autouse fixture)
from rest_framework.test import APIClient

from agent.logs import LogShipper, ship_until_idle
from fleet.models import Node
from jobs.demo_cast import cast_create
from jobs.logs import log_batch_record, log_chunks_list, log_marker_add
from jobs.models import Job, LogChunk
from jobs.services import job_submit
from jobs.tick import tick_run
from protocol.logs import LogBatch, LogBatchAnswer, RankLog, RankLogs
from protocol.logs import LogChunk as WireChunk
from runtime.rank_logs import MANIFEST, job_log_path
from runtime.spool import write_json_atomic


class NodeApi:
    """The agent's client's logs() over the real API (POST /api/agent/logs/ as the node)."""

    def __init__(self, token):
        self.token = token
        self.http = APIClient()
        self.http.credentials(HTTP_AUTHORIZATION=f"Node {token}")

    def logs(self, batch):
        answer = self.http.post("/api/agent/logs/", batch.to_dict(), format="json")
        assert answer.status_code == 200, answer.content
        return LogBatchAnswer.from_dict(answer.json())


def placed_job(team, user, job_spec):
    """A 1-rank job the tick placed on the only node: (job, that node's registration)."""
    node = register("n1", devices=1)
    job = job_submit(team=team, submitted_by=user, spec=job_spec(world_size=1, min_devices=1, tier="basic"))
    tick_run()
    job.refresh_from_db()
    assert job.replicas.first().device.node_id == node["node_id"]
    return job, node


def copy_dir(jobs_dir, job, attempt, generation, text):
    """A job directory as the agent and the launcher leave it: agent.json (the generation),
    logs.json naming rank 0's stdout, and that log."""
    job_dir = jobs_dir / f"{job.pk}.{attempt}"
    log = job_log_path(job_dir, 0)
    log.parent.mkdir(parents=True)
    log.write_text(text)
    (job_dir / "agent.json").write_text(json.dumps({"job_id": job.pk, "generation": generation}))
    write_json_atomic(job_dir / MANIFEST, RankLogs(ranks=(RankLog(rank=0, stream="stdout", path=str(log),
                                                                  start=0),)).to_dict())
    return job_dir


def shipped(job):
    return "".join(LogChunk.objects.filter(job=job, kind="output").order_by("id").values_list("text", flat=True))


@pytest.mark.django_db
def test_the_tail_of_an_older_copy_does_not_get_the_current_copy_refused(alice, team_a, job_spec):
    job, node = placed_job(team_a, alice, job_spec)
    old, current = (WireChunk(job_id=job.pk, generation=g, attempt=a, rank=0, stream="stdout", offset=0,
                              length=len(text), text=text)
                    for g, a, text in ((job.generation - 1, 1, "old tail\n"), (job.generation, 2, "epoch 0 loss\n")))
    answer = log_batch_record(node=Node.objects.get(pk=node["node_id"]), batch=LogBatch(chunks=(old, current)))
    assert answer.stored == 1 and shipped(job) == "epoch 0 loss\n"
    [rejection] = answer.rejected
    assert rejection.fence and rejection.generation == job.generation - 1 and "stale copy" in rejection.error


@pytest.mark.django_db
def test_the_agent_keeps_shipping_the_current_copy_when_an_older_copy_of_the_job_is_fenced(
        alice, team_a, job_spec, tmp_path):
    # The job resumed on this node: the older copy's last lines were not sent yet when its
    # generation was replaced. One batch carries both copies.
    job, node = placed_job(team_a, alice, job_spec)
    jobs_dir = tmp_path / "j"
    old = copy_dir(jobs_dir, job, 1, job.generation - 1, "old tail\n")
    current = copy_dir(jobs_dir, job, 2, job.generation, "epoch 0 loss\n")
    shipper = LogShipper(jobs_dir, NodeApi(node["token"]), launcher_alive=lambda job_dir: job_dir == current)
    ship_until_idle(shipper, timeout_s=30)
    assert shipped(job) == "epoch 0 loss\n"
    assert shipper.sources[old].done and not shipper.sources[current].done
    with open(job_log_path(current, 0), "a") as log:  # the current copy prints on: it is followed live
        log.write("epoch 1 loss\n")
    ship_until_idle(shipper, timeout_s=30)
    assert shipped(job) == "epoch 0 loss\nepoch 1 loss\n"


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite has one writer at a time: ids commit in order")
def test_a_cursor_reader_never_passes_a_chunk_that_commits_later_with_a_smaller_id(job_spec):
    cast = cast_create()
    job, node = placed_job(cast.team_a, cast.alice, job_spec)
    node = Node.objects.get(pk=node["node_id"])
    inserted, release = threading.Event(), threading.Event()

    def slow_marker():  # a transition's transaction: its marker gets an id, then it commits late
        try:
            with transaction.atomic():
                log_marker_add(job=Job.objects.get(pk=job.pk), text="preempting")
                inserted.set()
                release.wait(30)
        finally:
            connection.close()

    def output():
        try:
            log_batch_record(node=node, batch=LogBatch(chunks=(WireChunk(
                job_id=job.pk, generation=job.generation, attempt=1, rank=0, stream="stdout", offset=0,
                length=13, text="epoch 0 loss\n"),)))
        finally:
            connection.close()

    marker = threading.Thread(target=slow_marker)
    marker.start()
    assert inserted.wait(30)
    shipper = threading.Thread(target=output)
    shipper.start()
    shipper.join(3)  # on the old code it commits now, with the larger id
    first = log_chunks_list(job=job, rank=0)  # a follower's poll meanwhile
    cursor = first[-1].pk if first else 0
    release.set()
    marker.join(30)
    shipper.join(30)
    seen = [c.text for c in first] + [c.text for c in log_chunks_list(job=job, rank=0, after=cursor)]
    assert len(seen) == 2 and "epoch 0 loss\n" in seen, seen  # the follower saw both
