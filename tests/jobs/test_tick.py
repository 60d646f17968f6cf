"""The tick against the database: selectors build the snapshot, the core plans, services apply.

Agents are played by calling the same service their heartbeat API calls (node_report_apply);
the Celery worker by calling the service its move tasks call (jobs.moves.move_advance)."""
from collections import Counter
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone
from node_reports import FAKE_MANIFEST_SHA256, copy_checkpoint_uri

from fleet.agent_services import node_register
from fleet.models import Node
from jobs.accounting import accounting_run
from jobs.lease import tick_lease_claim, tick_lease_release
from jobs.models import Job, JobEvent, Move, PreemptionRequest, Replica
from jobs.moves import move_advance
from jobs.services import job_submit, preemption_approve, preemption_deny
from jobs.snapshot import snapshot_build
from jobs.tick import tick_run
from jobs.workflows import node_desired_state, node_report_apply
from scheduler import rank_layout

S = Job.State


@pytest.fixture(autouse=True)
def tick_policy(short_policy, settings):
    """short_policy (tests/jobs/conftest.py), and a node is lost after 30 s without a heartbeat."""
    settings.MERIDIAN_NODE_LOST_AFTER_SECONDS = 30.0


def make_node(hostname, devices=2, region="eu", cluster="c1"):
    enrollment = settings.MERIDIAN_AGENT_ENROLLMENT_TOKEN  # what short_policy set
    node, _token = node_register(enrollment=enrollment, hostname=hostname, region=region, cluster=cluster,
                                 devices=[{"type": "CPU"}] * devices)
    return node


def nodes_of(job):
    return set(Replica.objects.filter(job=job, device__isnull=False).values_list("device__node__hostname", flat=True))


def report(node, job, state, *, step=10, checkpoint_step=None, devices=None, now=None):
    """Plays the node's agent (one heartbeat), then the Celery worker (the move tasks it enqueues)."""
    entry = {"job_id": job.pk, "state": state, "step": step, "devices": devices or job.device_count}
    if checkpoint_step is not None:
        entry["checkpoint"] = {"step": checkpoint_step, "bytes": 100, "engine": "framework",
                               "uri": copy_checkpoint_uri(node, job.pk, checkpoint_step),
                               "sha256": FAKE_MANIFEST_SHA256}
    result = node_report_apply(node=node, report={"jobs": [entry], "telemetry": {"utilization": 0.5}}, now=now)
    for move_id in Move.objects.filter(state=Move.State.ACTIVE).values_list("id", flat=True):
        move_advance(move_id=move_id, now=now)
    return result


@pytest.mark.django_db
def test_a_pending_job_is_scheduled_then_runs_when_its_agent_reports(alice, team_a, job_spec):
    node = make_node("n1")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=2, min_devices=2, tier="basic"))

    result = tick_run()

    job.refresh_from_db()
    assert result.ran and result.counts["start"] == 1
    assert job.state == S.SCHEDULED and job.device_count == 2 and nodes_of(job) == {"n1"}
    desired = node_desired_state(node=node)
    assert [(e["job_id"], e["action"], e["devices"]) for e in desired["jobs"]] == [(job.pk, "run", 2)]
    report(node, job, "running")
    job.refresh_from_db()
    assert job.state == S.RUNNING and job.progress_step == 10


@pytest.mark.django_db
def test_a_placement_lands_every_rank_on_the_device_its_layout_names(alice, team_a, job_spec):
    """The starts' replica rows are written by (job, rank): each rank on rank_layout's device of the
    devices its PLACED event names, a spliced job's ranks in blocks, no rank left unplaced."""
    make_node("n1", devices=2)
    make_node("n2", devices=3)
    # too few devices for W = 8: it starts spliced, two or four ranks to a device
    spliced = job_submit(team=team_a, submitted_by=alice,
                         spec=job_spec(name="spliced", world_size=8, min_devices=2, tier="basic"))
    single = job_submit(team=team_a, submitted_by=alice,
                        spec=job_spec(name="single", world_size=1, min_devices=1, tier="basic"))

    result = tick_run()

    assert result.counts["start"] == 2
    for job in (spliced, single):
        job.refresh_from_db()
        placed = JobEvent.objects.get(job=job, type=JobEvent.Type.PLACED).extra_data["devices"]
        ranks = list(Replica.objects.filter(job=job).order_by("rank").values_list("rank", "device_id"))
        assert job.state == S.SCHEDULED and job.device_count == len(placed)
        assert ranks == list(enumerate(rank_layout(placed, job.world_size)))
    assert spliced.device_count < 8 and job_devices_spliced(spliced) == 8 // spliced.device_count


