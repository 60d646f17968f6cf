"""The log APIs: agents ship rank output (fenced like reports), members read it with a cursor."""
import pytest
from django.utils import timezone
from log_nodes import enrollment, register  # noqa: F401 (enrollment: an autouse fixture)
from rest_framework.test import APIClient

from jobs.logs import log_chunks_prune, log_failing_rank, log_grant, log_tail_text
from jobs.models import Job, LogChunk, Move
from jobs.moves import move_create
from jobs.services import job_generation_bump, job_submit, job_transition
from jobs.tick import tick_run


def as_node(token):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Node {token}")
    return client


def chunk(job, *, rank=0, offset=0, text="hello\n", generation=None, attempt=1, dropped=0):
    return {"job_id": job.pk, "generation": job.generation if generation is None else generation,
            "attempt": attempt, "rank": rank, "offset": offset, "length": len(text.encode()), "text": text,
            "dropped": dropped}


def grant_of(node, job):
    """The copy's log grant, as the node's desired state names it (what its agent ships with)."""
    desired = as_node(node["token"]).get("/api/agent/desired/").json()
    return next(entry["log_grant"] for entry in desired["jobs"] if entry["job_id"] == job.pk)


def post(node, *chunks):
    return as_node(node["token"]).post("/api/agent/logs/", {"chunks": list(chunks)}, format="json")


@pytest.fixture
def placed(alice, team_a, job_spec):
    """A 2-rank job placed by the tick on one of two nodes: (job, owner, intruder)."""
    first, second = register("n1"), register("n2")
    job = job_submit(team=team_a, submitted_by=alice, spec=job_spec(world_size=2, min_devices=2, tier="basic"))
    tick_run()
    job.refresh_from_db()
    node_id = job.replicas.first().device.node_id
    owner, intruder = (first, second) if node_id == first["node_id"] else (second, first)
    return job, owner, intruder


@pytest.mark.django_db
def test_the_node_running_a_job_ships_its_output_and_a_member_reads_it_with_a_cursor(placed, alice, api_client_for):
    job, owner, _ = placed
    answer = post(owner, chunk(job, text="step 1\n"), chunk(job, rank=1, text="rank one\n"),
                  chunk(job, offset=7, text="step 2\n"))
    assert answer.status_code == 200, answer.content
    assert answer.json()["stored"] == 3 and answer.json()["rejected"] == []

    client = api_client_for(alice)
    body = client.get(f"/api/jobs/{job.pk}/logs/?rank=0").json()
    assert [c["text"] for c in body["chunks"]] == ["step 1\n", "step 2\n"]
    assert {c["rank"] for c in body["chunks"]} == {0}
    post(owner, chunk(job, offset=14, text="step 3\n"))
    more = client.get(f"/api/jobs/{job.pk}/logs/?rank=0&after={body['next']}").json()
    assert [c["text"] for c in more["chunks"]] == ["step 3\n"]
    assert client.get(f"/api/jobs/{job.pk}/logs/?rank=1").json()["chunks"][0]["text"] == "rank one\n"


@pytest.mark.django_db
def test_a_chunk_sent_twice_is_stored_once(placed):
    job, owner, _ = placed
    post(owner, chunk(job, text="once\n"))
    again = post(owner, chunk(job, text="once\n")).json()
    assert again["stored"] == 0 and again["duplicates"] == 1
    assert LogChunk.objects.filter(job=job, kind="output").count() == 1


