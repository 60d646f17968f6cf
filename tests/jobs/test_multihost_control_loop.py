"""The control loop for jobs that span hosts (issue 14 §4): the default spread lets topology
decide, desired state tells each host its share (ranks, devices, leader, rendezvous), the leader
speaks for the job, a preemption steps through every host of the job, and a host that held some
of a job's ranks is fenced once the job's generation moved on.

Agents are played by node_report_apply (what their heartbeat API calls), the Celery worker by
move_advance, as in tests/jobs/test_moves.py."""
import pytest
from django.utils import timezone
from node_reports import entry_of, hosts_of, make_node, report, step_names, worker

from fleet.models import Node
from fleet.services import node_drain
from jobs.models import Job, Move, Replica
from jobs.services import job_submit
from jobs.tick import tick_run
from jobs.workflows import NOT_YOURS, job_store_uri

S = Job.State


@pytest.fixture(autouse=True)
def policy(short_policy, settings):
    settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS = 60.0


def elastic_job_on_one_host(settings, alice, team_a, job_spec):
    """Returns (n1, job): an elastic W = 8 Basic job placed on n1, the only host so far (4 devices),
    resizes allowed at once; registering a second host grows it across both."""
    settings.MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS = 0.0
    n1 = make_node("n1")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="wide", world_size=8, min_devices=4,
                                                                    tier="basic"))
    tick_run()
    job.refresh_from_db()
    return n1, job


@pytest.fixture
def wide(alice, team_a, job_spec):
    """Two 4-device hosts n1, n2 and a W=8 job on 8 devices (bigger than a node), running."""
    n1, n2 = make_node("n1"), make_node("n2")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="wide", world_size=8, min_devices=8,
                                                                    tier="basic"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED, job.wait_reason  # old default spread "node": it never fits
    assert hosts_of(job) == ["n1", "n2"]
    return job, n1, n2


@pytest.mark.django_db
def test_a_job_bigger_than_a_node_spans_hosts_and_each_host_is_told_its_share(wide, alice, team_a, job_spec):
    job, n1, n2 = wide
    first, second = entry_of(n1, job.pk), entry_of(n2, job.pk)
    rendezvous = f"{job_store_uri(job.pk, generation=job.generation)}/rendezvous"
    assert first["action"] == second["action"] == "run"
    assert (first["devices"], second["devices"]) == (4, 4)
    assert first["span"] == {"nodes": 2, "node_rank": 0, "first_rank": 0, "ranks": 4, "job_devices": 8,
                             "leader": "n1", "rendezvous": rendezvous}
    assert second["span"] == {**first["span"], "node_rank": 1, "first_rank": 4}
    # A job that fits one node is packed onto one (topology decides) and its entry has no span.
    make_node("n3")
    small = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="small", world_size=4, min_devices=4))
    tick_run()
    small.refresh_from_db()
    assert hosts_of(small) == ["n3"]
    assert entry_of(Node.objects.get(hostname="n3"), small.pk).get("span") is None


@pytest.mark.django_db
def test_hosts_holding_unequal_device_counts_are_told_blocks_in_proportion_that_their_agents_accept(
        alice, team_a, job_spec):
    # W = 12 on 6 devices (2 ranks each) over a 4-device and a 2-device host: blocks of 8 and 4 ranks.
    # Before session 24 the core placed only equal shares and this job waited.
    from agent.node import multihost_span_problem
    from protocol.node import DesiredJob
    n1, n2 = make_node("n1", devices=4), make_node("n2", devices=2)
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="lopsided", world_size=12, min_devices=6,
                                                                    tier="basic"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED, job.wait_reason
    first, second = entry_of(n1, job.pk), entry_of(n2, job.pk)
    assert (first["devices"], second["devices"]) == (4, 2)
    assert (first["span"]["first_rank"], first["span"]["ranks"]) == (0, 8)
    assert (second["span"]["first_rank"], second["span"]["ranks"], second["span"]["job_devices"]) == (8, 4, 6)
    assert [multihost_span_problem(DesiredJob.from_dict(entry)) for entry in (first, second)] == [None, None]


