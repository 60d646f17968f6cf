"""One meridian-run job over several emulated hosts: same bits whatever the placement."""
import os
import time

import pytest
import torch
from multihost_jobs import REPO, rank_log, start_job, wait_job
from polling import poll

from protocol.rendezvous import LeaderAddress
from runtime import spool as spool_files

DDP_SCRIPT = os.path.join(REPO, "tests", "runtime", "scripts", "ddp_mlp.py")

pytestmark = [pytest.mark.runtime]


def run_layout(cluster, hosts, *, ranks=8, epochs=4):
    """Runs ddp_mlp.py as `ranks` ranks over the first `hosts` hosts; returns its final state."""
    out = os.path.join(cluster[0].store, f"state-{hosts}.pt")
    job_id, processes = start_job(cluster.hosts[:hosts], ranks=ranks, script=DDP_SCRIPT,
                                  args=[out, "--epochs", str(epochs)])
    results = wait_job(processes)
    for node, (code, output) in enumerate(results):
        assert code == 0, f"node {node} of {hosts}: exit {code}\n{output}\n{rank_log(cluster[node], job_id, node)}"
    return torch.load(os.path.join(cluster.store_dir, f"state-{hosts}.pt"), weights_only=True), job_id


@pytest.mark.slow
def test_a_job_laid_out_8x1_4x2_and_2x4_over_hosts_ends_with_identical_bits(emulated_hosts):
    cluster = emulated_hosts(4)
    states = {hosts: run_layout(cluster, hosts)[0] for hosts in (1, 2, 4)}
    reference = states[1]
    for hosts in (2, 4):
        for name, tensor in reference["params"].items():
            assert torch.equal(tensor, states[hosts]["params"][name]), f"{name}: 1 host vs {hosts}"
        for index, per_param in reference["optimizer"]["state"].items():
            for key, value in per_param.items():
                assert torch.equal(value, states[hosts]["optimizer"]["state"][index][key]), (index, key)


def test_every_rank_gets_the_torchrun_environment_of_its_host(emulated_hosts):
    cluster = emulated_hosts(2)
    script = os.path.join(REPO, "tests", "hosts", "scripts", "print_env.py")
    out = os.path.join(cluster[0].store, "env")
    job_id, processes = start_job(cluster.hosts, ranks=4, script=script, args=[out])
    for node, (code, output) in enumerate(wait_job(processes, timeout=300)):
        assert code == 0, f"node {node}: {output}"
    seen = {}
    for rank in range(4):
        with open(os.path.join(cluster.store_dir, "env", f"rank{rank}.txt")) as handle:
            seen[rank] = dict(line.rstrip("\n").split("=", 1) for line in handle)
    leader = cluster[0].address
    for rank, env in seen.items():
        node = rank // 2
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == str(node) and env["hostname"] == f"mh-{node}"
        assert env["MASTER_ADDR"] == leader and env["MASTER_PORT"] == seen[0]["MASTER_PORT"]
        assert env["MERIDIAN_NODE_ADDR"] == cluster[node].address
        assert int(env["MASTER_PORT"]) > 0
        assert env["allreduce"] == "6.0"  # 0 + 1 + 2 + 3 across both hosts
        # each host's two ranks combine in its own /dev/shm, the hosts chain (runtime/hostchain.py)
        assert env["transport"] == "hosts"


def test_a_follower_without_a_live_leader_fails_naming_the_stale_one(emulated_hosts):
    a, b = emulated_hosts(2)
    script = os.path.join(REPO, "tests", "hosts", "scripts", "print_env.py")
    # An earlier attempt's leader.json: its store is gone (nothing listens on a's address there).
    stale = LeaderAddress(job_id="lonely", nonce="old", addr=a.address, port=9, nodes=2, world_size=2)
    spool_files.write_json_atomic(os.path.join(a.cluster.store_dir, "rendezvous", "lonely", "leader.json"),
                                  stale.to_dict())
    _, processes = start_job([a, b], ranks=2, script=script, args=["/tmp/x"], job_id="lonely",
                             launcher_args=("--rendezvous-timeout", "3"), only_nodes=(1,))
    code, output = wait_job(processes, timeout=120)[0]
    assert code == 1, output
    assert "no leader for job 'lonely'" in output and f"{a.address}:9 did not answer" in output, output


@pytest.mark.slow
def test_a_lost_host_ends_the_job_on_the_others_instead_of_hanging(emulated_hosts):
    cluster = emulated_hosts(2)
    out = os.path.join(cluster[0].store, "never.pt")
    job_id, processes = start_job(cluster.hosts, ranks=4, script=DDP_SCRIPT,
                                  args=[out, "--epochs", "200", "--step-sleep", "0.05"])
    poll("the job to run on both hosts", lambda: cluster[0].run(
        ["test", "-e", f"{cluster[0].node_dir}/jobs/{job_id}/progress.json"], check=False).returncode == 0,
        timeout=180)
    began = time.monotonic()
    cluster[1].kill()
    code, output = wait_job(processes[:1], timeout=300)[0]
    assert code == 1, output
    assert "node 1 sent no heartbeat" in output, output
    assert time.monotonic() - began < 120  # well before gloo's 10-minute timeout
