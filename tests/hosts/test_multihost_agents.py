"""Real agents on separate emulated hosts (issue 14, Tests): a control plane on this machine,
reachable from the hosts only over their bridge (uvicorn bound to the bridge's address), a real
`meridian-agent` inside each emulated host (its own network, mounts and PIDs), the store the
one shared mount. Framework engine, and CRIU in the third test.

One elastic W = 8 job (min 4 devices) on 2 hosts x 4 devices is shrunk onto one host for a premium
job and grown back onto two once that one is done (each a resize across hosts: the leader's cut,
one framework checkpoint of every rank, the W ranks relaunched spliced onto the new hosts' devices),
is preempted (by a premium job), resumes on 2 other hosts, then one of its hosts is killed: the
control plane's lost-node sweep restarts it from its last checkpoint on the remaining and a
replacement host. It ends with parameters and Adam state torch.equal to an uninterrupted
single-host run of the same script. The downtime of each move is printed (move_seconds).

A second, focused test (same fixtures): a W = 8 job on mh-0 + mh-1 whose host mh-1 is drained
moves only that host's share, to mh-2 (a partial migration; mh-0 keeps its devices, though its
ranks are relaunched from the cut too), and ends torch.equal to an uninterrupted run.

A third, with CRIU (agents started with --engine criu), every move of the first two through the
control loop, each a CRIU cut on every host (each host dumps its own ranks into its part of the
job's one checkpoint, committed by the leader: runtime/criu_parts.py) and a restore from those
process images on the new host layout, never a relaunch from scratch: an elastic W = 8 job on
mh-0 + mh-1 is shrunk onto one host (2 hosts' parts merged onto 1) and grown back (the one-host
checkpoint split over 2), preempted, restored on mh-2 + mh-3 (which never ran it), partly migrated
off a drained mh-3 (mh-2 kept), then the host that took mh-3's share is killed and the job is
restored again from the drain's images on mh-2 and a replacement host; it ends torch.equal to an
uninterrupted run. The downtime of each move is printed.
"""
import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from multihost_jobs import REPO, assert_equal_states, host_env, start_job, wait_job
from polling import poll

from runtime import criu

sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
from harness import ENROLL, PYTHON, ControlPlane  # noqa: E402 - tests/e2e is put on sys.path just above
from stack_fixtures import template_db  # noqa: E402, F401 - the fixture

pytestmark = [pytest.mark.runtime, pytest.mark.slow]

SCRIPT = "tests/runtime/scripts/ddp_mlp.py"
IMPORTED = time.monotonic()
ARGS = ["--epochs", "30", "--step-sleep", "0.4"]  # 2 steps per epoch at W = 8: room for every phase under load


