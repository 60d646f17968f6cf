"""A sandboxed job on one host has a network namespace of its own with only loopback (issue 13):
it reaches neither a service on the node's 127.0.0.1 (on an all-in-one node: PostgreSQL with trust
auth, the Celery broker, the control plane) nor the node's own addresses, while its ranks still
all-reduce over their loopback. A job granted the host network reaches them.

Measured on the landed code before this: a sandboxed job connected to both (it shared the node's
network), and its sandbox line said nothing of the network."""
import json
import os
import select
import socket
import subprocess

import pytest
from sandbox_helpers import SCRIPTS, entry, make_node, outcome, probe_report, workspace

from agent import sandbox as agent_sandbox
from protocol.states import JobNetwork
from runtime import netns

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]
PROBE = SCRIPTS / "network_probe.py"


def _node_address() -> str | None:
    """Returns one of the node's global IPv4 addresses (not loopback), or None when it has none."""
    lines = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True,
                           text=True).stdout.split("\n")
    addresses = [line.split()[3].split("/")[0] for line in lines if len(line.split()) > 3]
    return addresses[0] if addresses else None


@pytest.fixture
def node_services():
    """Listening TCP sockets standing in for the node's services: one on 127.0.0.1 (where an
    all-in-one node's database and broker listen), one on the node's own address when it has one.
    Yields {"HOST:PORT": listening socket}."""
    listeners = {}
    for host in ("127.0.0.1", _node_address()):
        if host is None:
            continue
        server = socket.create_server((host, 0))
        listeners[f"{host}:{server.getsockname()[1]}"] = server
    yield listeners
    for server in listeners.values():
        server.close()


def _connected(server) -> bool:
    """True when a connection reached `server` (one waits in its backlog)."""
    return bool(select.select([server], [], [], 0)[0])


def _run(node, store, job_id, targets, *, world_size=1, network=None):
    """Runs the network probe as job `job_id` through the agent; returns (its report, each rank's view)."""
    work = node.work_dir
    workspace(work, job_id)
    try:
        node.reconcile([entry(job_id, store, script=PROBE, args=["net", *targets], world_size=world_size,
                              indices=(0,), network=network)])
        job_dir = node.jobs[job_id].job_dir
        report = outcome(node, job_id)
    finally:
        node.kill_all()
    assert report["state"] == "finished", report.get("error")
    views = [probe_report(work / "workspaces" / f"job-{job_id}" / f"net-rank{r}.json") for r in range(world_size)]
    return report, views, json.loads((job_dir / agent_sandbox.SANDBOX_FILE).read_text())


def test_an_isolated_job_reaches_neither_the_nodes_loopback_nor_its_address_and_its_ranks_still_reduce(
        node_root, node_services):
    node = make_node(node_root / "w")
    report, views, spec = _run(node, node_root / "store", 61, list(node_services), world_size=2)
    for view in views:
        assert all(outcome_.startswith("refused:") for outcome_ in view["reaches"].values()), view["reaches"]
        assert view["allreduce"] == 3.0  # 1 + 2: gloo and the rendezvous store over the namespace's loopback
        assert view["interfaces"] == ["lo"]
        assert view["netns"] != netns.namespace_id()
    assert not any(_connected(server) for server in node_services.values())
    assert views[0]["netns"] == views[1]["netns"]  # one namespace for the job's ranks (and its launcher)
    assert spec["network"] == "isolated" and spec["v"] == 2  # the default, written for the launcher
    assert "network: isolated" in report["sandbox"]


def test_a_job_granted_the_host_network_reaches_the_node(node_root, node_services):
    node = make_node(node_root / "w")
    report, views, spec = _run(node, node_root / "store", 62, list(node_services), network="host")
    assert spec["network"] == "host"
    assert "network: host (the job asked for the node's network)" in report["sandbox"]
    assert views[0]["netns"] == netns.namespace_id()
    assert set(views[0]["reaches"].values()) == {"connected"}, views[0]["reaches"]


def test_a_job_spanning_hosts_gets_a_network_of_its_own_where_the_node_forwards_else_is_refused_by_name(
        node_root, node_services):
    """Two agents on this machine play the job's two hosts (both at 127.0.0.1). The job asked for
    nothing (isolated): each agent gives its launcher the job's addresses, and the launchers build
    the job's network across hosts (runtime/netns.py JobNetworkPart; proven across emulated hosts in
    tests/hosts/test_multihost_criu.py). A node that does not forward IPv4 (this machine's default)
    cannot route it: each launch fails saying so, never falling back to the node's network; one
    that forwards runs the job, whose ranks all-reduce and reach no node service."""
    store, rendezvous = node_root / "store", node_root / "rdv"
    nodes = [make_node(node_root / f"w{k}") for k in range(2)]
    try:
        for k, node in enumerate(nodes):
            workspace(node.work_dir, 63)
            wire = entry(63, store, script=PROBE, args=["net", *node_services], world_size=2)
            wire["span"] = {"nodes": 2, "node_rank": k, "first_rank": k, "ranks": 1, "job_devices": 2,
                            "leader": "w0", "rendezvous": str(rendezvous)}
            node.reconcile([wire])
        reports = [outcome(node, 63) for node in nodes]
        specs = [json.loads(next((node.work_dir / "j").glob("63.*/sandbox.json")).read_text()) for node in nodes]
    finally:
        for node in nodes:
            node.kill_all()
    for k, report in enumerate(reports):
        assert specs[k]["network"] == "isolated" and specs[k]["job_addresses"] == ["100.64.15.192", "100.64.15.193"]
        if not netns.node_forwards():
            assert report["state"] == "failed", report
            assert "this node does not forward IPv4 (net.ipv4.ip_forward is not 1)" in report["error"], report["error"]
            continue
        assert report["state"] == "finished", report.get("error")
        view = probe_report(nodes[k].work_dir / "workspaces" / "job-63" / f"net-rank{k}.json")
        assert view["allreduce"] == 3.0 and view["interfaces"] == ["job0", "lo"]
        assert "connected" not in view["reaches"].values(), view["reaches"]


def test_a_launcher_refuses_an_isolated_network_over_hosts_without_the_jobs_addresses_before_it_enters_one(
        tmp_path, monkeypatch):
    """A spec without an address per host (a hand-written one; an agent always gives them): the
    launch fails saying so, on the node's network it never left."""
    from protocol.launch import SandboxSpec
    from runtime import launcher

    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    (tmp_path / "sandbox.json").write_text(json.dumps(SandboxSpec(unconfined_reason="test",
                                                                  network=JobNetwork.ISOLATED).to_dict()))
    (tmp_path / "noop.py").write_text("pass\n")
    options = launcher.parse_args([
        "--ranks", "2", "--nodes", "2", "--node-rank", "1", "--rendezvous", str(tmp_path / "rdv"),
        "--sandbox", str(tmp_path / "sandbox.json"), "--job-dir", str(tmp_path / "job"), str(tmp_path / "noop.py")])
    before = netns.namespace_id()
    with pytest.raises(launcher.LaunchError, match="over 2 hosts but gives 0 job address"):
        launcher.Launcher(options)
    assert netns.namespace_id() == before  # refused before it entered a namespace