@pytest.mark.django_db
def test_a_batch_sent_again_and_cut_longer_stores_only_the_bytes_not_stored_yet(placed, alice, api_client_for):
    # The web server killed after it committed a batch: the agent, without the answer, reads again
    # from the same offset with more output there; the longer chunk was taken for a duplicate.
    job, owner, _ = placed
    assert post(owner, chunk(job, text="step 1\n")).json()["stored"] == 1
    again = post(owner, chunk(job, text="step 1\nstep 2\né 3\n")).json()
    assert (again["stored"], again["duplicates"]) == (1, 0)
    assert post(owner, chunk(job, text="step 1\nstep 2\n"), chunk(job, offset=14, text="é 3\n")).json()[
        "duplicates"] == 2
    body = api_client_for(alice).get(f"/api/jobs/{job.pk}/logs/?rank=0").json()
    assert "".join(c["text"] for c in body["chunks"]) == "step 1\nstep 2\né 3\n"


@pytest.mark.django_db
def test_another_node_cannot_post_logs_for_a_job_it_does_not_hold(placed):
    job, owner, intruder = placed
    answer = post(intruder, chunk(job, text="forged\n")).json()
    assert answer["stored"] == 0 and answer["rejected"][0]["fence"] is True
    assert "not placed on your node" in answer["rejected"][0]["error"]
    assert not LogChunk.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_a_stale_generation_is_refused_with_fence(placed):
    job, owner, _ = placed
    answer = post(owner, chunk(job, generation=job.generation - 1)).json()
    assert answer["rejected"][0]["fence"] is True and "stale copy" in answer["rejected"][0]["error"]


@pytest.mark.django_db
def test_the_tail_of_a_copy_that_stopped_is_taken_after_its_devices_were_released(placed):
    job, owner, intruder = placed
    grant = grant_of(owner, job)
    post(owner, chunk(job, text="training\n") | {"grant": grant})
    job = job_transition(job=job, to=Job.State.CANCELLED, reason="by a test")  # releases the devices
    assert post(owner, chunk(job, offset=9, text="last words\n") | {"grant": grant}).json()["stored"] == 1
    forged = chunk(job, offset=20, text="forged\n") | {"grant": grant}  # another node's grant is not its own
    assert post(intruder, forged).json()["rejected"][0]["fence"] is True


@pytest.mark.django_db
def test_a_rank_out_of_range_is_refused_naming_it(placed):
    job, owner, _ = placed
    answer = post(owner, chunk(job, rank=5)).json()
    assert "rank 5 is out of range" in answer["rejected"][0]["error"]


@pytest.mark.django_db
@pytest.mark.parametrize("body, field", [
    ({"chunks": [{"job_id": 1, "generation": 1, "attempt": 1, "rank": 0, "offset": 0, "length": 1,
                  "text": "x" * 16385}]}, "chunks.0.text"),
    ({"chunks": [{"job_id": 1, "generation": 1, "attempt": 0, "rank": 0, "offset": 0, "length": 1,
                  "text": "x"}]}, "chunks.0.attempt"),
    ({"chunks": [{"job_id": 1, "generation": 1, "attempt": 1, "rank": 0, "offset": -1, "length": 1,
                  "text": "x"}]}, "chunks.0.offset"),
    ({"chunks": [{"job_id": 1, "generation": 1, "attempt": 1, "rank": 0, "offset": 0, "length": 1, "text": "x"}] * 65},
     "chunks"),
], ids=["text too long", "attempt 0", "negative offset", "too many chunks"])
def test_a_malformed_batch_is_a_400_naming_the_field(placed, body, field):
    _, owner, _ = placed
    response = as_node(owner["token"]).post("/api/agent/logs/", body, format="json")
    assert response.status_code == 400 and field in response.json(), response.content


@pytest.mark.django_db
def test_logs_without_a_node_token_are_a_401():
    assert APIClient().post("/api/agent/logs/", {"chunks": []}, format="json").status_code in (401, 403)
    assert as_node("nope").post("/api/agent/logs/", {"chunks": []}, format="json").status_code == 401


