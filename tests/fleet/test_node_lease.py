"""The agents' liveness lease (fleet/lease_api.py, answered before Django by portal.asgi) and what
reads it: the lost-node sweep, the batch writer of Node.last_heartbeat, the desired serial."""
import json
import signal
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.utils import timezone

from fleet import leases
from fleet.lease_api import LEASE_PATH, MAX_BODY_BYTES, tokens_forget
from fleet.models import Node
from fleet.services import fleet_generate, node_token_issue, node_token_revoke
from jobs.services import node_lost_after, node_lost_sweep
from protocol.node import LeaseAnswer


@pytest.fixture
def lease_redis(redis_url, settings):
    """The real Redis of the tests, with the lease keys empty; every process cache forgotten."""
    settings.REDIS_URL = redis_url
    settings.MERIDIAN_LEASE_TOKEN_CACHE_SECONDS = 60.0
    leases._down_until = 0.0
    store = leases.lease_store()
    store.delete(leases.LEASE_KEY, leases.DESIRED_SERIAL_KEY, leases.DESIRED_NODES_KEY)
    tokens_forget()
    yield store
    store.delete(leases.LEASE_KEY, leases.DESIRED_SERIAL_KEY, leases.DESIRED_NODES_KEY)
    tokens_forget()


@pytest.fixture
def nodes(db):
    """Two enrolled nodes, each with its own token: [(node, token), (node, token)]."""
    fleet_generate(regions=1, clusters=1, nodes=2, devices=2, accelerator_type="CPU", prefix="l")
    return [(node, node_token_issue(node=node)) for node in Node.objects.order_by("hostname")]


def lease(body=None, *, token=None, method="POST", raw=None, headers=()):
    """Returns (status, decoded body) of one request to the ASGI application (portal.asgi)."""
    from portal.asgi import application

    payload = raw if raw is not None else json.dumps(body).encode()
    sent = [*([(b"authorization", f"Node {token}".encode())] if token else []), *headers]
    communicator = HttpCommunicator(application, method, LEASE_PATH, body=payload, headers=sent)
    response = async_to_sync(communicator.get_response)(timeout=10)
    return response["status"], json.loads(response["body"])


def test_a_lease_answers_the_nodes_serial_and_records_it_in_redis(lease_redis, nodes):
    (node, token), _ = nodes
    status, body = lease({"node_id": node.pk}, token=token)

    assert status == 200, body
    answer = LeaseAnswer.from_dict(body)
    assert answer.node_id == node.pk and answer.desired_serial == 0
    assert answer.full_heartbeat_seconds > answer.lease_seconds > 0
    assert leases.leases_read(node_ids=[node.pk]).keys() == {node.pk}


def test_a_lease_without_with_a_wrong_or_a_revoked_token_is_a_401(lease_redis, nodes, settings):
    (node, token), _ = nodes
    assert lease({"node_id": node.pk})[0] == 401
    assert lease({"node_id": node.pk}, token="not-a-token")[0] == 401
    assert lease({"node_id": node.pk}, token=token)[0] == 200
    node_token_revoke(node=node)
    # within the token map's reload period the revoked token still leases (the documented delay) ...
    assert lease({"node_id": node.pk}, token=token)[0] == 200
    # ... and not after it
    settings.MERIDIAN_LEASE_TOKEN_CACHE_SECONDS = 0.0
    status, body = lease({"node_id": node.pk}, token=token)
    assert status == 401 and "revoked" in body["detail"]


def test_a_lease_for_another_node_is_a_403(lease_redis, nodes):
    (node, token), (other, _) = nodes
    status, body = lease({"node_id": other.pk}, token=token)
    assert status == 403 and "itself" in body["detail"]
    assert leases.leases_read(node_ids=[node.pk, other.pk]) == {}


