"""The tick's snapshot (jobs.snapshot.snapshot_build) is built column by column, without a JobRow per
job: after random changes to jobs, replicas, devices and approvals it must equal a reference built
the plain way, one scheduler.JobRow per Job read through the ORM."""
import random
from datetime import timedelta

import numpy as np
import pytest
from django.utils import timezone

import scheduler
from fleet.agent_services import node_register
from fleet.models import Accelerator, Node
from jobs.models import Job, Move, PreemptionRequest, Replica
from jobs.services import job_submit
from jobs.snapshot import MOVING_STATES, RUNNING_STATES, TIERS, snapshot_build

S = Job.State
STATES = [S.PENDING, S.PREEMPTED, S.SCHEDULED, S.RUNNING, S.RUNNING, S.MIGRATING, S.RESIZING, S.SUCCEEDED]


def reference_jobs(index, now):
    """One JobRow per unfinished, not-moving Job (ORM reads), in id order, as the tick must see them."""
    snap = index.snapshot
    type_pos = {name: i for i, name in enumerate(snap.type_names)}
    team_pos = {name: i for i, name in enumerate(snap.teams.names)}
    rows = []
    for job in Job.objects.exclude(state__in=Job.TERMINAL_STATES).exclude(state__in=MOVING_STATES).order_by("id"):
        held = Replica.objects.filter(job=job, device__isnull=False).values("device_id").distinct().count()
        resized = Move.objects.filter(job=job, kind=Move.Kind.RESIZE).order_by("-created_at").first()
        approval = PreemptionRequest.objects.filter(job=job, state=PreemptionRequest.State.APPROVED).first()
        started = job.last_started_at.timestamp() if job.last_started_at else None
        approved = bool(approval and approval.decided_at and (
            started is None or approval.decided_at.timestamp() >= started))
        running = job.state in RUNNING_STATES
        rows.append(scheduler.JobRow(
            id=job.pk, team=team_pos[job.team.name], tier=TIERS[job.tier], type_id=type_pos[job.accelerator_type],
            world_size=job.world_size, min_devices=job.min_devices,
            state=scheduler.RUNNING if running and held else scheduler.PENDING,
            submit_time=job.submitted_at.timestamp(), attained_device_seconds=job.attained_device_seconds,
            ideal_device_seconds=job.ideal_device_seconds,
            last_checkpoint_time=job.last_checkpoint_at.timestamp() if job.last_checkpoint_at else float("-inf"),
            last_checkpoint_step=job.last_checkpoint_step or 0, checkpoint_bytes=job.checkpoint_bytes,
            last_start_time=started if started is not None else float("-inf"),
            last_resize_time=(resized.created_at.timestamp() if resized and running else float("-inf")),
            preemption_approved=approved, max_spread=snap.jobs.max_spread[0] if len(snap.jobs) else 3,
            name=f"#{job.pk} {job.name}"))
    return scheduler.Jobs.from_rows(rows)