@pytest.fixture
def plane(tmp_path_factory, template_db, emulated_hosts):  # noqa: F811 - the imported fixture
    """Returns (hosts, control plane, start_agent(i, engine=..., checkpoint_every=...)): 4 emulated
    hosts, a control plane on their bridge, and a starter of host i's real agent (4 CPU devices)."""
    cluster = emulated_hosts(4, control_plane=True)
    base = tmp_path_factory.mktemp("mh-cp", numbered=True)
    cp = ControlPlane(base, bind=cluster.control_plane_addr, env={
        "MERIDIAN_CHECKPOINT_STORE": f"{cluster[0].store}/ckpt",  # the hosts' shared mount
        # Four hosts' agents, two W = 8 jobs and a reference run share two cores: an agent's beat can
        # stall for seconds under that load, which must not pass for a lost node (or a move's step
        # for a timed-out one) before the test kills a host on purpose.
        "MERIDIAN_NODE_LOST_AFTER_SECONDS": "20",
        "MERIDIAN_WORKFLOW_TIMEOUT_SECONDS": "600",  # 8 rank starts took > 300 s at a load of 70
        "ALLOWED_HOSTS": f"{cluster.control_plane_addr},127.0.0.1,localhost",
    })
    agents = []

    def start_agent(index, engine="framework", checkpoint_every=3):
        host = cluster[index]
        log = open(base / f"agent-{host.name}.log", "ab")
        command = [PYTHON, "-m", "agent.main", "--control-plane", cp.url, "--devices", "cpu:4",
                   "--hostname", host.name, "--region", "r1", "--cluster", "c1",
                   "--work-dir", f"{host.node_dir}/agent", "--engine", engine,
                   "--checkpoint-every", str(checkpoint_every),
                   "--interval", "1", "--workload-root", REPO, "--node-addr", host.address, "--sandbox", "off"]
        agents.append(host.popen(command, env=host_env({"MERIDIAN_AGENT_ENROLL_TOKEN": ENROLL}), cwd=REPO,
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()
        poll(f"agent {host.name} to register", lambda: host.run(
            ["test", "-e", f"{host.node_dir}/agent/node-token"], check=False).returncode == 0, timeout=90,
            on_timeout=lambda: cp.logs(f"agent-{host.name}"))

    cp.start(template_db=template_db)
    try:
        yield cluster, cp, start_agent
    finally:
        for agent in agents:
            agent.kill()
        cp.stop()


def placement(cp, job_id):
    """Returns the hostnames of the job's newest placement (its last placed/migrated event, or the
    hosts a resize took it to)."""
    hosts = []
    for event in cp.events(job_id):
        extra = event.get("extra_data") or {}
        if event.get("type") in ("placed", "migrated") or (event.get("to_state") == "resizing" and "nodes" in extra):
            hosts = sorted(extra.get("nodes") or [])
    return hosts


def runs_on(cp, job_id, *, hosts):
    """True when the job runs on `hosts` (a count, or the hostnames) in its newest placement. The
    placement is read before the state: a resize names its hosts when it starts, and the job runs
    again only once it is done."""
    where = placement(cp, job_id)
    if (len(where) if isinstance(hosts, int) else where) != hosts:
        return False
    return cp.job(job_id)["state"] == "running" and placement(cp, job_id) == where


def move_seconds(cp, job_id, kind):
    """Returns [(seconds from the move's start to its release, seconds from its cut (barrier done)
    to the new copy running at the cut's step (restore done): the job's downtime; None for a move
    with no restore, a preemption)] per move of `kind`, from the job's move_step events."""
    moves = {}
    for event in cp.events(job_id):
        extra = event.get("extra_data") or {}
        if event.get("type") == "move_step" and extra.get("kind") == kind:
            at = datetime.datetime.fromisoformat(event["created_at"].replace("Z", "+00:00"))
            moves.setdefault(extra["move"], {})[extra["step"]] = at
    spans = []
    for steps in moves.values():
        if {"started", "release"} <= set(steps):
            down = (round((steps["restore"] - steps["barrier"]).total_seconds(), 1)
                    if {"barrier", "restore"} <= set(steps) else None)
            spans.append((round((steps["release"] - steps["started"]).total_seconds(), 1), down))
    return spans


def drain(cp, hostname):
    """Drains node `hostname` as an operator does (`POST /api/nodes/<id>/drain/`, a global admin;
    `meridian drain` calls the same): the next tick moves its jobs off."""
    found = cp.api("GET", f"nodes/?hostname={hostname}", user="admin")
    assert found.status_code == 200, found.text
    body = found.json()
    node_id = next(n["id"] for n in (body["results"] if isinstance(body, dict) else body) if n["hostname"] == hostname)
    answer = cp.api("POST", f"nodes/{node_id}/drain/", user="admin", json={"reason": "e2e: partial migration"})
    assert answer.status_code == 200 and answer.json()["state"] == "draining", answer.text


def submit(cp, name, tier, out, args=ARGS, world_size=8, min_devices=8):
    spec = {"name": name, "tier": tier, "accelerator_type": "CPU", "world_size": world_size,
            "min_devices": min_devices, "entrypoint": SCRIPT, "args": [out, *args]}
    response = cp.api("POST", "jobs/", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def say(what):
    """Prints a phase with the seconds since the module was imported (the phases' durations)."""
    print(f"[{time.monotonic() - IMPORTED:7.1f} s] {what}", flush=True)


def start_reference(host, store, args=ARGS):
    """Starts the uninterrupted single-host run of the same script (8 ranks on `host`, no agent
    there while it runs) with the job's `args`; returns its handle for assert_matches_reference."""
    return start_job([host], ranks=8, script=os.path.join(REPO, SCRIPT), args=[f"{store}/reference.pt", *args])[1]


def assert_matches_reference(cluster, reference, output):
    """The reference run ended well and the job's `output` equals its result bit for bit."""
    assert [code for code, _ in wait_job(reference)] == [0]
    assert_equal_states(torch.load(os.path.join(cluster.store_dir, "reference.pt"), weights_only=True),
                        torch.load(os.path.join(cluster.store_dir, output), weights_only=True))


RELAUNCH_RESIZE = ("resize", ["started", "barrier", "checkpoint", "store", "restore", "release"])  # across hosts


def submit_held(cp, store, name, *, epochs, world_size=8):
    """Submits a premium job (`name`) that holds its devices after training until the test opens its
    gate (open_gate). Such a job makes another move (shrink, preemption), and the test must see
    where that one went before its devices come free: were it to end first (the moved job's restore
    is slow under load, CRIU's most of all), the moved job would come back onto them unseen."""
    return submit(cp, name, "premium", f"{store}/{name}.pt", world_size=world_size, min_devices=world_size,
                  args=["--epochs", str(epochs), "--hold-until", f"{store}/{name}.go"])


def open_gate(cluster, name):
    """Lets the job submit_held submitted as `name` end."""
    open(os.path.join(cluster.store_dir, f"{name}.go"), "w").close()


def submit_squeeze(cp, store):
    """Submits the premium 4-rank job that makes the elastic job shrink (held until wait_grown_back)."""
    return submit_held(cp, store, "squeeze", epochs=2, world_size=4)


def wait_shrunk_onto_one_host(cp, job_id, squeeze):
    """Waits until the job runs on one host (for the premium job `squeeze`); its first and only move
    so far must be a resize across hosts: a cut on both hosts, one checkpoint, the 8 ranks started
    again on one host."""
    poll("the job to be shrunk onto one host", lambda: runs_on(cp, job_id, hosts=1), timeout=900,
         on_timeout=lambda: cp.diagnose(job_id, squeeze))
    assert cp.moves(job_id) == [RELAUNCH_RESIZE], cp.diagnose(job_id)


def wait_grown_back(cluster, cp, job_id, squeeze):
    """Lets `squeeze` end (opens its gate), waits until it succeeded and the job runs on two hosts
    again, by a second resize across hosts."""
    open_gate(cluster, "squeeze")
    cp.wait_state(squeeze, "succeeded", timeout=600)
    poll("the job to grow back onto two hosts", lambda: runs_on(cp, job_id, hosts=2) and len(cp.moves(job_id)) == 2,
         timeout=900, on_timeout=lambda: cp.diagnose(job_id))
    assert cp.moves(job_id)[-1] == RELAUNCH_RESIZE, cp.diagnose(job_id)


@pytest.mark.timeout(3000)  # about 12 min on an idle 2-core machine, 3x that at a load of 20
def test_a_job_on_two_hosts_is_resized_across_hosts_preempted_resumes_on_two_others_and_survives_a_killed_host(
        plane):
    cluster, cp, start_agent = plane
    say("control plane up")
    store = cluster[0].store
    # The uninterrupted single-host run of the same script (8 ranks on host 2, beside its agent later;
    # not on host 3, which is killed while the job runs).
    reference = start_reference(cluster[2], store)

    start_agent(0), start_agent(1)
    victim = submit(cp, "wide", "basic", f"{store}/victim.pt", min_devices=4)  # elastic: 4 or 8 devices
    cp.wait_state(victim, "running", timeout=600)
    say(f"victim running on {placement(cp, victim)}")
    assert placement(cp, victim) == ["mh-0", "mh-1"]  # bigger than a node: it spans two hosts
    poll("the victim to checkpoint", lambda: (cp.job(victim)["last_checkpoint_step"] or 0) >= 2, timeout=600,
         on_timeout=lambda: cp.diagnose(victim))

    # Shrunk onto one host for a premium 4-rank job, then grown back onto two once it is done: each a
    # resize across hosts (cut on both hosts, one checkpoint, the 8 ranks relaunched on the new hosts).
    squeeze = submit_squeeze(cp, store)
    wait_shrunk_onto_one_host(cp, victim, squeeze)
    shrunk_at = cp.job(victim)["last_checkpoint_step"]
    say(f"victim shrunk onto {placement(cp, victim)} at step {shrunk_at} (8 ranks on 4 devices)")
    wait_grown_back(cluster, cp, victim, squeeze)
    say(f"victim grown back onto {placement(cp, victim)} at step {cp.job(victim)['last_checkpoint_step']}; "
        f"resize moves (whole move s, downtime s): {move_seconds(cp, victim, 'resize')}")

    # Preempted: the leader's cut stops every host's ranks after one step, one checkpoint of all.
    premium = submit_held(cp, store, "urgent", epochs=8)
    cp.wait_state(victim, "preempted", timeout=600)
    assert cp.moves(victim)[-1] == ("preemption", ["started", "barrier", "checkpoint", "store", "release"]), \
        cp.diagnose(victim)
    preempted_at = cp.job(victim)["last_checkpoint_step"]
    say(f"victim preempted at step {preempted_at}")

    # Resumed on two other hosts, which never ran it (the premium job holds the first two). Elastic,
    # it may start on the first of them alone and grow onto the second once it registers.
    start_agent(2), start_agent(3)
    poll("the victim to run on mh-2 and mh-3", lambda: runs_on(cp, victim, hosts=["mh-2", "mh-3"]), timeout=600,
         on_timeout=lambda: cp.diagnose(victim))
    say(f"victim resumed on {placement(cp, victim)}")
    open_gate(cluster, "urgent")
    cp.wait_state(premium, "succeeded", timeout=600)
    poll("a checkpoint after the resume",
         lambda: (cp.job(victim)["last_checkpoint_step"] or 0) > preempted_at, timeout=600,
         on_timeout=lambda: cp.diagnose(victim))

    # One of its hosts killed: restarted from its last checkpoint on the remaining and a replacement host.
    say(f"killing mh-3 (last checkpoint step {cp.job(victim)['last_checkpoint_step']})")
    cluster[3].kill()
    poll("the victim to be restarted off the killed host",
         lambda: "mh-3" not in placement(cp, victim) and len(placement(cp, victim)) == 2, timeout=600,
         on_timeout=lambda: cp.diagnose(victim))
    print("restarted on", placement(cp, victim), flush=True)
    cp.wait_state(victim, "succeeded", timeout=900)
    say("victim succeeded")
    assert_matches_reference(cluster, reference, "victim.pt")


@pytest.mark.timeout(2400)  # about 5 min on an idle 2-core machine
def test_draining_one_host_of_a_job_on_two_hosts_moves_only_that_hosts_share_bit_exact(plane):
    cluster, cp, start_agent = plane
    say("control plane up")
    store = cluster[0].store
    # The uninterrupted single-host run of the same script, on host 3 (no agent there).
    reference = start_reference(cluster[3], store)
    start_agent(0), start_agent(1)
    job = submit(cp, "wide", "basic", f"{store}/partial.pt")  # 8 devices, not elastic: two whole hosts
    cp.wait_state(job, "running", timeout=600)
    assert placement(cp, job) == ["mh-0", "mh-1"], cp.diagnose(job)
    start_agent(2)  # the replacement host, registered once the job runs (it must not be placed there first)
    poll("the job to checkpoint", lambda: (cp.job(job)["last_checkpoint_step"] or 0) >= 2, timeout=600,
         on_timeout=lambda: cp.diagnose(job))

    say(f"draining mh-1 (job at step {cp.job(job)['progress_step']})")
    drain(cp, "mh-1")
    poll("the job to run on mh-0 and mh-2", lambda: runs_on(cp, job, hosts=["mh-0", "mh-2"]), timeout=900,
         on_timeout=lambda: cp.diagnose(job))
    assert cp.moves(job) == [("migration", ["started", "barrier", "checkpoint", "store", "restore", "release"])], \
        cp.diagnose(job)
    migrated = [e["extra_data"] for e in cp.events(job) if e.get("type") == "migrated"]
    assert len(migrated) == 1 and migrated[0]["partial"] is True and migrated[0]["kept_nodes"] == ["mh-0"], migrated
    say(f"partly migrated: mh-1's share to mh-2, mh-0 kept, at step {cp.job(job)['last_checkpoint_step']}; "
        f"migration (whole move s, downtime s): {move_seconds(cp, job, 'migration')}")
    cp.wait_state(job, "succeeded", timeout=900)
    say("job succeeded")
    assert_matches_reference(cluster, reference, "partial.pt")


CRIU_OK, CRIU_DETAIL = criu.check_available()
# Five moves of one job (a shrink, a grow, a preemption, a drain, a lost host), each a CRIU cut and a
# restore or a restore: more epochs than ARGS keep it running until the last one under load.
CRIU_ARGS = ["--epochs", "70", "--step-sleep", "0.4"]


def launcher_events(host, kind, job_id):
    """Returns the events of `kind` the launchers of job `job_id` on `host` wrote (its agent's
    job folders, one per attempt: <job id>.<attempt>)."""
    found = host.run(["sh", "-c", f"cat {host.node_dir}/agent/j/{job_id}.*/events.jsonl"], check=False).stdout
    return [event for event in map(json.loads, found.splitlines()) if event.get("event") == kind]


def restored_after(host, seen, cp, job_id):
    """Waits until `host`'s launchers of the job wrote more than `seen` "restored" events; returns them all."""
    def more():
        found = launcher_events(host, "restored", job_id)
        return found if len(found) > seen else None
    return poll(f"{host.name}'s launcher to restore", more, timeout=600, on_timeout=lambda: cp.diagnose(job_id))


def assert_restored_from_the_cut(cluster, cp, job_id, seen):
    """Every host of the job's newest placement restored its ranks from CRIU images at the job's last
    checkpoint step (a launcher writes "restored" only once criu is done): not relaunched from
    scratch, not from an older checkpoint. `seen` ({hostname: restored events so far}) is updated;
    returns (the placement, the step)."""
    step = cp.job(job_id)["last_checkpoint_step"]
    where = placement(cp, job_id)
    for name in where:
        restored = restored_after(cluster[int(name[-1])], seen.get(name, 0), cp, job_id)
        assert (restored[-1]["engine"], restored[-1]["step"]) == ("criu", step), (name, restored, cp.diagnose(job_id))
        seen[name] = len(restored)
    return where, step


def assert_every_cut_criu(cp, job_id, cuts):
    """The job's checkpoints are `cuts` or more, every one made by the CRIU engine (no move fell back to
    the framework engine)."""
    engines = [e["extra_data"].get("engine") for e in cp.events(job_id) if e.get("type") == "checkpointed"]
    assert len(engines) >= cuts and set(engines) == {"criu"}, (engines, cp.diagnose(job_id))


@pytest.mark.criu
@pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")
@pytest.mark.timeout(3600)  # about 8 min on an idle 2-core machine
def test_a_criu_job_on_two_hosts_is_resized_preempted_partly_migrated_and_survives_a_killed_host(plane):
    cluster, cp, start_agent = plane
    say("control plane up")
    store = cluster[0].store
    # Beside host 2's agent, once that one starts (host 2 is never killed nor drained).
    reference = start_reference(cluster[2], store, CRIU_ARGS)
    # No periodic checkpoint: each move's cut is a dump of the job's 8 ranks (~1.8 GB).
    start_agent(0, engine="criu", checkpoint_every=0), start_agent(1, engine="criu", checkpoint_every=0)
    job = submit(cp, "wide", "basic", f"{store}/criu.pt", args=CRIU_ARGS, min_devices=4)  # elastic: 4 or 8
    cp.wait_state(job, "running", timeout=600)
    assert placement(cp, job) == ["mh-0", "mh-1"], cp.diagnose(job)
    poll("the job to train a few steps", lambda: (cp.job(job)["progress_step"] or 0) >= 3, timeout=600,
         on_timeout=lambda: cp.diagnose(job))
    restored = {}

    # Shrunk onto one host for a premium 4-rank job: a CRIU cut on both hosts (each dumps its part of
    # one checkpoint), the 8 ranks restored from both parts on one host's 4 devices.
    squeeze = submit_squeeze(cp, store)
    wait_shrunk_onto_one_host(cp, job, squeeze)
    where, step = assert_restored_from_the_cut(cluster, cp, job, restored)
    say(f"shrunk onto {where} at step {step}: 2 hosts' parts restored on one host")

    # Grown back onto two hosts once the squeeze is done: the one-host checkpoint split over two.
    wait_grown_back(cluster, cp, job, squeeze)
    where, step = assert_restored_from_the_cut(cluster, cp, job, restored)
    say(f"grown back onto {where} at step {step}; resize moves (whole move s, downtime s): "
        f"{move_seconds(cp, job, 'resize')}")
    assert sum(len(launcher_events(cluster[i], "started", job)) for i in (0, 1)) == 2  # launched once, ever

    # Preempted by a premium job that needs every device: each host dumps its part.
    premium = submit_held(cp, store, "urgent", epochs=4)
    cp.wait_state(job, "preempted", timeout=900)
    assert cp.moves(job)[-1] == ("preemption", ["started", "barrier", "checkpoint", "store", "release"]), \
        cp.diagnose(job)
    say(f"preempted at step {cp.job(job)['last_checkpoint_step']}; preemption (whole move s): "
        f"{[whole for whole, _ in move_seconds(cp, job, 'preemption')]}")

    # Restored from its process images on mh-2 and mh-3, which never ran it. Elastic, it may start on
    # the first of them alone and grow onto the second once it registers (a CRIU move too).
    start_agent(2, engine="criu", checkpoint_every=0), start_agent(3, engine="criu", checkpoint_every=0)
    poll("the job to run on mh-2 and mh-3", lambda: runs_on(cp, job, hosts=["mh-2", "mh-3"]), timeout=900,
         on_timeout=lambda: cp.diagnose(job))
    where, step = assert_restored_from_the_cut(cluster, cp, job, restored)
    say(f"restored from its CRIU images on {where} at step {step}")
    open_gate(cluster, "urgent")  # its devices are the room the drain below needs

    # mh-3 drained at once: only its share moves, to mh-0 or mh-1 once the premium job is done with them
    # (a drain waits for room); mh-2 keeps its devices (its ranks are dumped and restored there too:
    # one cut of the whole job). Not later: the job trains on meanwhile, ~1 step a second.
    moves_before = len(cp.moves(job))
    drain(cp, "mh-3")
    poll("mh-3's share to move", lambda: "mh-3" not in placement(cp, job) and runs_on(cp, job, hosts=2),
         timeout=900, on_timeout=lambda: cp.diagnose(job))
    assert cp.moves(job)[moves_before:] == [
        ("migration", ["started", "barrier", "checkpoint", "store", "restore", "release"])], cp.diagnose(job)
    migrated = [e["extra_data"] for e in cp.events(job) if e.get("type") == "migrated"][-1]
    assert migrated["partial"] is True and migrated["kept_nodes"] == ["mh-2"], migrated
    cp.wait_state(premium, "succeeded", timeout=600)
    where, step = assert_restored_from_the_cut(cluster, cp, job, restored)
    say(f"partly migrated: mh-3's share to {where}, mh-2 kept, at step {step}; "
        f"migration (whole move s, downtime s): {move_seconds(cp, job, 'migration')}")

    # The host that took mh-3's share killed: restored again from the drain's images, on mh-2 and a
    # replacement host.
    victim = next(name for name in where if name != "mh-2")
    cluster[int(victim[-1])].kill()
    killed_at = time.monotonic()
    say(f"killed {victim}")
    poll("the job to be restored off the killed host",
         lambda: victim not in placement(cp, job) and runs_on(cp, job, hosts=2), timeout=900,
         on_timeout=lambda: cp.diagnose(job))
    restored.pop(victim, None)
    where, again = assert_restored_from_the_cut(cluster, cp, job, restored)
    assert again == step, (again, step)  # from the same images: nothing was dumped on the way
    say(f"restored again on {where} at step {again}, {round(time.monotonic() - killed_at, 1)} s after the kill "
        f"(the lost-node threshold is 20 s); migration moves (whole move s, downtime s): "
        f"{move_seconds(cp, job, 'migration')}")
    cp.wait_state(job, "succeeded", timeout=900)
    say("job succeeded")
    assert_every_cut_criu(cp, job, 4)  # shrink, grow, preemption, drain
    assert_matches_reference(cluster, reference, "criu.pt")
