"""The full heartbeat's common case answered on the event loop (jobs/heartbeat_api.py: _queued_answer,
MERIDIAN_HEARTBEAT_FOLD=async, the agent holds the current desired state): queued for the folder
without Django's thread but for one statement, answered as Django answers it; and each case it must
not answer so taken by the full path (a revoked or rotated token, a node lost, Redis unreachable, a
desired state changed or never built in this process, the backlog full). Each heartbeat goes through
the real ASGI application (portal.asgi) to the tests' real Redis; whether the full path ran is seen
by wrapping jobs.heartbeat_api._heartbeat, whether Django answered from its request_started signal."""

import pytest

from fleet import lease_api, leases
from fleet.lease_api import tokens_forget
from fleet.models import Accelerator, Node, node_token_hash
from fleet.services import fleet_generate, node_token_issue, node_token_revoke
from jobs import desired_version, heartbeat_api
from jobs.heartbeat_fold import OUTCOME_KEY, STREAM_KEY, heartbeats_fold_all
from jobs.models import Job, Replica
from tests.jobs.heartbeat_requests import post

# Transactional: the full path and Django answer in threads whose connections must see the test's rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def queue(redis_url, settings):
    """The tests' real Redis, its queue, outcomes, leases and serials empty; async mode; no process
    cache of tokens or desired states."""
    settings.REDIS_URL = redis_url
    settings.MERIDIAN_HEARTBEAT_FOLD = "async"
    settings.MERIDIAN_LEASE_TOKEN_CACHE_SECONDS = 60.0
    leases._down_until = 0.0
    store = leases.lease_store()

    def empty():
        store.delete(STREAM_KEY, leases.LEASE_KEY, leases.DESIRED_SERIAL_KEY, leases.DESIRED_NODES_KEY,
                     *store.keys(OUTCOME_KEY.format(node_id="*")))
        tokens_forget()
        desired_version._cache.clear()
        leases._down_until = 0.0

    empty()
    yield store
    empty()


@pytest.fixture
def full_path(monkeypatch):
    """The heartbeats the full path (jobs.heartbeat_api._heartbeat) answered, counted."""
    calls = []
    original = heartbeat_api._heartbeat

    def counted(*args):
        calls.append(args[0])
        return original(*args)

    monkeypatch.setattr(heartbeat_api, "_heartbeat", counted)
    return calls


@pytest.fixture
def node(db):
    fleet_generate(regions=1, clusters=1, nodes=2, devices=2, accelerator_type="H100-80GB", prefix="ol")
    return Node.objects.order_by("hostname").first()


@pytest.fixture
def job(node, team_a, alice, submit):
    """A job running on `node`'s device 0, generation 0."""
    job = submit(team_a, alice, accelerator_type="H100-80GB", world_size=1, min_devices=1)
    Replica.objects.filter(job=job).update(device=Accelerator.objects.get(node=node, index=0))
    Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING)
    return job


def heartbeat(job, step, *, held=None):
    body = {"telemetry": {"utilization": 0.5, "devices": [{"index": 0, "utilization": 0.5, "memory_used_gb": 9.0}]},
            "jobs": [{"job_id": job.pk, "state": "running", "step": step, "steps_per_s": 1.5, "generation": 0}]}
    if held is not None:
        body["desired_version"] = held
    return body


def synced(token, job):
    """The agent's first heartbeat (recorded in its request: it holds no desired state); returns the
    version it holds after it. This process has built the desired state and maps the token."""
    status, _, answer, _ = post(heartbeat(job, 1), token=token)
    assert status == 200 and answer["desired"] is not None
    return answer["desired_version"]


def test_the_common_case_is_queued_on_the_loop_and_answered_as_django_answers_it(queue, node, job, full_path):
    token = node_token_issue(node=node)
    held = synced(token, job)
    full_path.clear()
    queue.hset(leases.DESIRED_SERIAL_KEY, node.pk, 7)

    status, headers, answer, django = post(heartbeat(job, 5, held=held), token=token)

    assert (status, django, full_path) == (200, False, [])  # neither Django nor the full path
    assert answer["desired"] is None and answer["desired_version"] == held
    # the report, but for its progress, is the first heartbeat's, which was recorded: its outcome known
    assert answer["accepted"] == [job.pk] and answer["desired_serial"] == 7
    assert queue.xlen(STREAM_KEY) == 1 and Job.objects.get(pk=job.pk).progress_step == 1  # queued, not recorded
    assert leases.leases_read(node_ids=[node.pk]).keys() == {node.pk}  # the script wrote the lease
    # Django's answer to the same heartbeat (queued too) is the same
    assert post(heartbeat(job, 5, held=held), token=token, fast=False)[:3] == (status, headers, answer)
    heartbeats_fold_all()
    assert Job.objects.get(pk=job.pk).progress_step == 5
    after = post(heartbeat(job, 6, held=held), token=token)
    assert after[2]["accepted"] == [job.pk] and full_path == []


@pytest.mark.parametrize("change", ["revoked", "rotated"])
def test_a_revoked_or_rotated_token_is_refused_at_once_though_the_process_still_maps_it(
        queue, node, job, full_path, change):
    token = node_token_issue(node=node)
    held = synced(token, job)
    assert post(heartbeat(job, 2, held=held), token=token)[0] == 200 and full_path == [token]  # mapped now
    heartbeats_fold_all()
    if change == "revoked":
        node_token_revoke(node=node)
    else:
        node_token_issue(node=node)

    status, _, answer, django = post(heartbeat(job, 5, held=held), token=token)

    assert (status, django) == (401, True)  # Django's 401: the row is read on every heartbeat
    assert queue.xlen(STREAM_KEY) == 0  # nothing of it queued for the folder
    assert Job.objects.get(pk=job.pk).progress_step == 2
    # the process's map still names the node (its reload is 60 s away): the node's row refused it
    assert lease_api._tokens.digests.get(node_token_hash(token)) == node.pk