def random_changes(rng, jobs, devices, now, *, teams):
    for job in jobs:
        state = rng.choice(STATES)
        fields = dict(state=state, team_id=rng.choice(teams), attained_device_seconds=rng.uniform(0, 1e5),
                      ideal_device_seconds=rng.uniform(0, 1e5), checkpoint_bytes=rng.randrange(0, 10**12),
                      last_checkpoint_step=rng.choice([None, 0, rng.randrange(1, 10**6)]),
                      last_checkpoint_at=rng.choice([None, now - timedelta(seconds=rng.uniform(0, 3600))]),
                      last_started_at=rng.choice([None, now - timedelta(seconds=rng.uniform(0, 3600))]))
        Job.objects.filter(pk=job.pk).update(**fields)
        replicas = list(Replica.objects.filter(job=job).order_by("rank"))
        placed = state in RUNNING_STATES or state in MOVING_STATES or rng.random() < 0.2
        chosen = rng.sample(devices, k=min(len(devices), rng.randint(1, len(replicas))))
        for replica in replicas:  # several ranks on one device when fewer devices than ranks (spliced)
            replica.device_id = chosen[replica.rank % len(chosen)].pk if placed and rng.random() < 0.9 else None
        Replica.objects.bulk_update(replicas, ["device"])
        if rng.random() < 0.3:
            Move.objects.create(job=job, kind=Move.Kind.RESIZE, step=Move.Step.RESIZE, state=Move.State.DONE,
                                reason="test", created_at=now - timedelta(seconds=rng.uniform(0, 600)),
                                step_deadline=now)
        PreemptionRequest.objects.filter(job=job).delete()  # one approval per job at most
        if rng.random() < 0.3:
            PreemptionRequest.objects.create(
                job=job, state=PreemptionRequest.State.APPROVED, reason="test", requested_at=now, expires_at=now,
                decided_at=rng.choice([None, now - timedelta(seconds=rng.uniform(0, 3600))]))
    for device in rng.sample(devices, k=len(devices) // 4):
        Accelerator.objects.filter(pk=device.pk).update(healthy=not device.healthy)
    for node in Node.objects.all():
        Node.objects.filter(pk=node.pk).update(state=rng.choice(list(Node.State)))


@pytest.mark.django_db
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_columnar_snapshot_equals_a_row_by_row_reference_after_random_changes(seed, short_policy, alice,
                                                                                  team_a, team_b, job_spec):
    rng = random.Random(seed)
    for n, kind in enumerate(["CPU", "CPU", "A100-40GB", "A100-40GB"]):
        node_register(enrollment=short_policy, hostname=f"s{n}", region="eu" if n % 2 else "us", cluster="c1",
                      devices=[{"type": kind}] * 4)
    jobs = [job_submit(team=team_a, submitted_by=alice,
                       spec=job_spec(world_size=w, min_devices=rng.choice([1, w]), tier=rng.choice(list(TIERS)),
                                     accelerator_type=rng.choice(["CPU", "A100-40GB"])))
            for w in [rng.choice([1, 2, 4]) for _ in range(30)]]
    devices = list(Accelerator.objects.all())
    now = timezone.now()
    for _ in range(2):
        random_changes(rng, jobs, devices, now, teams=[team_a.pk, team_b.pk])
        index = snapshot_build(now=now)
        expected = reference_jobs(index, now)
        got = index.snapshot.jobs
        for name in ("ids", "team", "tier", "type_id", "world_size", "min_devices", "state", "submit_time",
                     "attained_device_seconds", "ideal_device_seconds", "last_checkpoint_time",
                     "last_checkpoint_step", "checkpoint_bytes", "last_start_time", "last_resize_time",
                     "preemption_approved", "preemption_denied", "max_spread"):
            np.testing.assert_allclose(getattr(got, name), getattr(expected, name), rtol=0, atol=1e-3,
                                       err_msg=name)
        assert got.names == expected.names
        # each device's holder: the running job (snapshot position) whose replicas point at it
        acc = index.snapshot.accelerators
        position = {int(job_id): i for i, job_id in enumerate(got.ids)}
        states = dict(Job.objects.values_list("id", "state"))
        for i, device_id in enumerate(index.accelerator_ids):
            holders = set(Replica.objects.filter(device_id=int(device_id)).values_list("job_id", flat=True))
            running = {j for j in holders if states[j] in RUNNING_STATES and j in position}
            moving = {j for j in holders if states[j] in MOVING_STATES}
            healthy = Accelerator.objects.get(pk=int(device_id)).healthy and not moving
            assert bool(acc.healthy[i]) == healthy
            # (random placements may put two running jobs on one device: the snapshot names one of them)
            assert int(acc.holder[i]) in ({position[j] for j in running} or {-1})
        assert sorted(index.job_ids) == sorted(j for j, s in states.items() if s not in Job.TERMINAL_STATES)