@pytest.mark.django_db
def test_the_leader_speaks_for_a_job_that_spans_hosts(wide):
    job, n1, n2 = wide
    assert report(n2, job.pk, "running", generation=1, step=0)["accepted"] == [job.pk]
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and job.progress_step == 0  # a follower's report moves nothing
    report(n1, job.pk, "running", generation=1, step=12)
    report(n2, job.pk, "running", generation=1, step=0)
    job.refresh_from_db()
    assert job.state == S.RUNNING and job.progress_step == 12  # the follower's own step 0 is not the job's
    report(n2, job.pk, "failed", generation=1, error="the job failed on another host")
    job.refresh_from_db()
    assert job.state == S.RUNNING  # the leader's report decides
    report(n1, job.pk, "finished", generation=1, step=20)
    job.refresh_from_db()
    assert job.state == S.SUCCEEDED


@pytest.mark.django_db
def test_a_leaders_failure_waits_while_another_host_of_the_job_is_silent(wide):
    job, n1, n2 = wide
    report(n1, job.pk, "running", generation=1, step=5)
    Node.objects.filter(pk=n2.pk).update(last_heartbeat=timezone.now() - timezone.timedelta(seconds=25))
    answer = report(n1, job.pk, "failed", generation=1, error="node 1 lost")
    assert answer["deferred"] == [job.pk]
    job.refresh_from_db()
    assert job.state == S.RUNNING  # the lost-node sweep restarts it from its last checkpoint instead


@pytest.mark.django_db
def test_a_host_that_failed_under_the_job_requeues_it_from_its_checkpoint_a_few_times_then_fails_it(wide):
    # The chaos soak: a follower's agent froze, its launcher fenced itself, and the leader's failure
    # ("the job failed on another host (node 1: ... fenced)") failed the job, though its follower's
    # node was answering again by then. A host failing under the job restarts it from its checkpoint.
    job, n1, n2 = wide
    report(n1, job.pk, "running", generation=1, step=5, checkpoint_step=4)
    answer = report(n1, job.pk, "failed", generation=1, host_failure=True,
                    error="the job failed on another host (node 1: no heartbeat answered for 10 s: fenced)")
    assert answer["accepted"] == [job.pk], answer
    job.refresh_from_db()
    assert job.state == S.PREEMPTED and job.generation == 2 and job.last_checkpoint_step == 4
    assert "a host of the job failed under it" in job.events.order_by("-id").first().reason
    # What is left of the old copy on either host is fenced.
    assert report(n2, job.pk, "running", generation=1)["rejected"][0]["fence"] is True
    # Placed and failing the same way from the same checkpoint, again and again: it fails for good.
    for attempt in range(2, 5):
        before = job.generation
        tick_run()
        job.refresh_from_db()
        assert job.state == S.SCHEDULED and job.generation > before, (attempt, job.state, job.wait_reason)
        leader = Node.objects.get(pk=Replica.objects.filter(job=job, rank=0).values_list("device__node_id",
                                                                                         flat=True)[0])
        report(leader, job.pk, "failed", generation=job.generation, host_failure=True, error="node 1 fenced")
        job.refresh_from_db()
        if attempt < 4:
            assert job.state == S.PREEMPTED, (attempt, job.state)
    assert job.state == S.FAILED and "restarted 3 times from checkpoint step 4" in job.failure_reason