@pytest.mark.parametrize("raw, status, says", [
    (b"x" * (MAX_BODY_BYTES + 1), 413, "at most"),
    (b"not json", 400, "JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"{}", 400, "node_id"),
    (b'{"node_id": "7"}', 400, "node_id"),
    (b'{"node_id": 0}', 400, "node_id"),
    (b'{"node_id": 1, "v": 99}', 400, "newer"),
], ids=["too-large", "not-json", "a-list", "no-node", "node-as-text", "node-zero", "newer-protocol"])
def test_a_bad_lease_body_is_a_4xx_naming_the_problem(lease_redis, nodes, raw, status, says):
    (node, token), _ = nodes
    answered, body = lease(token=token, raw=raw)
    assert answered == status and says in body["detail"], body


def test_a_lease_that_says_it_is_too_large_is_refused_unread_and_a_get_is_a_405(lease_redis, nodes):
    (node, token), _ = nodes
    assert lease({"node_id": node.pk}, token=token, headers=[(b"content-length", b"99999")])[0] == 413
    assert lease({"node_id": node.pk}, token=token, method="GET")[0] == 405


def test_a_lease_while_redis_is_down_is_a_503_not_a_500(lease_redis, nodes, settings, tmp_path):
    (node, token), _ = nodes
    settings.REDIS_URL = f"unix://{tmp_path}/no-redis.sock?db=0"
    status, body = lease({"node_id": node.pk}, token=token)
    assert status == 503 and "full heartbeat" in body["detail"]


def test_a_node_that_only_leases_stays_alive_and_one_whose_lease_stops_is_lost(lease_redis, nodes):
    (leasing, token), (silent, _) = nodes
    long_ago = timezone.now() - node_lost_after() - timedelta(seconds=60)
    Node.objects.update(last_heartbeat=long_ago)  # both last sent a full heartbeat long ago

    assert lease({"node_id": leasing.pk}, token=token)[0] == 200
    assert node_lost_sweep(now=timezone.now()) == [silent.hostname]
    assert Node.objects.get(pk=leasing.pk).state == Node.State.READY

    # the lease stops: once it is older than the limit, the node is lost too
    later = timezone.now() + node_lost_after() + timedelta(seconds=1)
    assert node_lost_sweep(now=later) == [leasing.hostname]
    assert Node.objects.get(pk=leasing.pk).state == Node.State.LOST


def test_the_flush_writes_every_lease_to_last_heartbeat_in_one_batch_and_never_back(
        lease_redis, nodes, django_assert_max_num_queries):
    (first, token_1), (second, token_2) = nodes
    assert lease({"node_id": first.pk}, token=token_1)[0] == 200
    assert lease({"node_id": second.pk}, token=token_2)[0] == 200
    future = timezone.now() + timedelta(hours=1)
    Node.objects.filter(pk=second.pk).update(last_heartbeat=future)  # a full heartbeat newer than the lease

    with django_assert_max_num_queries(1):
        updated = leases.leases_flush(now=timezone.now())

    assert updated == 1
    leased_at = leases.leases_read(node_ids=[first.pk])[first.pk]
    assert Node.objects.get(pk=first.pk).last_heartbeat == leased_at
    assert Node.objects.get(pk=second.pk).last_heartbeat == future


def test_a_lease_never_brings_a_lost_node_back(lease_redis, nodes):
    (node, token), _ = nodes
    Node.objects.filter(pk=node.pk).update(state=Node.State.LOST, last_heartbeat=timezone.now() - timedelta(hours=1))
    assert lease({"node_id": node.pk}, token=token)[0] == 200
    leases.leases_flush(now=timezone.now())
    node.refresh_from_db()
    assert node.state == Node.State.LOST and node.last_heartbeat > timezone.now() - timedelta(minutes=1)


def test_marking_a_node_lost_bumps_its_desired_serial(lease_redis, nodes, django_capture_on_commit_callbacks):
    (node, token), _ = nodes
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    with django_capture_on_commit_callbacks(execute=True):
        node_lost_sweep(now=timezone.now())
    assert leases.desired_serial_of(node_id=node.pk) == 1
    status, body = lease({"node_id": node.pk}, token=token)
    assert status == 200 and body["desired_serial"] == 1



def test_a_lease_answers_its_own_nodes_serial_and_survives_a_redis_that_forgot_its_script(lease_redis, nodes):
    """The lease's one command is a Lua script called by its digest (EVALSHA): a Redis restarted, or
    one whose scripts were flushed, no longer knows it, and the lease must load it again, not 503."""
    (node, token), (other, _) = nodes
    leases.desired_serials_bump(node_ids=[node.pk, other.pk])
    leases.desired_serials_bump(node_ids=[node.pk])
    lease_redis.script_flush()

    first = lease({"node_id": node.pk}, token=token)
    again = lease({"node_id": node.pk}, token=token)

    assert first == again == (200, first[1]) and first[1]["desired_serial"] == 2
    assert leases.leases_read(node_ids=[node.pk, other.pk]).keys() == {node.pk}


@pytest.fixture
def own_redis(lease_redis, settings):
    """A redis-server of this test's own (portal.private_redis), which the test may restart or
    freeze; the lease's REDIS_URL points to it."""
    import shutil
    import tempfile

    from portal.private_redis import PrivateRedis

    directory = tempfile.mkdtemp(prefix="mr-")  # a unix socket's path must stay short
    private = PrivateRedis(f"{directory}/redis.sock").start()
    settings.REDIS_URL = private.url
    yield private
    if private.process is not None:
        private.process.send_signal(signal.SIGCONT)
    private.stop()
    shutil.rmtree(directory, ignore_errors=True)


async def lease_on_this_loop(body, *, token):
    """lease() from inside a coroutine: leases sent from one coroutine share one event loop, hence
    the lease's Redis connections (fleet.lease_api.LeaseConnections keeps them per loop)."""
    from portal.asgi import application

    communicator = HttpCommunicator(application, "POST", LEASE_PATH, body=json.dumps(body).encode(),
                                    headers=[(b"authorization", f"Node {token}".encode())])
    response = await communicator.get_response(timeout=10)
    return response["status"], json.loads(response["body"])


def test_a_lease_after_a_redis_restart_reconnects_and_loads_its_script_again(own_redis, nodes):
    """The lease keeps its Redis connection open between leases; a Redis restarted meanwhile has
    closed it and forgotten the script. The next lease must still be a 200 (not a 503 that sends
    every agent to a full heartbeat at once), written to the new Redis."""
    (node, token), _ = nodes

    async def lease_restart_lease():
        first = await lease_on_this_loop({"node_id": node.pk}, token=token)
        own_redis.stop()
        own_redis.start()
        return first, await lease_on_this_loop({"node_id": node.pk}, token=token)

    first, second = async_to_sync(lease_restart_lease)()

    assert first[0] == second[0] == 200, (first, second)
    assert leases.leases_read(node_ids=[node.pk]).keys() == {node.pk}  # the restarted (empty) Redis


def test_a_lease_to_a_redis_that_stopped_answering_is_a_503_after_the_timeout(own_redis, nodes, monkeypatch):
    """A Redis that accepts but never answers (here: its process stopped) must not hold a lease
    forever: the connection's socket timeout turns it into a 503, and the agent sends a full
    heartbeat instead."""
    from fleet import lease_api

    monkeypatch.setattr(lease_api, "LEASE_REDIS_TIMEOUT_SECONDS", 0.3)
    (node, token), _ = nodes

    async def lease_freeze_lease():
        first = await lease_on_this_loop({"node_id": node.pk}, token=token)
        own_redis.process.send_signal(signal.SIGSTOP)
        return first, await lease_on_this_loop({"node_id": node.pk}, token=token)

    first, second = async_to_sync(lease_freeze_lease)()

    assert first[0] == 200 and second[0] == 503, (first, second)
    assert "full heartbeat" in second[1]["detail"]


def test_placing_and_cancelling_a_job_bumps_the_serial_of_its_node_only(
        lease_redis, nodes, settings, alice, team_a, submit, django_capture_on_commit_callbacks):
    from jobs.models import Replica
    from jobs.services import job_cancel
    from jobs.tick import tick_run

    settings.MERIDIAN_MIN_RUN_SECONDS = 0.0
    Node.objects.update(last_heartbeat=timezone.now())
    job = submit(team_a, alice, world_size=2, min_devices=2)
    with django_capture_on_commit_callbacks(execute=True):
        tick_run()
    placed_on = set(Replica.objects.filter(job=job).values_list("device__node_id", flat=True))
    assert len(placed_on) == 1
    (here,) = placed_on
    (elsewhere,) = {n.pk for n, _ in nodes} - placed_on
    serial = leases.desired_serial_of(node_id=here)
    assert serial >= 1 and leases.desired_serial_of(node_id=elsewhere) == 0

    # cancelling releases the replicas: the node the job left is told all the same
    with django_capture_on_commit_callbacks(execute=True):
        job_cancel(job=job, by=alice)
    assert not Replica.objects.filter(job=job, device__isnull=False).exists()
    assert leases.desired_serial_of(node_id=here) > serial
    assert leases.desired_serial_of(node_id=elsewhere) == 0


def test_nodes_a_caller_names_are_trusted_only_until_the_job_changes_again_in_the_transaction(
        lease_redis, nodes, alice, team_a, submit, django_capture_on_commit_callbacks):
    """A start names its job's nodes (no lookup after commit); a later change of the same job in
    the same transaction, without names, must be looked up, not signalled to the named nodes."""
    from django.db import transaction

    from jobs.desired_signal import desired_changed
    from jobs.models import Replica

    (first, _), (second, _) = nodes
    job = submit(team_a, alice, world_size=1, min_devices=1)
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            desired_changed(job_ids=[job.pk], nodes={job.pk: {first.pk}})
    assert leases.desired_serial_of(node_id=first.pk) == 1  # trusted: the job is on no node really
    assert leases.desired_serial_of(node_id=second.pk) == 0

    device = second.accelerators.first()
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            desired_changed(job_ids=[job.pk], nodes={job.pk: {first.pk}})
            Replica.objects.filter(job=job).update(device=device)
            desired_changed(job_ids=[job.pk])
    # looked up: now on the second node; the first is bumped as where the job was last signalled
    assert leases.desired_serial_of(node_id=second.pk) == 1
    assert leases.desired_serial_of(node_id=first.pk) == 2
    recorded = lease_redis.hget(leases.DESIRED_NODES_KEY, job.pk).decode()
    assert recorded == str(second.pk)


def test_a_full_heartbeat_answers_the_serial_it_read_before_building_the_desired_state(lease_redis, nodes):
    from rest_framework.test import APIClient

    (node, token), _ = nodes
    leases.desired_serials_bump(node_ids=[node.pk])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    response = client.post("/api/agent/heartbeat/", {"jobs": []}, format="json")
    assert response.status_code == 200 and response.json()["desired_serial"] == 1


def test_a_bump_records_each_jobs_nodes_and_bumps_where_it_was_and_is(lease_redis, monkeypatch):
    """Jobs' nodes go in (and out) many fields per command: the recorded nodes, the forgotten jobs
    and the serials must be what one command per job gave, at more than one chunk of jobs."""
    monkeypatch.setattr(leases, "CHUNK", 3)
    first = {job_id: {100 + job_id % 4} for job_id in range(1, 8)}  # 7 jobs: three chunks
    assert leases.desired_serials_bump(job_nodes=first) == {100, 101, 102, 103}
    # jobs 1-4 move to node 200, jobs 5-7 stop (no nodes); job 8 is new on node 201
    second = {**{job_id: {200} for job_id in range(1, 5)}, **{job_id: set() for job_id in range(5, 8)}, 8: {201}}
    assert leases.desired_serials_bump(job_nodes=second, node_ids=[300]) == {100, 101, 102, 103, 200, 201, 300}
    recorded = {int(k): v.decode() for k, v in lease_redis.hgetall(leases.DESIRED_NODES_KEY).items()}
    assert recorded == {1: "200", 2: "200", 3: "200", 4: "200", 8: "201"}
    serials = {int(k): int(v) for k, v in lease_redis.hgetall(leases.DESIRED_SERIAL_KEY).items()}
    assert serials == {100: 2, 101: 2, 102: 2, 103: 2, 200: 1, 201: 1, 300: 1}