def test_a_lost_node_takes_the_full_path_and_comes_back(queue, node, job, full_path):
    token = node_token_issue(node=node)
    held = synced(token, job)
    Node.objects.filter(pk=node.pk).update(state=Node.State.LOST)
    full_path.clear()

    status, _, answer, django = post(heartbeat(job, 5, held=held), token=token)

    assert (status, django, len(full_path)) == (200, False, 1)
    assert Node.objects.get(pk=node.pk).state == Node.State.READY
    assert Job.objects.get(pk=job.pk).progress_step == 5 and queue.xlen(STREAM_KEY) == 0  # recorded in the request


def test_with_redis_unreachable_the_full_path_records_it_in_the_request(queue, node, job, full_path, settings):
    token = node_token_issue(node=node)
    held = synced(token, job)
    full_path.clear()
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens on the discard port

    status, _, answer, django = post(heartbeat(job, 5, held=held), token=token)

    assert (status, django, len(full_path)) == (200, False, 1)
    assert answer["accepted"] == [job.pk] and answer["desired_serial"] is None
    assert Job.objects.get(pk=job.pk).progress_step == 5


def test_a_changed_desired_state_is_answered_whole_by_the_full_path(queue, node, job, full_path, team_a, alice,
                                                                    submit):
    token = node_token_issue(node=node)
    held = synced(token, job)
    other = submit(team_a, alice, accelerator_type="H100-80GB", world_size=1, min_devices=1)
    Replica.objects.filter(job=other).update(device=Accelerator.objects.get(node=node, index=1))
    Job.objects.filter(pk=other.pk).update(state=Job.State.RUNNING)
    full_path.clear()

    status, _, answer, _ = post(heartbeat(job, 5, held=held), token=token)

    assert (status, len(full_path)) == (200, 1)
    assert answer["desired_version"] != held
    assert sorted(j["job_id"] for j in answer["desired"]["jobs"]) == sorted([job.pk, other.pk])
    assert Job.objects.get(pk=job.pk).progress_step == 5 and queue.xlen(STREAM_KEY) == 0


def test_a_version_this_process_never_built_takes_the_full_path_once(queue, node, job, full_path):
    token = node_token_issue(node=node)
    held = synced(token, job)
    desired_version._cache.clear()  # another web process answered the first heartbeat
    full_path.clear()

    first = post(heartbeat(job, 5, held=held), token=token)
    second = post(heartbeat(job, 6, held=held), token=token)

    assert len(full_path) == 1  # the first builds the state; the second is answered on the loop
    assert first[2]["desired"] is None and second[2]["desired"] is None
    assert queue.xlen(STREAM_KEY) == 2  # both queued (the full path queues the common case too)


def test_with_the_backlog_full_the_full_path_records_it_in_the_request(queue, node, job, full_path, settings):
    token = node_token_issue(node=node)
    held = synced(token, job)
    settings.MERIDIAN_HEARTBEAT_FOLD_BACKLOG = 1
    queue.xadd(STREAM_KEY, {"node": node.pk, "at": "0", "beat": "{}"})  # the folder is behind
    full_path.clear()

    status, _, answer, _ = post(heartbeat(job, 5, held=held), token=token)

    assert (status, len(full_path)) == (200, 1)
    assert answer["accepted"] == [job.pk] and Job.objects.get(pk=job.pk).progress_step == 5
    assert queue.xlen(STREAM_KEY) == 1


@pytest.mark.parametrize("change", ["revoked", "rotated"])
def test_a_heartbeat_queued_before_its_token_was_revoked_is_never_applied(queue, node, job, full_path, change):
    token = node_token_issue(node=node)
    held = synced(token, job)
    assert post(heartbeat(job, 5, held=held), token=token)[0] == 200 and queue.xlen(STREAM_KEY) == 1
    if change == "revoked":
        node_token_revoke(node=node)
    else:
        node_token_issue(node=node)

    result = heartbeats_fold_all()

    assert (result.entries, result.recorded, result.skipped) == (1, 0, 1)
    assert Job.objects.get(pk=job.pk).progress_step == 1 and queue.xlen(STREAM_KEY) == 0


def test_an_unforeseen_error_on_the_loop_costs_the_full_path_not_a_500(queue, node, job, full_path, monkeypatch):
    from jobs import heartbeat_fold

    token = node_token_issue(node=node)
    held = synced(token, job)
    full_path.clear()

    queued = heartbeat_fold.heartbeat_enqueue_packed

    async def broken(**kwargs):
        await queued(**kwargs)
        raise ValueError("an answer no one can read")

    monkeypatch.setattr(heartbeat_fold, "heartbeat_enqueue_packed", broken)
    status, _, answer, _ = post(heartbeat(job, 5, held=held), token=token)

    assert (status, len(full_path)) == (200, 1)  # queued on the loop, then answered by the full path
    assert answer["desired"] is None and queue.xlen(STREAM_KEY) == 2  # queued twice: the folder coalesces them
    assert heartbeats_fold_all().coalesced == 1 and Job.objects.get(pk=job.pk).progress_step == 5