def job_devices_spliced(job):
    """Returns how many ranks of `job` share each of its devices (one number: they all share alike)."""
    counts = Counter(Replica.objects.filter(job=job).values_list("device_id", flat=True))
    assert len(set(counts.values())) == 1
    return next(iter(counts.values()))


@pytest.mark.django_db
def test_waiting_jobs_get_their_reason_and_place_in_line(alice, team_a, job_spec):
    make_node("n1", devices=1)
    first = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="a", world_size=1, min_devices=1, tier="standard")
    )
    second = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="b", world_size=1, min_devices=1, tier="standard")
    )
    third = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="c", world_size=1, min_devices=1, tier="standard")
    )

    tick_run()

    rows = {j.pk: j for j in Job.objects.all()}
    assert rows[first.pk].state == S.SCHEDULED
    assert rows[second.pk].queue_position == 1 and rows[third.pk].queue_position == 2
    assert rows[second.pk].wait_reason and rows[third.pk].wait_reason


@pytest.mark.django_db
def test_a_premium_job_preempts_a_basic_one_which_resumes_after_its_checkpoint(alice, team_a, job_spec):
    n1 = make_node("n1", devices=1)
    n2 = make_node("n2", devices=1)
    basic = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="b1", world_size=1, min_devices=1, tier="basic")
    )
    basic2 = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="b2", world_size=1, min_devices=1, tier="basic")
    )
    tick_run()
    for job in (basic, basic2):
        job.refresh_from_db()
        node = n1 if nodes_of(job) == {"n1"} else n2
        report(node, job, "running")
    premium = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium")
    )

    tick_run()

    premium.refresh_from_db()
    victims = [j for j in Job.objects.filter(pk__in=[basic.pk, basic2.pk]) if j.state == S.PREEMPTING]
    assert len(victims) == 1 and premium.state == S.SCHEDULED
    victim = victims[0]
    victim_node = Node.objects.get(hostname=next(iter(nodes_of(premium))))
    assert victim.device_count == 0 and nodes_of(victim) == set()
    # Until the victim's checkpoint is stored it is not given new devices.
    tick_run()
    victim.refresh_from_db()
    assert victim.state == S.PREEMPTING
    # Its node's agent stops it at a consistent cut and reports the checkpoint.
    result = report(victim_node, victim, "stopped", step=42, checkpoint_step=42)
    victim.refresh_from_db()
    assert result["accepted"] == [victim.pk]
    assert victim.state == S.PREEMPTED and victim.last_checkpoint_step == 42
    assert victim.queue_position == 1 or victim.queue_position is None
    assert JobEvent.objects.filter(job=victim, type=JobEvent.Type.CHECKPOINTED).exists()


@pytest.mark.django_db
def test_preempting_a_standard_job_below_its_sla_waits_for_approval(alice, carol, team_a, job_spec, settings):
    settings.MERIDIAN_STANDARD_SLA_FLOOR = 1.0  # any Standard job is below its floor
    n1 = make_node("n1", devices=1)
    standard = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="s", world_size=1, min_devices=1, tier="standard")
    )
    t0 = timezone.now()
    tick_run(now=t0)
    standard.refresh_from_db()
    report(n1, standard, "running")
    premium = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium")
    )

    for seconds in (0, 5, 10):
        accounting_run(now=t0 + timedelta(seconds=seconds))  # attained < ideal: it waited before starting
    tick_run(now=t0 + timedelta(seconds=10))

    standard.refresh_from_db()
    premium.refresh_from_db()
    requests = list(PreemptionRequest.objects.filter(job=standard))
    assert standard.state == S.RUNNING and premium.state == S.PENDING
    assert len(requests) == 1 and requests[0].state == PreemptionRequest.State.PENDING
    preemption_deny(request=requests[0], by=carol, note="keep it")
    tick_run(now=t0 + timedelta(seconds=15))
    standard.refresh_from_db()
    assert standard.state == S.RUNNING
    again = PreemptionRequest.objects.get(job=standard, state=PreemptionRequest.State.PENDING)
    preemption_approve(request=again, by=carol)
    tick_run(now=t0 + timedelta(seconds=20))
    standard.refresh_from_db()
    premium.refresh_from_db()
    assert standard.state == S.PREEMPTING and premium.state == S.SCHEDULED