@pytest.mark.django_db
def test_another_team_cannot_read_the_log_and_bad_parameters_are_400s(placed, charlie, alice, api_client_for):
    job, owner, _ = placed
    post(owner, chunk(job, text="secret\n"))
    assert api_client_for(charlie).get(f"/api/jobs/{job.pk}/logs/").status_code == 404
    client = api_client_for(alice)
    for query, field in [("rank=2", "rank"), ("rank=x", "rank"), ("after=-1", "after"), ("limit=0", "limit"),
                         ("limit=5000", "limit"), ("tail=maybe", "tail")]:
        response = client.get(f"/api/jobs/{job.pk}/logs/?{query}")
        assert response.status_code == 400 and field in response.json(), (query, response.content)


@pytest.mark.django_db
def test_a_preemption_and_the_resume_leave_markers_in_the_log_every_rank_sees(placed, alice, api_client_for):
    job, owner, _ = placed
    post(owner, chunk(job, text="before\n"))
    job = job_transition(job=job, to=Job.State.RUNNING)
    job = job_transition(job=job, to=Job.State.PREEMPTING, reason="a premium job needs the devices")
    job = job_transition(job=job, to=Job.State.PREEMPTED)
    client = api_client_for(alice)
    for rank in (0, 1):
        texts = [c["text"] for c in client.get(f"/api/jobs/{job.pk}/logs/?rank={rank}").json()["chunks"]]
        assert any("preempting" in t and "premium job" in t for t in texts), texts
        assert any("preempted" in t for t in texts)
    kinds = [c["kind"] for c in client.get(f"/api/jobs/{job.pk}/logs/?rank=0").json()["chunks"]]
    assert kinds == ["output", "marker", "marker"]


@pytest.mark.django_db
def test_dropped_output_is_reported_in_the_log(placed, alice, api_client_for):
    job, owner, _ = placed
    post(owner, chunk(job, offset=5000, text="after the gap\n", dropped=4321))
    chunks = api_client_for(alice).get(f"/api/jobs/{job.pk}/logs/?rank=0").json()["chunks"]
    assert chunks[0]["kind"] == "dropped" and "4321 bytes" in chunks[0]["text"]
    assert chunks[1]["text"] == "after the gap\n"


@pytest.mark.django_db
def test_retention_prunes_old_chunks_and_caps_a_job(placed, settings):
    from datetime import timedelta

    from django.utils import timezone

    job, owner, _ = placed
    settings.MERIDIAN_LOG_MAX_CHUNKS_PER_JOB = 3
    post(owner, *[chunk(job, offset=i * 10, text=f"line {i}\n") for i in range(5)])
    assert [c.text for c in LogChunk.objects.filter(job=job)] == ["line 2\n", "line 3\n", "line 4\n"]
    LogChunk.objects.filter(job=job).update(created_at=timezone.now() - timedelta(days=31))
    settings.MERIDIAN_LOG_RETENTION_DAYS = 30
    assert log_chunks_prune(force=True) == 3 and not LogChunk.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_a_failed_job_names_its_failing_rank_and_the_tail_of_its_log(placed):
    job, owner, _ = placed
    post(owner, chunk(job, rank=1, text="Traceback\nValueError: boom\n"), chunk(job, rank=0, text="fine\n"))
    Job.objects.filter(pk=job.pk).update(failure_reason="rank 1 exited with code 1; the job fails.")
    job.refresh_from_db()
    assert log_failing_rank(job=job) == 1
    assert "ValueError: boom" in log_tail_text(job=job, rank=1)


