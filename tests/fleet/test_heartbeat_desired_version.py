"""Heartbeats are answered from what changed: the desired state carries a version (a digest of its
content), a heartbeat naming the current version gets no desired state back, and each web process
rebuilds a node's desired state only when a fingerprint of the rows it is built from changed."""
import random

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from fleet.models import Accelerator, Node
from fleet.services import fleet_generate, node_token_issue
from jobs import desired_version
from jobs.models import Checkpoint, Job, Move, Replica
from jobs.tick import tick_run
from jobs.workflows import node_desired_state

S = Job.State


@pytest.fixture
def nodes(db, settings):
    settings.MERIDIAN_MIN_RUN_SECONDS = 0.0
    settings.MERIDIAN_JOB_MAX_SPREAD = "region"
    desired_version._cache.clear()
    fleet_generate(regions=1, clusters=1, nodes=3, devices=2, accelerator_type="H100-80GB", prefix="dv")
    return list(Node.objects.order_by("hostname"))


def beat(client, version=None):
    body = {"telemetry": {"utilization": 0.5}, "jobs": []}
    if version is not None:
        body["desired_version"] = version
    response = client.post("/api/agent/heartbeat/", body, format="json")
    assert response.status_code == 200, response.content
    return response.json()


def test_a_heartbeat_naming_the_current_version_gets_no_desired_state_until_it_changes(nodes, alice, team_a,
                                                                                       submit):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {node_token_issue(node=nodes[0])}")
    first = beat(client)
    assert first["desired"]["jobs"] == [] and first["desired_version"]
    assert beat(client, first["desired_version"])["desired"] is None
    assert beat(client, "an-old-version")["desired"] == first["desired"]  # another version: sent whole

    submit(team_a, alice, accelerator_type="H100-80GB", world_size=6, min_devices=6)  # spans all 3 nodes
    tick_run(now=timezone.now())
    placed = beat(client, first["desired_version"])
    assert placed["desired"] is not None and placed["desired_version"] != first["desired_version"]
    assert placed["desired"] == {k: v for k, v in node_desired_state(node=Node.objects.get(pk=nodes[0].pk)).items()
                                 if k != "v"}  # (a nested message carries no protocol version)
    assert beat(client, placed["desired_version"])["desired"] is None
    # another process (here: a direct write) changes the job: the fingerprint sees it
    Job.objects.update(generation=99)
    changed = beat(client, placed["desired_version"])
    assert changed["desired"]["jobs"][0]["generation"] == 99


def change(rng, jobs, devices, nodes, now):
    """One random write to a table the desired state is built from."""
    job = rng.choice(jobs)
    kind = rng.randrange(7)
    if kind == 0:
        Job.objects.filter(pk=job.pk).update(state=rng.choice([S.SCHEDULED, S.RUNNING, S.MIGRATING, S.PENDING]))
    elif kind == 1:
        Job.objects.filter(pk=job.pk).update(generation=rng.randrange(50), last_checkpoint_step=rng.randrange(9))
    elif kind == 2:
        replica = rng.choice(list(Replica.objects.filter(job=job)))
        replica.device = rng.choice(devices + [None])
        replica.save()
    elif kind == 3 and rng.random() < 0.4 and Checkpoint.objects.filter(job=job, retired_at__isnull=True).exists():
        # A restart from scratch retires the refused run's checkpoints (one row here is enough).
        Checkpoint.objects.filter(pk=Checkpoint.objects.filter(job=job, retired_at__isnull=True)
                                  .order_by("-step", "-id")[0].pk).update(retired_at=now)
    elif kind == 3:
        step = rng.randrange(1000)
        Checkpoint.objects.create(job=job, step=step, uri=f"/store/job-{job.pk}/ckpt-{step}", engine="framework",
                                  sha256="a" * 64)
    elif kind == 4:
        Move.objects.filter(job=job).delete()
        Move.objects.create(job=job, kind=rng.choice(list(Move.Kind)), step=rng.choice(list(Move.Step)),
                            from_node=rng.choice(nodes), from_generation=rng.randrange(5), step_deadline=now)
    elif kind == 5:
        Move.objects.filter(job=job).update(step=rng.choice(list(Move.Step)))
    else:
        Job.objects.filter(pk=job.pk).update(name=f"renamed-{rng.randrange(99)}", args=["--steps", "7"])


@pytest.mark.parametrize("seed", [1, 2])
def test_an_unchanged_fingerprint_always_means_an_unchanged_desired_state(nodes, alice, team_a, submit, seed):
    rng = random.Random(seed)
    jobs = [submit(team_a, alice, accelerator_type="H100-80GB", world_size=w, min_devices=w) for w in (1, 2, 2, 1)]
    tick_run(now=timezone.now())
    devices = list(Accelerator.objects.all())
    now = timezone.now()
    seen = {}
    for _ in range(60):
        change(rng, jobs, devices, nodes, now)
        for node in Node.objects.all():
            fingerprint = desired_version._inputs_fingerprint(node)
            desired = node_desired_state(node=node)
            if fingerprint in seen:
                assert seen[fingerprint] == desired
            seen[fingerprint] = desired
            answered, version = desired_version.node_desired_answer(node=node, held_version=None)
            assert answered.to_dict() == desired  # never a stale cached state
    assert len(seen) > 20  # the changes did change desired states