@pytest.mark.django_db
def test_a_node_that_misses_heartbeats_is_lost_and_its_job_restarts_elsewhere(alice, team_a, job_spec):
    n1 = make_node("n1", devices=1)
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1, tier="basic"))
    t0 = timezone.now()
    tick_run(now=t0)
    job.refresh_from_db()
    report(n1, job, "running", checkpoint_step=7, now=t0)
    n2 = make_node("n2", devices=1)
    node_report_apply(node=n2, report={"jobs": []}, now=t0 + timedelta(seconds=60))

    result = tick_run(now=t0 + timedelta(seconds=61))

    job.refresh_from_db()
    assert result.lost_nodes == ["n1"]
    assert Node.objects.get(hostname="n1").state == Node.State.LOST
    assert job.state == S.MIGRATING and nodes_of(job) == {"n2"}
    assert JobEvent.objects.filter(job=job, type=JobEvent.Type.NODE_LOST).exists()
    assert JobEvent.objects.filter(job=job, type=JobEvent.Type.MIGRATED).exists()
    # Nothing to cut on the dead node: the move starts at restore, and n2 may restore at once.
    desired = node_desired_state(node=n2)["jobs"][0]
    assert desired["action"] == "run" and desired["last_checkpoint_step"] == 7
    assert desired["generation"] == job.generation == 2
    # Its own store folder: the fenced copy on n1 writes only into generation 1's
    assert desired["store"].endswith(f"/job-{job.pk}/g2")
    # the checkpoint the control plane accepted, from generation 1's folder, with its manifest's digest
    assert desired["restore_from"] == copy_checkpoint_uri(n1, job.pk, 7, generation=1)
    assert desired["restore_sha256"] == FAKE_MANIFEST_SHA256
    report(n2, job, "running", step=7, now=t0 + timedelta(seconds=62))
    job.refresh_from_db()
    assert job.state == S.RUNNING
    steps = [e.extra_data["step"] for e in JobEvent.objects.filter(job=job, type=JobEvent.Type.MOVE_STEP)]
    assert steps == ["started", "restore", "release"]


@pytest.mark.django_db
def test_an_elastic_job_shrinks_for_a_premium_job_and_grows_back(alice, team_a, job_spec):
    node = make_node("n1", devices=2)
    elastic = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="e", world_size=2, min_devices=1, tier="basic")
    )
    t0 = timezone.now()
    tick_run(now=t0)
    elastic.refresh_from_db()
    report(node, elastic, "running", devices=2, now=t0)
    premium = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium")
    )

    tick_run(now=t0 + timedelta(seconds=1))

    elastic.refresh_from_db()
    premium.refresh_from_db()
    assert elastic.state == S.RESIZING and elastic.device_count == 1
    assert premium.state == S.SCHEDULED
    report(node, elastic, "running", devices=1, now=t0 + timedelta(seconds=2))
    elastic.refresh_from_db()
    assert elastic.state == S.RUNNING
    report(node, premium, "finished", now=t0 + timedelta(seconds=601))
    tick_run(now=t0 + timedelta(seconds=602))  # past min_resize_interval_seconds (600) since the shrink
    elastic.refresh_from_db()
    assert elastic.state == S.RESIZING and elastic.device_count == 2
    report(node, elastic, "running", devices=2, now=t0 + timedelta(seconds=603))
    elastic.refresh_from_db()
    assert elastic.state == S.RUNNING and elastic.resize_count == 2


@pytest.mark.django_db
def test_only_one_caller_leads_the_tick_at_a_time():
    now = timezone.now()
    assert tick_lease_claim(now=now, holder="worker-1")
    assert not tick_lease_claim(now=now, holder="worker-2")
    assert not tick_run(now=now, holder="worker-2").ran
    tick_lease_release(holder="worker-1")
    assert tick_lease_claim(now=now, holder="worker-2")
    # an expired lease can be taken over (its holder died mid-tick)
    assert tick_lease_claim(now=now + timedelta(minutes=5), holder="worker-3")


@pytest.mark.django_db
def test_the_snapshot_hides_jobs_in_the_middle_of_a_move(alice, team_a, job_spec):
    node = make_node("n1", devices=2)
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=2, min_devices=2, tier="basic"))
    tick_run()
    job.refresh_from_db()
    report(node, job, "running")
    Job.objects.filter(pk=job.pk).update(state=S.MIGRATING)

    index = snapshot_build(now=timezone.now())

    assert len(index.snapshot.jobs) == 0
    assert not index.snapshot.accelerators.healthy.any()


