"""Real agents on separate emulated hosts (issue 14, Tests): a control plane on this machine,
reachable from the hosts only over their bridge (daphne bound to the bridge's address), a real
`meridian-agent` inside each emulated host (its own network, mounts and PIDs), the store the
one shared mount. Framework engine.

One W = 8 job on 2 hosts x 4 devices is preempted (by a premium job), resumes on 2 other hosts,
then one of its hosts is killed: the control plane's lost-node sweep restarts it from its last
checkpoint on the remaining and a replacement host. It ends with parameters and Adam state
torch.equal to an uninterrupted single-host run of the same script.
"""
import os
import subprocess
import sys
import time

import pytest
import torch
from multihost_jobs import REPO, assert_equal_states, host_env, start_job, wait_job
from polling import poll

sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
from harness import ENROLL, PYTHON, ControlPlane  # noqa: E402 - tests/e2e is put on sys.path just above
from stack_fixtures import template_db  # noqa: E402, F401 - the fixture

pytestmark = [pytest.mark.runtime, pytest.mark.slow]

SCRIPT = "tests/runtime/scripts/ddp_mlp.py"
IMPORTED = time.monotonic()
ARGS = ["--epochs", "14", "--step-sleep", "0.4"]  # 2 steps per epoch at W = 8


@pytest.fixture
def plane(tmp_path_factory, template_db, emulated_hosts):  # noqa: F811 - the imported fixture
    """Returns (hosts, control plane, start_agent(i)): 4 emulated hosts, a control plane on their
    bridge, and a starter of host i's real agent (4 CPU devices)."""
    cluster = emulated_hosts(4, control_plane=True)
    base = tmp_path_factory.mktemp("mh-cp", numbered=True)
    cp = ControlPlane(base, bind=cluster.control_plane_addr, env={
        "MERIDIAN_CHECKPOINT_STORE": f"{cluster[0].store}/ckpt",  # the hosts' shared mount
        # Four hosts' agents, two W = 8 jobs and a reference run share two cores: an agent's beat can
        # stall for seconds under that load, which must not pass for a lost node (or a move's step
        # for a timed-out one) before the test kills a host on purpose.
        "MERIDIAN_NODE_LOST_AFTER_SECONDS": "20",
        "MERIDIAN_WORKFLOW_TIMEOUT_SECONDS": "300",
        "ALLOWED_HOSTS": f"{cluster.control_plane_addr},127.0.0.1,localhost",
    })
    agents = []

    def start_agent(index):
        host = cluster[index]
        log = open(base / f"agent-{host.name}.log", "ab")
        command = [PYTHON, "-m", "agent.main", "--control-plane", cp.url, "--devices", "cpu:4",
                   "--hostname", host.name, "--region", "r1", "--cluster", "c1",
                   "--work-dir", f"{host.node_dir}/agent", "--engine", "framework", "--checkpoint-every", "3",
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
    """Returns the hostnames of the job's newest placement (its last placed/migrated event)."""
    hosts = []
    for event in cp.events(job_id):
        if event.get("type") in ("placed", "migrated"):
            hosts = sorted((event.get("extra_data") or {}).get("nodes") or [])
    return hosts


def submit(cp, name, tier, out, args=ARGS):
    spec = {"name": name, "tier": tier, "accelerator_type": "CPU", "world_size": 8, "min_devices": 8,
            "entrypoint": SCRIPT, "args": [out, *args]}
    response = cp.api("POST", "jobs/", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def say(what):
    """Prints a phase with the seconds since the module was imported (the phases' durations)."""
    print(f"[{time.monotonic() - IMPORTED:7.1f} s] {what}", flush=True)


@pytest.mark.timeout(2400)  # about 10 min on an idle 2-core machine, 3x that at a load of 20
def test_a_job_on_two_hosts_is_preempted_resumes_on_two_others_and_survives_a_killed_host(plane):
    cluster, cp, start_agent = plane
    say("control plane up")
    store = cluster[0].store
    # The uninterrupted single-host run of the same script (8 ranks on host 3, beside its agent later).
    _, reference = start_job([cluster[3]], ranks=8, script=os.path.join(REPO, SCRIPT),
                             args=[f"{store}/reference.pt", *ARGS])

    start_agent(0), start_agent(1)
    victim = submit(cp, "wide", "basic", f"{store}/victim.pt")
    cp.wait_state(victim, "running", timeout=600)
    say(f"victim running on {placement(cp, victim)}")
    assert placement(cp, victim) == ["mh-0", "mh-1"]  # bigger than a node: it spans two hosts
    poll("the victim to checkpoint", lambda: (cp.job(victim)["last_checkpoint_step"] or 0) >= 2, timeout=600,
         on_timeout=lambda: cp.diagnose(victim))

    # Preempted: the leader's cut stops every host's ranks after one step, one checkpoint of all.
    premium = submit(cp, "urgent", "premium", f"{store}/premium.pt", args=["--epochs", "8"])
    cp.wait_state(victim, "preempted", timeout=600)
    assert cp.moves(victim)[-1] == ("preemption", ["started", "barrier", "checkpoint", "store", "release"]), \
        cp.diagnose(victim)
    preempted_at = cp.job(victim)["last_checkpoint_step"]
    say(f"victim preempted at step {preempted_at}")

    # Resumed on two other hosts, which never ran it (the premium job holds the first two).
    start_agent(2), start_agent(3)
    cp.wait_state(victim, "running", timeout=600)
    say(f"victim resumed on {placement(cp, victim)}")
    assert placement(cp, victim) == ["mh-2", "mh-3"]
    cp.wait_state(premium, "succeeded", timeout=600)
    poll("a checkpoint after the resume",
         lambda: (cp.job(victim)["last_checkpoint_step"] or 0) > preempted_at, timeout=600,
         on_timeout=lambda: cp.diagnose(victim))

    # One of its hosts killed: restarted from its last checkpoint on the remaining and a replacement host.
    assert [code for code, _ in wait_job(reference)] == [0]  # it ran on mh-3, killed next
    say("reference run done")
    say(f"killing mh-3 (last checkpoint step {cp.job(victim)['last_checkpoint_step']})")
    cluster[3].kill()
    poll("the victim to be restarted off the killed host",
         lambda: "mh-3" not in placement(cp, victim) and len(placement(cp, victim)) == 2, timeout=180,
         on_timeout=lambda: cp.diagnose(victim))
    print("restarted on", placement(cp, victim), flush=True)
    cp.wait_state(victim, "succeeded", timeout=900)
    say("victim succeeded")
    assert_equal_states(torch.load(os.path.join(cluster.store_dir, "reference.pt"), weights_only=True),
                        torch.load(os.path.join(cluster.store_dir, "victim.pt"), weights_only=True))