@pytest.mark.django_db
def test_a_host_that_fails_under_the_job_while_it_is_resized_across_hosts_requeues_it(settings, alice, team_a,
                                                                                    job_spec):
    """The 30-minute chaos soak (session 24, job 101): a job grown onto two hosts was still resizing
    when a host failed under its new copy (a follower's part refused as a second join); the leader's
    failure, though it said a host failed, failed the job for good: the restart from the checkpoint
    applied only while the job was scheduled or running. It is a restart in a resize too, and the
    resize move ends there."""
    n1, job = elastic_job_on_one_host(settings, alice, team_a, job_spec)
    report(n1, job.pk, "running", generation=job.generation, step=5)
    n2 = make_node("n2")
    tick_run()
    job.refresh_from_db()
    assert job.state == S.RESIZING and hosts_of(job) == ["n1", "n2"], job.wait_reason
    grow = Move.objects.get(job=job, state=Move.State.ACTIVE)
    report(n1, job.pk, "stopped", generation=grow.from_generation, step=12, cut={"action": "stop", "step": 12},
           checkpoint_step=12)
    worker()
    grow.refresh_from_db()
    assert grow.step == Move.Step.RESTORE
    leader = n1 if entry_of(n1, job.pk)["span"]["node_rank"] == 0 else n2
    answer = report(leader, job.pk, "failed", generation=grow.to_generation, host_failure=True, error=(
        "the job failed on another host (node 1: node 1's part of this run already joined its leader once)"))
    assert answer["accepted"] == [job.pk], answer
    job.refresh_from_db()
    grow.refresh_from_db()
    assert job.state == S.PREEMPTED and job.generation == grow.to_generation + 1, (job.state, job.failure_reason)
    assert job.last_checkpoint_step == 12
    assert grow.state == Move.State.FAILED
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED


@pytest.mark.django_db
def test_each_host_gets_one_block_of_ranks_when_its_devices_ids_interleave_with_anothers(alice, team_a, job_spec):
    """A host whose devices were registered after another host's (accelerator ids 1, 2, 5, 6 on n1;
    3, 4 on n2): ranks laid out over the ids in order would give n1 ranks 0-1 and 4-5, two blocks,
    which no launcher runs (runtime/multihost.py host_block). Each host's devices go together."""
    from fleet.models import Accelerator
    n1, n2 = make_node("n1", devices=2), make_node("n2", devices=2)
    for index in (2, 3):
        Accelerator.objects.create(node=n1, index=index, type="CPU")
    assert sorted(Accelerator.objects.filter(node=n1).values_list("id", flat=True))[2] > max(
        Accelerator.objects.filter(node=n2).values_list("id", flat=True))
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="six", world_size=6, min_devices=6,
                                                                    tier="basic"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and hosts_of(job) == ["n1", "n2"], job.wait_reason
    spans = {node.hostname: entry_of(node, job.pk)["span"] for node in (n1, n2)}
    blocks = sorted((span["first_rank"], span["ranks"], host) for host, span in spans.items())
    assert blocks == [(0, 4, "n1"), (4, 2, "n2")], blocks


@pytest.mark.django_db
def test_a_failure_of_the_jobs_code_on_another_host_fails_it(wide):
    job, n1, n2 = wide
    report(n1, job.pk, "running", generation=1, step=5)
    report(n1, job.pk, "failed", generation=1, error="the job failed on another host (node 1: rank 5 exited 1)")
    job.refresh_from_db()
    assert job.state == S.FAILED


