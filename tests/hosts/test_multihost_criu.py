"""CRIU across emulated hosts: one checkpoint of the whole job with every host's part
(runtime/criu_parts.py), restored on other hosts bit-exactly, for an unconfined job and for a
sandboxed one (its ranks as the job's uid with private /tmp and /dev/shm; criu as that uid on each
host, as on one); a part that is not there, or not what it was, is never committed nor restored."""
import json
import os
import sys

import pytest
from multihost_jobs import REPO, assert_equal_states, job_network_sandbox_args, rank_log, start_job, wait_job
from polling import poll
from test_multihost_cut import check_all, control, load, progress_step

from protocol.launch import job_part_addresses
from runtime import criu
from runtime.store import CheckpointStore

DDP_SCRIPT = os.path.join(REPO, "tests", "runtime", "scripts", "ddp_mlp.py")
# 4 ranks x 4 steps an epoch: 48 steps, of which ~40 still to go when the job is killed after its
# checkpoint at step 6 (the test checks that the job had not finished when it was killed).
ARGS = ["--epochs", "12", "--step-sleep", "0.15"]
CRIU_OK, CRIU_DETAIL = criu.check_available()

pytestmark = [pytest.mark.runtime, pytest.mark.slow, pytest.mark.criu,
              pytest.mark.skipif(not CRIU_OK, reason=f"CRIU unavailable: {CRIU_DETAIL}")]
JOB_UID = 1_650_100  # the sandboxed job's uid and gid on every host (no passwd entry needed)
PROBE = os.path.join(REPO, "tests", "sandbox", "scripts", "network_probe.py")
SERVICE_PORT = 47_321  # the node services the probe tries: a listener on every host's 0.0.0.0 and the bridge

def events(host, job_id):
    result = host.run(["cat", f"{host.node_dir}/jobs/{job_id}/events.jsonl"], check=False)
    return [json.loads(line) for line in result.stdout.splitlines()]


def _sandbox_args(cluster):
    """The sandboxed job's launcher arguments: uid JOB_UID, an isolated network over its 2 hosts."""
    return job_network_sandbox_args(cluster, uid=JOB_UID)