@pytest.mark.django_db
def test_an_empty_chunk_is_taken_and_stores_nothing(placed):
    """What agents before the log grant sent first for every copy (an announcement)."""
    job, owner, _ = placed
    answer = post(owner, chunk(job, text="") | {"length": 0}).json()
    assert (answer["stored"], answer["rejected"]) == (1, []) and not LogChunk.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_a_copy_never_heard_while_placed_ships_its_output_after_the_job_ended_with_its_grant(placed):
    """The node's agent was frozen (or cut off) for the copy's whole life: nothing of it reached
    the control plane while the job was placed there. The grant its desired state carried lets
    its output in after the job ended; another node's grant, or none, does not."""
    job, owner, intruder = placed
    grant = grant_of(owner, job)
    intruders_grant = log_grant(job_id=job.pk, generation=job.generation, node_id=intruder["node_id"])
    job = job_transition(job=job, to=Job.State.RUNNING)
    job = job_transition(job=job, to=Job.State.SUCCEEDED, reason="finished")  # releases the devices
    late = chunk(job, text="rank 0 done after 10 epochs\n")
    assert post(owner, late).json()["rejected"][0]["fence"] is True  # without the grant
    assert post(owner, late | {"grant": intruders_grant}).json()["rejected"][0]["fence"] is True
    assert post(intruder, late | {"grant": grant}).json()["rejected"][0]["fence"] is True
    taken = post(owner, late | {"grant": grant}).json()
    assert (taken["stored"], taken["rejected"]) == (1, [])
    stale = chunk(job, generation=job.generation - 1, text="old\n") | {
        "grant": log_grant(job_id=job.pk, generation=job.generation - 1, node_id=owner["node_id"])}
    assert "stale copy" in post(owner, stale).json()["rejected"][0]["error"]  # a grant is for its copy only
    assert [c.text for c in LogChunk.objects.filter(job=job)] == ["rank 0 done after 10 epochs\n"]


@pytest.mark.django_db
def test_a_follower_hosts_tail_of_a_copy_a_move_took_off_it_is_taken_while_the_move_runs_and_after(placed):
    """A job spanning two hosts is resized across hosts (a new generation at once); its old copy
    finishes on both as the move runs, and the job ends. The follower host's last lines of the old
    generation arrive late: they are taken, and a host the old copy never ran on is fenced.
    Before, only the leader's host counted as leaving, and only while the move was active."""
    job, leader, follower = placed
    stranger = register("n3")
    old_generation = job.generation
    job = job_transition(job=job, to=Job.State.RUNNING)
    job = job_transition(job=job, to=Job.State.RESIZING, reason="across hosts")
    job_generation_bump(job)
    move = move_create(job=job, kind=Move.Kind.RESIZE, reason="across hosts", now=timezone.now(),
                       from_node_id=leader["node_id"], from_nodes=(leader["node_id"], follower["node_id"]),
                       from_generation=old_generation, to_generation=job.generation)
    line = chunk(job, rank=1, generation=old_generation, text="rank 1 done after 10 epochs\n")
    assert post(follower, line).json()["stored"] == 1  # while the move runs
    Move.objects.filter(pk=move.pk).update(state=Move.State.DONE)
    job = job_transition(job=job, to=Job.State.SUCCEEDED, reason="finished before the cut")
    late = chunk(job, rank=1, generation=old_generation, offset=28, text="after\n")
    assert post(follower, late).json()["stored"] == 1  # after the move ended and the job with it
    refused = post(stranger, chunk(job, rank=1, generation=old_generation, offset=40, text="forged\n")).json()
    assert refused["rejected"][0]["fence"] is True and refused["stored"] == 0
    assert [c.text for c in LogChunk.objects.filter(job=job, kind="output").order_by("id")] == [
        "rank 1 done after 10 epochs\n", "after\n"]


@pytest.mark.django_db
@pytest.mark.parametrize("count", [1, 40])
def test_shipping_and_reading_take_a_constant_number_of_queries(placed, alice, api_client_for, count,
                                                                 django_assert_max_num_queries):
    job, owner, _ = placed
    chunks = [chunk(job, rank=i % 2, offset=i * 100, text=f"line {i}\n") for i in range(count)]
    with django_assert_max_num_queries(16):
        assert post(owner, *chunks).json()["stored"] == count
    client = api_client_for(alice)
    with django_assert_max_num_queries(8):
        assert len(client.get(f"/api/jobs/{job.pk}/logs/?limit=1000").json()["chunks"]) == count