@pytest.mark.django_db
def test_a_preemption_steps_through_every_host_and_fences_a_host_left_behind(wide, alice, team_a, job_spec):
    job, n1, n2 = wide
    report(n1, job.pk, "running", generation=1, step=5)
    premium = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=8, min_devices=8,
                                                                        tier="premium"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.PREEMPTING
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert move.from_node == n1 and move.observed["from_nodes"] == [n2.pk]
    assert entry_of(n1, job.pk)["action"] == "stop"  # the leader cuts every host's ranks
    assert entry_of(n2, job.pk) is None  # not listed: the follower's share ends with the leader's cut

    # The follower's report on its old copy is the move's (accepted), not a stranger's (fenced).
    assert report(n2, job.pk, "running", generation=1, step=0)["accepted"] == [job.pk]
    stopped = dict(generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    report(n1, job.pk, "stopped", **stopped)
    worker()
    move.refresh_from_db()
    assert move.step == Move.Step.RELEASE  # the follower's share still runs: its devices are not free
    job.refresh_from_db()
    assert job.state == S.PREEMPTING
    report(n2, job.pk, "stopped", generation=1, step=30)
    worker()
    job.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.DONE and job.state == S.PREEMPTED and job.last_checkpoint_step == 30
    assert entry_of(n1, premium.pk)["span"]["node_rank"] == 0

    # Resumed on two other hosts as generation 3: a report of generation 1 from n2 is fenced.
    Node.objects.filter(pk__in=[n1.pk, n2.pk]).update(state=Node.State.DRAINING)
    make_node("n3"), make_node("n4")
    Job.objects.filter(pk=premium.pk).update(state=S.CANCELLED)
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and hosts_of(job) == ["n3", "n4"]
    new = entry_of(Node.objects.get(hostname="n3"), job.pk)
    assert new["restore_from"].endswith("ckpt-000000000030-1") and new["span"]["leader"] == "n3"
    late = report(n2, job.pk, "running", generation=1, step=31)
    assert late["rejected"] == [{"job_id": job.pk, "fence": True, "cancel": False,
                                 "error": NOT_YOURS.format(job_id=job.pk)}]


@pytest.mark.django_db
def test_the_job_page_shows_the_placement_per_host(wide, alice):
    from django.test import Client
    from django.urls import reverse

    job, _n1, _n2 = wide
    client = Client()
    client.force_login(alice)
    page = client.get(reverse("pages:job-detail", args=[job.pk]))
    assert page.status_code == 200
    shares = [{k: row[k] for k in ("host", "first_rank", "last_rank", "devices")}
              for row in page.context["data"]["job"]["placement"]]
    assert shares == [{"host": "n1", "first_rank": 0, "last_rank": 3, "devices": 4},
                      {"host": "n2", "first_rank": 4, "last_rank": 7, "devices": 4}]
    html = page.content.decode()
    assert "n1: ranks 0–3 on 4 devices" in html and "n2: ranks 4–7 on 4 devices" in html


@pytest.mark.django_db
def test_a_job_spanning_two_hosts_is_shrunk_to_one_and_grown_back_by_cut_checkpoint_and_relaunch(
        settings, alice, team_a, job_spec):
    """Issue 14 §3: an elastic W = 8 job on 2 hosts x 4 devices is shrunk onto one host for a
    premium job, then grown back onto two once it is gone. Each resize is one move: the leader's
    cut stops every host's ranks at one step with one checkpoint, and the W ranks are relaunched,
    spliced onto the new hosts' devices, as a new generation. Before, the agent was sent no resize
    for a job spanning hosts and the move timed out (the job restarted from an older checkpoint)."""
    settings.MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS = 0.0
    n1, n2 = make_node("n1"), make_node("n2")
    nodes = {"n1": n1, "n2": n2}
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="wide", world_size=8, min_devices=4,
                                                                    tier="basic"))
    tick_run()
    job.refresh_from_db()
    assert hosts_of(job) == ["n1", "n2"] and job.generation == 1
    report(n1, job.pk, "running", generation=1, step=5, devices=8)

    # --- shrink: a premium job takes one host's devices
    premium = job_submit(team=team_a, submitted_by=alice, spec=job_spec(name="p", world_size=4, min_devices=4,
                                                                        tier="premium"))
    tick_run()
    job.refresh_from_db()
    assert job.state == S.RESIZING and job.generation == 2 and job.device_count == 4
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    (kept,) = hosts_of(job)
    left = "n2" if kept == "n1" else "n1"
    assert (move.kind, move.from_generation, move.to_generation, move.from_devices, move.to_devices) == (
        "resize", 1, 2, 8, 4)
    assert move.from_node == n1 and move.to_node == nodes[kept]
    assert move.observed["from_nodes"] == [n2.pk]
    staying = entry_of(nodes[kept], job.pk)
    # the new copy waits for the checkpoint: W = 8 on this host's 4 devices, one host, no span
    assert (staying["action"], staying["generation"], staying["devices"], staying.get("span")) == ("wait", 2, 4, None)
    leaving = entry_of(nodes[left], job.pk)
    # the leader (n1) is told to stop, with the old generation (if it leaves) or by the newer one it
    # must run (if it stays); the follower is not listed, or listed with the newer generation
    assert leaving is None or (leaving["action"], leaving["generation"]) == ("stop", 1)

    stopped = dict(generation=1, step=30, devices=8, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    assert report(n1, job.pk, "stopped", **stopped)["accepted"] == [job.pk]
    worker()
    move.refresh_from_db()
    assert move.step == Move.Step.RESTORE and move.cut_step == 30
    staying = entry_of(nodes[kept], job.pk)
    assert staying["action"] == "run" and staying["restore_from"].endswith("ckpt-000000000030-1")
    assert report(n2, job.pk, "stopped", generation=1, step=30)["accepted"] == [job.pk]  # the follower's share
    report(nodes[kept], job.pk, "running", generation=2, step=31, devices=4)
    worker()
    job.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.DONE and job.state == S.RUNNING and job.device_count == 4
    assert step_names(job, move) == ["started", "barrier", "checkpoint", "store", "restore", "release"]
    # the old generation's copy is fenced from now on, on either host
    assert report(nodes[left], job.pk, "running", generation=1)["rejected"][0]["fence"] is True

    # --- grow back: the premium job ends, its devices would idle
    premium.refresh_from_db()
    (premium_host,) = hosts_of(premium)
    assert premium_host == left
    report(nodes[left], premium.pk, "running", generation=premium.generation, step=3)
    report(nodes[left], premium.pk, "finished", generation=premium.generation, step=9)
    tick_run()
    job.refresh_from_db()
    assert job.state == S.RESIZING and job.generation == 3 and hosts_of(job) == ["n1", "n2"]
    grow = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert (grow.from_generation, grow.to_generation, grow.from_devices, grow.to_devices) == (2, 3, 4, 8)
    assert grow.from_node == nodes[kept]
    shares = {name: entry_of(node, job.pk) for name, node in nodes.items()}
    assert {s["action"] for s in shares.values()} == {"wait"}
    assert sorted((s["span"]["node_rank"], s["span"]["first_rank"], s["devices"]) for s in shares.values()) == [
        (0, 0, 4), (1, 4, 4)]
    report(nodes[kept], job.pk, "stopped", generation=2, step=44, devices=4, cut={"action": "stop", "step": 44},
           checkpoint_step=44)
    worker()
    leader = shares["n1"]["span"]["leader"]
    report(nodes[leader], job.pk, "running", generation=3, step=45, devices=8)
    worker()
    job.refresh_from_db()
    grow.refresh_from_db()
    assert grow.state == Move.State.DONE and job.state == S.RUNNING and job.device_count == 8
    assert job.last_checkpoint_step == 44


@pytest.mark.django_db
def test_a_scheduled_job_grown_onto_a_second_host_is_a_new_generation_and_placement(settings, alice, team_a,
                                                                                   job_spec):
    """Seen on emulated hosts: an elastic W = 8 job placed on the one host registered so far, then
    grown onto a second before it reported running, kept its generation. Its first host's agent had
    launched it on one host already, and that copy ran on alone while the second host's share waited
    for a leader that never came (and no event named the new hosts)."""
    from jobs.models import JobEvent
    n1, job = elastic_job_on_one_host(settings, alice, team_a, job_spec)
    assert job.state == S.SCHEDULED and hosts_of(job) == ["n1"]
    first = job.generation
    assert entry_of(n1, job.pk)["generation"] == first and entry_of(n1, job.pk).get("span") is None
    n2 = make_node("n2")
    tick_run()
    job.refresh_from_db()
    assert job.state == S.SCHEDULED and hosts_of(job) == ["n1", "n2"] and job.device_count == 8
    assert job.generation == first + 1  # the copy n1 may have launched on its own is fenced
    assert {entry_of(n1, job.pk)["span"]["node_rank"], entry_of(n2, job.pk)["span"]["node_rank"]} == {0, 1}
    placed = JobEvent.objects.filter(job=job, type=JobEvent.Type.PLACED).order_by("-id").first()
    assert sorted(placed.extra_data["nodes"]) == ["n1", "n2"]
    # the copy of the first layout is a stale one now
    assert report(n1, job.pk, "running", generation=first, step=2)["rejected"][0]["fence"] is True


def migrated_event(job):
    from jobs.models import JobEvent
    return JobEvent.objects.filter(job=job, type=JobEvent.Type.MIGRATED).order_by("-id").first()


@pytest.mark.django_db
def test_draining_one_host_of_a_job_that_spans_hosts_moves_only_that_hosts_share(wide, admin_user):
    """Issue 14 §3, partial migration: n2 drains; the job keeps n1's devices and gets n3's in
    place of n2's (before: the whole job moved, to n3 + n4). The staying host n1 is both source and
    destination of the move: it is told the new generation (so its agent cuts and stops the old
    copy first), its report on the old copy is the move's, the new copy runs on the same devices,
    and the old generation is fenced on every host afterwards. Every rank is relaunched from the
    cut, n1's too (no in-place re-splice across hosts)."""
    from fleet.models import Accelerator
    job, n1, n2 = wide
    n3, n4 = make_node("n3"), make_node("n4")
    n1_devices = sorted(Accelerator.objects.filter(node=n1).values_list("pk", flat=True))
    n2_devices = sorted(Accelerator.objects.filter(node=n2).values_list("pk", flat=True))
    report(n1, job.pk, "running", generation=1, step=5)
    node_drain(node=n2, by=admin_user, reason="replace a DIMM")  # what the API and `meridian drain` call
    tick_run()
    job.refresh_from_db()
    assert job.state == S.MIGRATING and hosts_of(job) == ["n1", "n3"] and job.generation == 2
    on_n1 = Replica.objects.filter(job=job, device__node=n1).order_by("rank").values_list("rank", "device_id")
    assert list(on_n1) == list(zip(range(4), n1_devices))  # n1 keeps its 4 devices, ranks 0-3 on them
    placed = migrated_event(job).extra_data
    assert placed["partial"] is True and placed["kept_nodes"] == ["n1"] and placed["kept_devices"] == 4
    moving = job.events.filter(to_state=S.MIGRATING).get()
    assert moving.extra_data["released_devices"] == n2_devices  # only the draining host's
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert (move.kind, move.from_generation, move.to_generation) == ("migration", 1, 2)
    assert move.from_node == n1 and move.to_node == n1 and move.observed["from_nodes"] == [n2.pk]
    assert "partial: keeps its devices on n1" in move.reason
    staying, joining = entry_of(n1, job.pk), entry_of(n3, job.pk)
    assert (staying["action"], staying["generation"], staying["span"]["node_rank"]) == ("wait", 2, 0)
    assert (joining["action"], joining["generation"], joining["span"]["node_rank"]) == ("wait", 2, 1)
    assert entry_of(n2, job.pk) is None and entry_of(n4, job.pk) is None

    # The staying host's old copy (generation 1) still reports: the move's, not fenced.
    assert report(n1, job.pk, "running", generation=1, step=29)["accepted"] == [job.pk]
    report(n1, job.pk, "stopped", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    worker()
    move.refresh_from_db()
    assert move.step == Move.Step.RESTORE and move.cut_step == 30
    staying = entry_of(n1, job.pk)
    assert staying["action"] == "run" and staying["restore_from"].endswith("ckpt-000000000030-1")
    assert report(n2, job.pk, "stopped", generation=1, step=30)["accepted"] == [job.pk]
    report(n1, job.pk, "running", generation=2, step=31, devices=8)
    worker()
    job.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.DONE and job.state == S.RUNNING and job.last_checkpoint_step == 30
    assert step_names(job, move) == ["started", "barrier", "checkpoint", "store", "restore", "release"]
    # the old generation is fenced on the host it stayed on, and on the one it left
    stale = report(n1, job.pk, "running", generation=1, step=32)["rejected"]
    assert stale[0]["fence"] is True and "generation 1" in stale[0]["error"]
    assert report(n2, job.pk, "running", generation=1, step=32)["rejected"][0]["fence"] is True
    # The devices are counted once: the next tick sees the job on n1 + n3 and moves nothing.
    tick_run()
    job.refresh_from_db()
    assert job.state == S.RUNNING and job.generation == 2 and hosts_of(job) == ["n1", "n3"]


@pytest.mark.django_db
def test_draining_the_leaders_host_keeps_the_followers_and_it_leads_the_new_generation(wide, admin_user):
    """The other way round: the leader's host n1 drains. n2 (a follower of generation 1) stays and
    leads generation 2 with n3; the old leader is told to stop (its cut ends n2's share too), n2's
    reports on its old share are the move's, and the move is released once both hosts' shares of
    generation 1 have exited."""
    job, n1, n2 = wide
    make_node("n3")
    report(n1, job.pk, "running", generation=1, step=5)
    node_drain(node=n1, by=admin_user, reason="kernel update")
    tick_run()
    job.refresh_from_db()
    assert job.state == S.MIGRATING and hosts_of(job) == ["n2", "n3"]
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert move.from_node == n1 and move.to_node == n2 and move.observed["from_nodes"] == [n2.pk]
    assert entry_of(n1, job.pk)["action"] == "stop" and entry_of(n1, job.pk)["generation"] == 1
    staying = entry_of(n2, job.pk)
    assert (staying["action"], staying["generation"], staying["span"]["leader"]) == ("wait", 2, "n2")
    report(n1, job.pk, "stopped", generation=1, step=30, cut={"action": "stop", "step": 30}, checkpoint_step=30)
    worker()
    assert report(n2, job.pk, "running", generation=1, step=30)["accepted"] == [job.pk]  # its old share, the move's
    move.refresh_from_db()
    assert move.step == Move.Step.RESTORE
    # its agent reports the old share's end before it launches generation 2 on the same devices
    assert report(n2, job.pk, "stopped", generation=1, step=30)["accepted"] == [job.pk]
    report(n2, job.pk, "running", generation=2, step=31, devices=8)
    worker()
    job.refresh_from_db()
    move.refresh_from_db()
    assert move.state == Move.State.DONE and job.state == S.RUNNING


@pytest.mark.django_db
def test_a_lost_host_of_a_job_that_spans_hosts_is_replaced_and_the_staying_hosts_copy_fenced(wide):
    """The lost-node form: n2 is lost, the job restarts from its last checkpoint on n1 (kept) and
    n3. The old copy on n1 is not part of the move (nothing to cut with a host gone): its reports
    are fenced, so its agent kills it and launches the new generation on the same devices."""
    job, n1, n2 = wide
    make_node("n3")
    report(n1, job.pk, "running", generation=1, step=12, checkpoint_step=12)
    Node.objects.filter(pk=n2.pk).update(state=Node.State.LOST)
    tick_run()
    job.refresh_from_db()
    assert job.state == S.MIGRATING and hosts_of(job) == ["n1", "n3"] and job.generation == 2
    move = Move.objects.get(job=job, state=Move.State.ACTIVE)
    assert move.step == Move.Step.RESTORE and move.cut_step == 12 and move.from_node is None
    assert migrated_event(job).extra_data["kept_nodes"] == ["n1"]
    assert entry_of(n1, job.pk)["action"] == "run" and entry_of(n1, job.pk)["generation"] == 2
    stale = report(n1, job.pk, "running", generation=1, step=14)["rejected"]
    assert stale[0]["fence"] is True
    report(n1, job.pk, "running", generation=2, step=13, devices=8)
    worker()
    job.refresh_from_db()
    assert job.state == S.RUNNING and job.last_checkpoint_step == 12