def _job_network_reaches_its_peers_only(cluster, sandbox):
    """A probe job as the sandboxed job (W = 4 on mh-0 + mh-1, the same spec) all-reduces across
    its hosts over its own network (runtime/netns.py JobNetworkPart) and tries the node services
    that listen on every host's 0.0.0.0 and on the control plane's address: its own host's loopback,
    each host's address, the bridge's. It reaches none of them (its loopback is its own; the rest
    ENETUNREACH: no route) but its peers; on the node's network (the old behaviour for a job
    spanning hosts) it reached them all."""
    import socket
    listen = ("import socket, time; s = socket.create_server(('0.0.0.0', %d)); time.sleep(600)" % SERVICE_PORT)
    services = [host.popen([sys.executable, "-c", listen]) for host in cluster.hosts[:2]]
    plane = socket.create_server((cluster.control_plane_addr, SERVICE_PORT))
    try:
        targets = [f"127.0.0.1:{SERVICE_PORT}", f"{cluster[0].address}:{SERVICE_PORT}",
                   f"{cluster[1].address}:{SERVICE_PORT}", f"{cluster.control_plane_addr}:{SERVICE_PORT}"]
        job_id, processes = start_job(cluster.hosts[:2], ranks=4, script=PROBE, args=["net", *targets],
                                      launcher_args=sandbox)
        check_all(wait_job(processes, timeout=300))
    finally:
        plane.close()
        for service in services:
            service.kill()
            service.wait()
    addresses = job_part_addresses(job_id=4242, nodes=2)
    for rank in range(4):
        host = cluster[rank // 2]
        line = next(x for x in rank_log(host, job_id, rank).splitlines() if x.startswith("PROBE "))
        view = json.loads(line[len("PROBE "):])
        assert view["allreduce"] == 10.0, view  # 1 + 2 + 3 + 4: its peers on the other host work
        assert view["interfaces"] == ["job0", "lo"], view
        # 111 ECONNREFUSED: 127.0.0.1 is the job's own loopback, where nothing listens; 101 ENETUNREACH.
        assert view["reaches"] == {target: "refused:111" if target.startswith("127.") else "refused:101"
                                   for target in targets}, view
    started = [e for e in events(cluster[1], job_id) if e.get("event") == "started"]
    assert started and "network: isolated (" in started[0]["sandbox"] and addresses[1] in started[0]["sandbox"]


@pytest.mark.parametrize("sandboxed", [False, True], ids=["unconfined", "sandboxed"])
def test_a_criu_job_on_two_hosts_is_checkpointed_killed_and_restored_on_two_other_hosts_bit_exact(
        emulated_hosts, sandboxed):
    """Sandboxed: the ranks run as JOB_UID with private /tmp and /dev/shm on each host; each host's
    part is dumped by criu as that uid (runtime/engines.py dump_host_ranks) and sealed root's, and
    restored on hosts that never ran the job onto their new private folders, every restored task
    checked (criu.restored_refusal) before it runs; the result is bit-exact against an unconfined,
    uninterrupted run."""
    cluster = emulated_hosts(4, control_plane=True)
    store = f"{cluster[0].store}/ckpt"
    sandbox = _sandbox_args(cluster) if sandboxed else ()
    if sandboxed:
        _job_network_reaches_its_peers_only(cluster, sandbox)
    _, processes = start_job(cluster.hosts[:2], ranks=4, script=DDP_SCRIPT, engine="criu",
                             args=[f"{cluster[0].store}/reference.pt", *ARGS])
    check_all(wait_job(processes))

    out = f"{cluster[0].store}/moved.pt"
    job_id, processes = start_job(cluster.hosts[:2], ranks=4, script=DDP_SCRIPT, engine="criu",
                                  args=[out, *ARGS], launcher_args=("--store", store, *sandbox))
    answer = control(cluster[0], job_id, "checkpoint", at_step=6)
    assert answer.get("answer", {}).get("step") == 6, answer
    assert answer["answer"]["engine"] == "criu"
    # The checkpoint went on: both hosts' ranks train past it (they were parked for the dump).
    poll("the job to go on after its checkpoint", lambda: progress_step(cluster[0], job_id) > 8, timeout=180)
    cluster[0].kill()
    cluster[1].kill()
    for process in processes:
        process.wait(timeout=60)
    assert not os.path.exists(os.path.join(cluster.store_dir, "moved.pt")), "the job ended before it was killed"

    ref = CheckpointStore(os.path.join(cluster.store_dir, "ckpt")).latest_good()
    assert ref is not None and ref.step == 6 and ref.engine == "criu"
    assert sorted(os.listdir(ref.path)) == ["MANIFEST.json", "node0", "node1"]  # one checkpoint, both parts
    for node, ranks in ((0, ("rank0", "rank1")), (1, ("rank2", "rank3"))):
        assert {name for name in os.listdir(ref.path / f"node{node}") if name.startswith("rank")} == set(ranks)
    if sandboxed:
        for node in (0, 1):  # each host saved its private folders into its part
            assert {"private-tmp.tar", "private-shm.tar"} <= set(os.listdir(ref.path / f"node{node}"))
        for path in ref.path.rglob("*"):  # written by criu as the job's uid, sealed root's before any rank ran
            info = path.lstat()
            assert info.st_uid == 0 and not info.st_mode & 0o022, path

    # Restored on two other hosts, which never ran the job: other addresses, fresh /run, /tmp, /dev/shm.
    _, processes = start_job(cluster.hosts[2:4], ranks=4, script=DDP_SCRIPT, engine="criu", args=[out, *ARGS],
                             launcher_args=("--store", store, "--resume", *sandbox), job_id=job_id + "-b")
    check_all(wait_job(processes))
    for host in cluster.hosts[2:4]:
        restored = [e for e in events(host, job_id + "-b") if e.get("event") == "restored"]
        assert len(restored) == 1 and restored[0]["step"] == 6 and restored[0]["engine"] == "criu", restored
        assert restored[0]["checkpoint"] == f"file://{store}/{ref.path.name}"
        # The restored event is written only after every rank of the host passed restored_refusal
        # (as JOB_UID, no capability, no_new_privs, its own PID and mount namespaces) and ran on.
        if sandboxed:
            assert restored[0]["sandbox"].startswith(f"uid {JOB_UID}, gid {JOB_UID}"), restored[0]["sandbox"]
            assert restored[0]["sandbox"].endswith("private /tmp and /dev/shm"), restored[0]["sandbox"]
            # ... in the job's network on the restoring hosts (their namespaces, the same addresses)
            assert "network: isolated (" in restored[0]["sandbox"], restored[0]["sandbox"]
    assert_equal_states(load(cluster, "reference.pt"), load(cluster, "moved.pt"))

    # The same checkpoint with one byte of host 1's part changed is never restored, on any host.
    image = sorted((ref.path / "node1" / "rank3").glob("pages-*.img"))[0]
    with open(image, "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 0xFF]))
    _, processes = start_job(cluster.hosts[2:4], ranks=4, script=DDP_SCRIPT, engine="criu", args=[out, *ARGS],
                             launcher_args=("--store", store, "--resume", *sandbox), job_id=job_id + "-c")
    results = wait_job(processes, timeout=300)
    # Each host checks the part it restores (runtime/criu_parts.py): host 1 refuses its part, naming
    # the file, and the leader, which waits for every host's check before it restores, refuses too
    # (exit 2, saying why); nothing is restored anywhere.
    assert results[1][0] == 2 and "node1/rank3/pages-" in results[1][1], results[1][1]
    assert results[0][0] == 2 and "--resume refused: node 1" in results[0][1], results[0][1]
    assert "no host restored anything" in results[0][1], results[0][1]
    for host in cluster.hosts[2:4]:
        assert not [e for e in events(host, job_id + "-c") if e.get("event") == "restored"]

    # Another host count (runtime/criu_parts.py): with the byte put back, the same checkpoint is
    # restored onto ONE host (its 4 ranks from both parts: one PID namespace each, one spool, the
    # one-host area instead of the chain, gloo bound to the new host), stopped there, and that
    # one-host checkpoint restored onto 2 hosts again; the job ends bit-exact.
    with open(image, "r+b") as handle:
        handle.write(first)
    os.remove(os.path.join(cluster.store_dir, "moved.pt"))  # the restored ranks write it again
    _, processes = start_job(cluster.hosts[2:3], ranks=4, script=DDP_SCRIPT, engine="criu", args=[out, *ARGS],
                             launcher_args=("--store", store, "--resume", *sandbox), job_id=job_id + "-d")
    answer = control(cluster[2], job_id + "-d", "stop")
    stopped_at = answer.get("answer", {}).get("step")
    assert stopped_at is not None and stopped_at >= 6, answer
    results = wait_job(processes, timeout=300)
    assert [code for code, _ in results] == [75], results
    restored = [e for e in events(cluster[2], job_id + "-d") if e.get("event") == "restored"]
    assert len(restored) == 1 and restored[0]["step"] == 6, restored
    assert not os.path.exists(os.path.join(cluster.store_dir, "moved.pt")), "the job ended before it was stopped"
    one_host = CheckpointStore(os.path.join(cluster.store_dir, "ckpt")).latest_good()
    assert one_host.step == stopped_at and not (one_host.path / "node0").exists()  # one host's layout: no parts
    _, processes = start_job(cluster.hosts[2:4], ranks=4, script=DDP_SCRIPT, engine="criu", args=[out, *ARGS],
                             launcher_args=("--store", store, "--resume", *sandbox), job_id=job_id + "-e")
    check_all(wait_job(processes))
    for host in cluster.hosts[2:4]:
        restored = [e for e in events(host, job_id + "-e") if e.get("event") == "restored"]
        assert len(restored) == 1 and restored[0]["step"] == stopped_at, restored
    assert_equal_states(load(cluster, "reference.pt"), load(cluster, "moved.pt"))


def test_a_host_whose_part_cannot_reach_the_shared_store_commits_no_checkpoint_and_the_job_goes_on(emulated_hosts):
    cluster = emulated_hosts(2)
    store = f"{cluster[0].store}/ckpt"
    out = f"{cluster[0].store}/out.pt"
    # Host 1 is given a store of its own (node-local, not the shared one): its part cannot be
    # where the leader commits the job's checkpoint.
    job_id, processes = start_job(cluster.hosts, ranks=4, script=DDP_SCRIPT, engine="criu", args=[out, *ARGS],
                                  node_args={0: ("--store", store),
                                             1: ("--store", f"{cluster[1].node_dir}/own-ckpt")})
    answer = control(cluster[0], job_id, "checkpoint", at_step=4)
    assert "error" in answer, answer
    assert "node 1 could not dump its part" in answer["error"], answer
    assert "not in this node's store" in answer["error"], answer
    answer = control(cluster[0], job_id, "stop")  # a stop too: no checkpoint, so the job goes on
    assert "error" in answer and "not in this node's store" in answer["error"], answer
    check_all(wait_job(processes))  # every rank on both hosts went on to the end
    assert CheckpointStore(os.path.join(cluster.store_dir, "ckpt")).list() == []  # nothing committed
    assert os.path.exists(os.path.join(cluster.store_dir, "out.pt"))
    assert not [name for name in os.listdir(os.path.join(cluster.store_dir, "ckpt"))
                if name.startswith((".staging-", ".tmp-"))]  # the refused cuts' staging is gone


def test_a_criu_job_stopped_on_two_hosts_resumes_with_its_hosts_swapped_bit_exact(emulated_hosts):
    cluster = emulated_hosts(2)
    store = f"{cluster[0].store}/ckpt"
    args = ["--epochs", "4", "--step-sleep", "0.1"]
    _, processes = start_job(cluster.hosts, ranks=4, script=DDP_SCRIPT, engine="criu",
                             args=[f"{cluster[0].store}/reference.pt", *args])
    check_all(wait_job(processes))

    out = f"{cluster[0].store}/swapped.pt"
    job_id, processes = start_job(cluster.hosts, ranks=4, script=DDP_SCRIPT, engine="criu", args=[out, *args],
                                  launcher_args=("--store", store))
    answer = control(cluster[0], job_id, "stop", at_step=5)
    assert answer.get("answer", {}).get("step") == 5, answer
    results = wait_job(processes, timeout=300)
    assert [code for code, _ in results] == [75, 75], results  # both hosts stopped after the commit
    assert [e["step"] for e in events(cluster[1], job_id) if e.get("event") == "stopped"] == [5]

    # Node 0 (ranks 0-1) now runs on the host that ran node 1, and node 1 on the old leader's.
    swapped = [cluster[1], cluster[0]]
    _, processes = start_job(swapped, ranks=4, script=DDP_SCRIPT, engine="criu", args=[out, *args],
                             launcher_args=("--store", store, "--resume"), job_id=job_id + "-b")
    check_all(wait_job(processes))
    for host in swapped:
        restored = [e for e in events(host, job_id + "-b") if e.get("event") == "restored"]
        assert len(restored) == 1 and restored[0]["step"] == 5, restored
    assert_equal_states(load(cluster, "reference.pt"), load(cluster, "swapped.pt"))