@pytest.mark.django_db
def test_checkpoint_rows_beyond_the_newest_three_per_job_are_pruned(alice, team_a, job_spec):
    from jobs.models import Checkpoint
    from jobs.services import checkpoint_record
    from jobs.workflows import checkpoint_rows_prune

    first = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1))
    second = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=1, min_devices=1))
    for step in range(1, 7):
        checkpoint_record(job=first, step=step * 10, engine="framework", uri=f"file:///c/{step}", size_bytes=1)
    checkpoint_record(job=second, step=5, engine="framework", uri="file:///d/5", size_bytes=1)

    assert checkpoint_rows_prune() == 3

    assert sorted(Checkpoint.objects.filter(job=first).values_list("step", flat=True)) == [40, 50, 60]
    assert Checkpoint.objects.filter(job=second).count() == 1
    first.refresh_from_db()
    assert first.last_checkpoint_step == 60


@pytest.mark.django_db
def test_a_one_rank_job_gets_the_deployments_spread_and_still_shrinks_an_elastic_victim(alice, team_a, job_spec,
                                                                                       settings):
    import scheduler

    settings.MERIDIAN_JOB_MAX_SPREAD = "node"
    node = make_node("n1", devices=2)
    elastic = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="e", world_size=2, min_devices=1, tier="basic")
    )
    tick_run()
    elastic.refresh_from_db()
    report(node, elastic, "running", devices=2)
    premium = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium")
    )

    index = snapshot_build(now=timezone.now())
    tick_run()

    spreads = dict(zip(index.snapshot.jobs.ids.tolist(), index.snapshot.jobs.max_spread.tolist()))
    assert spreads == {elastic.pk: scheduler.SPREAD_NODE, premium.pk: scheduler.SPREAD_NODE}
    elastic.refresh_from_db()
    premium.refresh_from_db()
    assert (elastic.state, elastic.device_count, elastic.preemption_count) == (S.RESIZING, 1, 0)
    assert premium.state == S.SCHEDULED and nodes_of(premium) == {"n1"}


@pytest.mark.django_db
def test_a_shrunk_job_is_not_grown_again_before_the_minimum_resize_interval(alice, team_a, job_spec, settings):
    settings.MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS = 300.0
    node = make_node("n1", devices=2)
    elastic = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="e", world_size=2, min_devices=1, tier="basic")
    )
    t0 = timezone.now()
    tick_run(now=t0)
    elastic.refresh_from_db()
    report(node, elastic, "running", devices=2, now=t0)
    premium = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium")
    )
    tick_run(now=t0 + timedelta(seconds=10))  # the shrink: its resize Move is created at t0 + 10 s
    report(node, elastic, "running", devices=1, now=t0 + timedelta(seconds=11))
    report(node, premium, "finished", now=t0 + timedelta(seconds=12))

    index = snapshot_build(now=t0 + timedelta(seconds=20))
    tick_run(now=t0 + timedelta(seconds=20))

    elastic.refresh_from_db()
    position = index.snapshot.jobs.ids.tolist().index(elastic.pk)
    shrunk_at = (t0 + timedelta(seconds=10)).timestamp()
    assert index.snapshot.jobs.last_resize_time[position] == pytest.approx(shrunk_at, rel=0, abs=1e-3)
    assert (elastic.state, elastic.device_count) == (S.RUNNING, 1)  # a free device, but it was resized 10 s ago
    report(node, elastic, "running", devices=1, now=t0 + timedelta(seconds=300))
    tick_run(now=t0 + timedelta(seconds=311))
    elastic.refresh_from_db()
    assert (elastic.state, elastic.device_count) == (S.RESIZING, 2)


@pytest.mark.django_db
def test_the_snapshot_reads_resize_times_in_one_query_whatever_the_number_of_jobs(alice, team_a, job_spec):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from jobs.moves import move_create

    def queries_with_resized_jobs(count):
        node = make_node(f"n{count}", devices=count)
        for i in range(count):
            job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name=f"e{count}-{i}", world_size=1,
                                                                             min_devices=1, tier="basic"))
            Job.objects.filter(pk=job.pk).update(state=S.RUNNING)
            move_create(job=job, kind=Move.Kind.RESIZE, reason="test", now=timezone.now(), from_node_id=node.pk)
            Move.objects.filter(job=job).update(state=Move.State.DONE)
        with CaptureQueriesContext(connection) as captured:
            index = snapshot_build(now=timezone.now())
        assert (index.snapshot.jobs.last_resize_time > 0).sum() == len(index.snapshot.jobs)
        return len(captured)

    assert queries_with_resized_jobs(1) == queries_with_resized_jobs(3)


