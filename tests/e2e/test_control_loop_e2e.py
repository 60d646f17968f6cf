"""End to end: real Redis, uvicorn, Celery worker and beat, node agents, the real runtime (framework
checkpoint engine, named explicitly in harness.ENGINE; CRIU too where a test says so) on CPU slots.
Every wait polls with a deadline. Each test starts its own control plane from a migrated template database."""
import json
import pathlib
import time

import pytest
from harness import LOST_AFTER_S, assert_same_parameters, uninterrupted_run
from polling import poll

from agent.node import pid_alive
from runtime.criu import check_available

CRIU_OK, CRIU_DETAIL = check_available()

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def restored_steps(plane, hostname):
    """Returns the steps at which launchers on `hostname` restored a checkpoint (from their events)."""
    steps = []
    jobs_dir = plane.agents[hostname][1] / "j"
    for events in sorted(jobs_dir.glob("*/events.jsonl")) if jobs_dir.exists() else []:
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "restored":
                steps.append((events.parent.name, event["step"]))
    return steps


def runtime_events(plane, hostname, kind, field):
    """Returns (job dir, event[field]) for the launcher events of `kind` on `hostname`."""
    found = []
    jobs_dir = plane.agents[hostname][1] / "j"
    for events in sorted(jobs_dir.glob("*/events.jsonl")) if jobs_dir.exists() else []:
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == kind:
                found.append((events.parent.name, event[field]))
    return found


@pytest.mark.parametrize("engine", [
    "framework",
    pytest.param("criu", marks=[pytest.mark.criu,
                                pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")]),
])
def test_a_premium_job_preempts_a_basic_one_which_resumes_elsewhere_with_identical_results(stack, engine):
    plane = stack()
    plane.start_agent("n1", devices=1, engine=engine)
    plane.start_agent("n2", devices=1, engine=engine)
    out = pathlib.Path(plane.dir)
    basic = {name: plane.submit(name=name, tier="basic", epochs=8, step_sleep=0.1, out=out / f"{name}.pt")
             for name in ("basic-a", "basic-b")}
    for job_id in basic.values():
        poll(f"job {job_id} to run 20 steps", lambda j=job_id: plane.job(j)["progress_step"] >= 20,
             timeout=180, on_timeout=lambda: plane.diagnose(*basic.values()))

    premium = plane.submit(name="premium", tier="premium", epochs=24, step_sleep=0.1)
    plane.wait_state(premium, "running", timeout=120)

    victims = [j for j in basic.values() if plane.job(j)["preemption_count"] >= 1]
    assert len(victims) == 1, plane.diagnose(premium, *basic.values())
    victim = victims[0]
    other = next(j for j in basic.values() if j != victim)
    # Preempted (its preemption_count says so), and not ended: on a loaded machine the other job may
    # have finished by now and the victim be placed again on its device already.
    assert plane.job(victim)["state"] in {"preempting", "preempted", "scheduled", "running"}
    for job_id in (victim, other, premium):
        plane.wait_state(job_id, "succeeded", timeout=300)

    victim_job = plane.job(victim)
    hosts = plane.nodes_of(victim)
    assert len(hosts) == 2 and hosts[0] != hosts[1], plane.diagnose(victim)
    assert plane.nodes_of(premium) == [hosts[0]]  # it took the victim's device
    assert plane.job(other)["preemption_count"] == 0
    # The victim restored the checkpoint it took when it was stopped, on the other node.
    checkpointed = [e for e in plane.events(victim) if e["type"] == "checkpointed"]
    assert checkpointed and victim_job["last_checkpoint_step"] >= 20
    restored = restored_steps(plane, hosts[1])
    assert restored and restored[-1][1] >= 20, restored
    assert {engine} == {e for _, e in runtime_events(plane, hosts[1], "restored", "engine")}
    assert_same_parameters(out / f"{plane.job(other)['name']}.pt", out / f"{victim_job['name']}.pt")
    # The preemption ran as a move whose steps each left an event, in order.
    assert plane.moves(victim) == [("preemption", ["started", "barrier", "checkpoint", "store", "release"])], \
        plane.diagnose(victim)
    step_events = [e for e in plane.events(victim) if e["type"] == "move_step" and e["extra_data"]["step"] != "started"]
    assert {e["extra_data"]["node"] for e in step_events} == {hosts[0]}
    assert {e["extra_data"]["checkpoint_step"] for e in step_events} == {restored[0][1]}
    # ... run by the Celery worker: the move's chain of step tasks, and the advances reports enqueue.
    worker_log = plane.logs("worker", tail=10**8)
    assert "jobs.tasks.move_step" in worker_log and "jobs.tasks.move_advance" in worker_log


def test_cancelling_a_running_job_kills_its_ranks_without_a_checkpoint_and_removes_its_store(stack):
    plane = stack()
    plane.start_agent("n1", devices=1)
    job = plane.submit(name="to-cancel", tier="basic", epochs=40, step_sleep=0.1)
    poll("a checkpoint", lambda: plane.job(job)["last_checkpoint_step"], timeout=180,
         on_timeout=lambda: plane.diagnose(job))
    store = plane.dir / "store" / f"job-{job}"
    assert list(store.glob("g*/ckpt-*"))

    assert plane.api("POST", f"jobs/{job}/cancel/").status_code == 200

    assert plane.wait_state(job, "cancelled")["state"] == "cancelled"
    job_dirs = list((plane.agents["n1"][1] / "j").glob(f"{job}.*"))
    poll("the copy to be killed", lambda: all((d / "fenced").exists() for d in job_dirs), timeout=60,
         on_timeout=lambda: plane.diagnose(job))
    poll("its store to go", lambda: not store.exists(), timeout=60, on_timeout=lambda: plane.diagnose(job))
    assert not runtime_events(plane, "n1", "stopped", "step")  # killed, not stopped at a cut
    launched = [json.loads((d / "launcher.json").read_text())["pid"] for d in job_dirs]
    assert launched and not any(pid_alive(pid) for pid in launched)


def test_preempting_a_standard_job_below_its_sla_waits_for_a_capacity_manager(stack):
    # The standard job first waits behind a premium one, so its attained fraction of ideal
    # device-time stays well below a 0.99 floor while it runs: preempting it needs approval.
    plane = stack(env={"MERIDIAN_STANDARD_SLA_FLOOR": "0.99"})
    plane.start_agent("n1", devices=1)
    first = plane.submit(name="premium-first", tier="premium", epochs=4, step_sleep=0.1)
    plane.wait_state(first, "running", timeout=120)
    standard = plane.submit(name="standard", tier="standard", epochs=14, step_sleep=0.1)
    plane.wait_state(first, "succeeded", timeout=180)
    poll("the standard job to run", lambda: plane.job(standard)["progress_step"] >= 10, timeout=180,
         on_timeout=lambda: plane.diagnose(standard))
    premium = plane.submit(name="premium", tier="premium", epochs=2)

    def pending_request():
        body = plane.api("GET", "preemptions/?state=pending", user="carol").json()
        rows = [
            r for r in body.get("results", body)
            if (r["job"]["id"] if isinstance(r["job"], dict) else r["job"]) == standard
        ]
        return rows[0] if rows else None

    request = poll("a preemption request for the standard job", pending_request, timeout=60,
                   on_timeout=lambda: plane.diagnose(standard, premium))

    def still_running_after(steps_from, steps):
        job = plane.job(standard)
        assert job["state"] == "running", plane.diagnose(standard, premium)
        assert plane.job(premium)["state"] == "pending"
        return job["progress_step"] >= steps_from + steps

    # Nothing happens while nobody decides: the standard job keeps training.
    base = plane.job(standard)["progress_step"]
    poll("the standard job to keep training", lambda: still_running_after(base, 15), timeout=120)
    assert "approval" in plane.job(premium)["wait_reason"]

    # alice (a member, not a capacity manager) may not approve.
    assert plane.api("POST", f"preemptions/{request['id']}/approve/", user="alice", json={}).status_code in (403, 404)
    denied = plane.api("POST", f"preemptions/{request['id']}/deny/", user="carol", json={"note": "deadline today"})
    assert denied.status_code == 200, denied.text
    base = plane.job(standard)["progress_step"]
    poll("the denied job to keep training", lambda: still_running_after(base, 15), timeout=120)

    def next_request():
        r = pending_request()
        return r if r and r["id"] != request["id"] else None

    again = poll("the next request", next_request, timeout=60)
    approved = plane.api("POST", f"preemptions/{again['id']}/approve/", user="carol", json={"note": "ok"})
    assert approved.status_code == 200, approved.text
    plane.wait_state(premium, "succeeded", timeout=180)
    finished = plane.wait_state(standard, "succeeded", timeout=240)
    assert finished["preemption_count"] == 1
    types = [e["type"] for e in plane.events(standard)]
    assert types.count("preemption_requested") >= 2 and "preemption_denied" in types and "preemption_approved" in types
    assert plane.moves(standard) == [("preemption", ["started", "barrier", "checkpoint", "store", "release"])]


def test_a_killed_agent_loses_its_node_and_its_job_resumes_from_its_last_checkpoint_elsewhere(stack):
    plane = stack()
    plane.start_agent("n1", devices=1)
    out = pathlib.Path(plane.dir)
    job = plane.submit(name="survivor", tier="basic", epochs=8, step_sleep=0.1, out=out / "survivor.pt")
    poll("a checkpoint past step 20", lambda: (plane.job(job)["last_checkpoint_step"] or 0) >= 20, timeout=180,
         on_timeout=lambda: plane.diagnose(job))
    plane.start_agent("n2", devices=1)
    first_host = plane.nodes_of(job)[0]
    assert first_host == "n1"

    # The node dies: its agent is SIGKILLed, and so are the job's processes on it.
    plane.kill_agent("n1")
    plane.kill_job_processes("n1")
    checkpoint_step = plane.job(job)["last_checkpoint_step"]

    poll("the job to run on n2", lambda: plane.nodes_of(job)[-1:] == ["n2"], timeout=120,
         on_timeout=lambda: plane.diagnose(job))
    types = [e["type"] for e in plane.events(job)]
    assert "node_lost" in types and "migrated" in types
    plane.wait_state(job, "succeeded", timeout=240)
    # Nothing to cut on a dead node: the migration restores the last checkpoint, then releases.
    assert plane.moves(job) == [("migration", ["started", "restore", "release"])], plane.diagnose(job)
    restored = restored_steps(plane, "n2")
    assert restored and restored[0][1] == checkpoint_step, (restored, checkpoint_step)
    # The job's timeline says it, once, with where the time went (the agent's RestoreReport).
    (event,) = [e for e in plane.events(job) if e["type"] == "restored"]
    assert event["reason"].startswith(f"restored on n2 from step {checkpoint_step} ("), event
    # Nothing lost: the same result as an uninterrupted run of the same script (run without a control
    # plane: under CI's load a reference run through it was once preempted, the cause not recorded).
    assert_same_parameters(uninterrupted_run(out / "reference.pt", epochs=8), out / "survivor.pt")


def test_an_elastic_job_shrinks_for_a_premium_job_and_grows_back_with_identical_results(stack):
    plane = stack()
    plane.start_agent("n1", devices=2)
    out = pathlib.Path(plane.dir)
    # 48 epochs (384 steps): under load (13 on 2 cores) 32 ended while the grow-back's move was
    # still at its first step, and the move then never reached its barrier.
    elastic = plane.submit(name="elastic", tier="basic", world_size=2, min_devices=1, epochs=48, step_sleep=0.1,
                           out=out / "elastic.pt")
    poll("the elastic job to run on 2 devices", lambda: plane.job(elastic)["progress_step"] >= 15, timeout=180,
         on_timeout=lambda: plane.diagnose(elastic))
    assert plane.job(elastic)["device_count"] == 2

    premium = plane.submit(name="premium", tier="premium", epochs=3, step_sleep=0.1)
    plane.wait_state(premium, "running", timeout=120)
    shrunk = plane.job(elastic)
    assert shrunk["state"] in {"resizing", "running"} and shrunk["device_count"] == 1, plane.diagnose(elastic, premium)
    assert shrunk["preemption_count"] == 0
    plane.wait_state(premium, "succeeded", timeout=180)
    poll("the elastic job to grow back", lambda: plane.job(elastic)["resize_count"] >= 2
         and plane.job(elastic)["device_count"] == 2, timeout=120, on_timeout=lambda: plane.diagnose(elastic))
    finished = plane.wait_state(elastic, "succeeded", timeout=240)
    planned = [e["extra_data"].get("to_devices") for e in plane.events(elastic) if e["to_state"] == "resizing"]
    assert planned == [1, 2] and finished["preemption_count"] == 0, plane.diagnose(elastic)
    assert plane.moves(elastic) == [("resize", ["started", "barrier", "resize", "release"])] * 2, \
        plane.diagnose(elastic)
    # The runtime really spliced the 2 ranks onto 1 device and back (its launcher's own events).
    assert [devices for _dir, devices in runtime_events(plane, "n1", "resize", "devices")] == [1, 2], \
        plane.diagnose(elastic)

    # The same script run rigidly on 2 devices, never resized, ends with the same parameters.
    reference = plane.submit(name="reference", tier="basic", world_size=2, min_devices=2, epochs=48,
                             out=out / "reference.pt")
    plane.wait_state(reference, "succeeded", timeout=240)
    assert plane.job(reference)["resize_count"] == 0
    assert_same_parameters(out / "reference.pt", out / "elastic.pt")


def test_a_partitioned_node_fences_itself_and_its_stale_copy_is_gone_before_the_new_one_resumes(stack):
    plane = stack()
    plane.start_agent("n1", devices=1, partitionable=True)
    out = pathlib.Path(plane.dir)
    job = plane.submit(name="partitioned", tier="basic", epochs=24, step_sleep=0.1, out=out / "partitioned.pt")
    poll("a checkpoint past step 20", lambda: (plane.job(job)["last_checkpoint_step"] or 0) >= 20, timeout=180,
         on_timeout=lambda: plane.diagnose(job))
    plane.start_agent("n2", devices=1)
    stale = plane.job_pids("n1")
    assert stale

    # The partition: n1's agent and its job run on, but no heartbeat gets through.
    plane.partitions["n1"].cut()
    cut_at = time.time()
    # Past the lost-node threshold (LOST_AFTER_S) without a heartbeat, n1's agent kills its copy itself,
    # without a checkpoint, while still cut off.
    poll("n1 to fence its own copy", lambda: not any(pid_alive(pid) for pid in stale), timeout=60,
         on_timeout=lambda: plane.logs("agent-n1"))
    stale_dirs = list((plane.agents["n1"][1] / "j").glob(f"{job}.*"))
    fenced = poll("the fenced marker", lambda: [d / "fenced" for d in stale_dirs if (d / "fenced").exists()],
                  timeout=30)
    fenced_at = fenced[0].stat().st_mtime
    assert fenced_at - cut_at >= LOST_AFTER_S - 1.0, "fenced before the lost-node threshold"
    assert "self-fenced" in plane.logs("agent-n1", tail=10**6)
    assert not runtime_events(plane, "n1", "stopped", "step"), "a fenced copy is killed, not stopped"
    late = [t for _dir, t in runtime_events(plane, "n1", "checkpoint", "time_unix") if t > fenced_at]
    assert late == [], "the fenced copy wrote a checkpoint"

    # The control plane restarts it on n2 from its last checkpoint; the stale copy was gone before.
    restored = poll("the job to restore on n2", lambda: runtime_events(plane, "n2", "restored", "time_unix"),
                    timeout=120, on_timeout=lambda: plane.diagnose(job))
    assert restored[0][1] > fenced_at
    # It restored the newest checkpoint the control plane accepted, never one the stale copy wrote
    # while cut off (each generation writes into a store folder of its own).
    events = plane.events(job)
    restart = next(i for i, e in enumerate(events) if e["type"] == "migrated")
    accepted = max(e["extra_data"]["step"] for e in events[:restart] if e["type"] == "checkpointed")
    assert [step for _dir, step in restored_steps(plane, "n2")] == [accepted], plane.diagnose(job)
    plane.partitions["n1"].heal()
    plane.wait_state(job, "succeeded", timeout=300)
    assert plane.moves(job) == [("migration", ["started", "restore", "release"])], plane.diagnose(job)
    assert plane.nodes_of(job) == ["n1", "n2"]
    # The new copy's result is the uninterrupted run's.
    reference = plane.submit(name="reference", tier="basic", epochs=24, out=out / "reference.pt")
    plane.wait_state(reference, "succeeded", timeout=240)
    assert_same_parameters(out / "reference.pt", out / "partitioned.pt")