@pytest.mark.django_db
def test_devices_a_preempted_job_gives_up_are_free_but_releasing_until_its_step_deadline(alice, team_a, job_spec,
                                                                                        settings):
    settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS = 120.0
    node = make_node("n1", devices=2)
    rigid = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="r", world_size=2, min_devices=2, tier="basic")
    )
    t0 = timezone.now()
    tick_run(now=t0)
    rigid.refresh_from_db()
    report(node, rigid, "running", devices=2, now=t0)
    premium = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium")
    )
    tick_run(now=t0 + timedelta(seconds=1))  # rigid is preempted; premium takes one of its two devices
    rigid.refresh_from_db()
    premium.refresh_from_db()
    assert rigid.state == S.PREEMPTING and premium.state == S.SCHEDULED
    deadline = Move.objects.get(job=rigid, state=Move.State.ACTIVE).step_deadline
    later = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="b", world_size=1, min_devices=1, tier="basic")
    )

    index = snapshot_build(now=t0 + timedelta(seconds=2))
    tick_run(now=t0 + timedelta(seconds=2))

    acc = index.snapshot.accelerators
    other = [i for i in range(len(acc)) if acc.holder[i] == -1]
    assert len(other) == 1 and acc.healthy[other[0]]  # free, not hidden
    assert acc.releasing_until[other[0]] == pytest.approx(deadline.timestamp(), rel=0, abs=1e-3)
    later.refresh_from_db()
    assert later.state == S.SCHEDULED and nodes_of(later) == {"n1"}
    placed = JobEvent.objects.get(job=later, type=JobEvent.Type.PLACED)
    assert placed.extra_data["starts_at"] == deadline.isoformat()
    assert placed.extra_data["starts_in_seconds"] == pytest.approx((deadline - t0).total_seconds() - 2, abs=0.1)


@pytest.mark.django_db
def test_a_shrinking_job_keeps_its_devices_hidden_and_releases_the_dropped_ones(alice, team_a, job_spec):
    node = make_node("n1", devices=4)
    elastic = job_submit(
        team=team_a, submitted_by=alice, spec=job_spec(name="e", world_size=4, min_devices=1, tier="basic")
    )
    t0 = timezone.now()
    tick_run(now=t0)
    elastic.refresh_from_db()
    report(node, elastic, "running", devices=4, now=t0)
    job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1, tier="premium"))
    tick_run(now=t0 + timedelta(seconds=1))
    elastic.refresh_from_db()
    assert (elastic.state, elastic.device_count) == (S.RESIZING, 2)
    deadline = Move.objects.get(job=elastic, state=Move.State.ACTIVE).step_deadline

    index = snapshot_build(now=t0 + timedelta(seconds=2))

    acc = index.snapshot.accelerators
    kept = set(Replica.objects.filter(job=elastic).values_list("device_id", flat=True))
    by_pk = dict(zip(index.accelerator_ids.tolist(), range(len(acc))))
    assert len(kept) == 2 and not any(acc.healthy[by_pk[pk]] for pk in kept)
    dropped = [i for i in range(len(acc)) if acc.holder[i] == -1 and acc.healthy[i]]
    assert len(dropped) == 1  # the other dropped device went to the premium job
    assert acc.releasing_until[dropped[0]] == pytest.approx(deadline.timestamp(), rel=0, abs=1e-3)
    assert all(acc.releasing_until[by_pk[pk]] == float("-inf") for pk in kept)


@pytest.mark.django_db
def test_devices_reserved_for_premium_jobs_stay_idle_for_other_tiers(alice, team_a, job_spec, settings):
    settings.MERIDIAN_PREMIUM_RESERVE_DEVICES = 1
    make_node("n1", devices=2)
    basics = [job_submit(team=team_a, submitted_by=alice, spec=job_spec(name=f"b{i}", world_size=1, min_devices=1,
                                                                        tier="basic")) for i in range(2)]

    tick_run()

    states = sorted(Job.objects.filter(pk__in=[j.pk for j in basics]).values_list("state", flat=True))
    assert states == [S.PENDING, S.SCHEDULED]
    premium = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=1, min_devices=1,
                                                                        tier="premium"))
    tick_run()
    premium.refresh_from_db()
    assert premium.state == S.SCHEDULED  # on the reserved device, nobody preempted
    assert not Job.objects.filter(state=S.PREEMPTING).exists()


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_bad_premium_reserve_setting_names_the_variable(value, monkeypatch):
    # portal/settings.py reads it once, at start-up, with this helper
    from django.core.exceptions import ImproperlyConfigured

    from portal.settings import _env_int

    monkeypatch.setenv("MERIDIAN_PREMIUM_RESERVE_DEVICES", value)
    with pytest.raises(ImproperlyConfigured, match="MERIDIAN_PREMIUM_RESERVE_DEVICES"):
        _env_int("MERIDIAN_PREMIUM_RESERVE_DEVICES", 0, minimum=0)
