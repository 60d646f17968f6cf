"""What the per-job sandbox costs: at launch, at a cut (checkpoint), at a kill; sandbox off, on with
the node's network, on with the job's own network namespace (the default).

    .venv/bin/python bench/sandbox_cost.py [--repeats 3] [--ranks 2] [--engine framework]
    .venv/bin/python bench/sandbox_cost.py --job-network-only [--repeats 5]

Runs examples/train_mlp.py through a real node agent's reconciler (agent/node.py) on a 2-device node,
once with the sandbox enforced (a job uid through setpriv, a cgroup with the cpuset and a memory
limit, the job's environment only, the spool given to its group, framework checkpoints sealed before
the commit) with the node's network (network "host"), once more with its own network namespace
(network "isolated", the default: runtime/netns.py), and once with it off (ranks as root, the same
clean environment). Needs root (the sandbox does). For each repeat:
    prepare     the agent's sandbox work before the launcher starts (cgroup, modes, sandbox.json)
    launch      reconcile() -> the job reports running with step >= 1 (ranks started, torch imported,
                first optimizer step)
    cut         one checkpoint through the control socket: the launcher's own CheckpointSeconds.total
                (with the sandbox: the staging folder given to the ranks, then sealed)
    kill        fence() -> every process of the job gone (the sandbox kills through the cgroup)
    dump        (--engine criu) the engine's part of that checkpoint (CheckpointSeconds.dump: criu
                dumping the ranks, with the sandbox as the job's uid, its private /tmp and /dev/shm
                saved into the checkpoint)
    restore     (--engine criu) a stop, then the same job restored on the same node from it: the
                Restored event's seconds (with the sandbox: new private folders, their contents put
                back, criu restoring as the job's uid, every restored task checked before it runs)
Prints the median of each over the repeats, the ratio on/off and what the network namespace adds
(isolated - host); then the median time to enter a namespace itself (unshare + loopback up, in a
child process), and to make, route and remove one host's part of a job network across hosts
(runtime/netns.py JobNetworkPart, in a child playing the node in a namespace of its own);
--job-network-only prints that last line alone.
"""
import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import json  # noqa: E402

from agent.node import NodeReconciler, pid_alive, read_progress  # noqa: E402
from agent.sandbox import NodeSandbox, SandboxPolicy  # noqa: E402

TRAIN = ROOT / "examples" / "train_mlp.py"


def wait(what, predicate, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise SystemExit(f"timed out waiting for {what}")


def one_run(base, *, mode, network, engine, ranks, job_id):
    work, store = base / f"{mode}-{job_id}", base / "store"
    sandbox = NodeSandbox(SandboxPolicy(mode=mode, uid_base=1_700_000), work_dir=work, node_devices=2,
                          node_cores=tuple(sorted(os.sched_getaffinity(0)))[:2])
    node = NodeReconciler(work, engine=engine, checkpoint_every_s=0, workload_root=ROOT, sandbox=sandbox)
    space = work / "workspaces" / f"job-{job_id}"
    space.mkdir(parents=True)
    entry = {"job_id": job_id, "action": "run", "generation": 1, "world_size": ranks, "devices": 1,
             "device_indices": [0], "entrypoint": str(TRAIN), "env": {},
             "args": ["--out", str(space / "final.pt"), "--epochs", "400", "--step-sleep", "0.01"],
             "store": str(store / f"job-{job_id}" / "g1"), "network": network}
    prepare_s = []
    original = sandbox.prepare

    def timed_prepare(**kwargs):
        began = time.perf_counter()
        try:
            return original(**kwargs)
        finally:
            prepare_s.append(time.perf_counter() - began)

    sandbox.prepare = timed_prepare  # type: ignore[method-assign]
    began = time.perf_counter()
    node.reconcile([entry])
    job = node.jobs[job_id]

    def running():
        progress = read_progress(job.job_dir)
        return progress is not None and progress.step >= 1 and (job.job_dir / "control.sock").exists()
    wait("the job to run", running)
    launch_s = time.perf_counter() - began
    answer = job.control.checkpoint(timeout_s=120)
    cut_s = float(answer["seconds"]["total"])
    measured = {"prepare": prepare_s[0], "launch": launch_s, "cut": cut_s, "dump": float(answer["seconds"]["dump"])}
    if engine == "criu":
        job = restored_copy(node, entry, job)
        measured["restore"] = restored_seconds(job)
    pids = [job.pid, *(read_progress(job.job_dir).rank_pids or ())]
    began = time.perf_counter()
    node.fence([job_id], why="bench")
    wait("the job to be gone", lambda: not any(pid_alive(p) for p in pids))
    measured["kill"] = time.perf_counter() - began
    return measured


def observed(node, job_id):
    return {r.job_id: r.to_dict() for r in node.observed()}.get(job_id) or {}


def restored_copy(node, entry, job):
    """Stops the job at a checkpoint and starts it again on the same node from that checkpoint;
    returns the new copy's job (once its ranks run again)."""
    job_id = entry["job_id"]
    node.reconcile([{"job_id": job_id, "action": "stop", "generation": 1}])
    stopped = wait("the stop", lambda: (r := observed(node, job_id)).get("state") in ("stopped", "failed") and r)
    if stopped["state"] != "stopped":
        raise SystemExit(f"the stop failed: {stopped.get('error')}")
    node.reconcile([{**entry, "generation": 2, "restore_from": stopped["checkpoint"]["uri"],
                     "restore_sha256": stopped["checkpoint"]["sha256"]}])
    fresh = wait("the restored copy", lambda: node.jobs[job_id] is not job and node.jobs[job_id])

    def restored():
        report = observed(node, job_id)
        if report.get("state") == "failed":
            raise SystemExit(f"the restore failed: {report.get('error')}")
        return report.get("state") == "running" and (fresh.job_dir / "control.sock").exists()
    wait("the restored copy to run", restored)
    return fresh


def restored_seconds(job):
    """Returns the seconds of the Restored event of `job`'s launcher (events.jsonl)."""
    def event():
        try:
            lines = (job.job_dir / "events.jsonl").read_text().splitlines()
        except OSError:
            return None
        return next((json.loads(line) for line in lines if '"restored"' in line), None)
    return float(wait("the restored event", event)["seconds"])


def _netns_enter_seconds() -> float:
    """Returns how long runtime.netns.enter_isolated_network takes, measured in a forked child (the
    namespace is entered for good, so not in this process)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        from runtime import netns
        began = time.perf_counter()
        netns.enter_isolated_network()
        os.write(write, repr(time.perf_counter() - began).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        seconds = float(answer.read())
    os.waitpid(pid, 0)
    return seconds


def _job_network_seconds() -> dict[str, float]:
    """Returns how long this host's part of a job network across 2 hosts takes to make
    (JobNetworkPart.enter: claim, veth pair, unshare, addresses, static neighbours, routes on both
    sides), to route the other host's part (link_peers) and to remove (leave), measured in a forked
    child that first makes a network namespace of its own to play the node (forwarding on, a veth
    pair standing in for its wire, at 10.99.0.1/24, whose 10.99.0.2 is the other host): nothing of
    the machine's is touched."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        import subprocess

        from protocol.launch import job_part_addresses
        from runtime import netns
        try:
            netns.enter_isolated_network()  # the "node"
            with open(netns.IP_FORWARD, "w") as handle:
                handle.write("1")
            for args in (["link", "add", "d0", "type", "veth", "peer", "name", "d1"],
                         ["addr", "add", "10.99.0.1/24", "dev", "d0"], ["link", "set", "d0", "up"],
                         ["link", "set", "d1", "up"]):
                subprocess.run(["ip", *args], check=True)
            part = netns.JobNetworkPart(addresses=job_part_addresses(job_id=7, nodes=2), node_rank=0)
            began = time.perf_counter()
            part.enter()
            entered = time.perf_counter()
            part.link_peers({0: "10.99.0.1", 1: "10.99.0.2"}, own_node_addr="10.99.0.1")
            linked = time.perf_counter()
            part.leave()
            left = time.perf_counter()
            os.write(write, json.dumps({"enter": entered - began, "link_peers": linked - entered,
                                        "leave": left - linked}).encode())
        except BaseException:  # noqa: BLE001 - the forked child says what failed, then _exits
            import traceback
            traceback.print_exc()
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        seconds = json.loads(answer.read())
    os.waitpid(pid, 0)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--engine", default="framework", choices=["framework", "criu"])
    parser.add_argument("--job-network-only", action="store_true",
                        help="only time one host's part of a job network across hosts")
    options = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the sandbox needs root; run this as root")
    if options.job_network_only:
        print_job_network_cost(max(5, options.repeats))
        return
    configs = {"off": ("off", "host"), "host": ("enforce", "host"), "isolated": ("enforce", "isolated")}
    results = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="sbx-bench-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o711)
        base = pathlib.Path(tmp)
        job_id = 500
        for _ in range(options.repeats):
            for name, (mode, network) in configs.items():  # interleaved: the machine's load drifts
                job_id += 1
                results[name].append(one_run(base, mode=mode, network=network, engine=options.engine,
                                             ranks=options.ranks, job_id=job_id))
    print(f"sandbox cost: W={options.ranks} on 1 CPU device, engine {options.engine}, "
          f"median of {options.repeats} (seconds); load average {os.getloadavg()[0]:.2f}")
    print(f"{'phase':<10} {'sandbox off':>12} {'on, host net':>13} {'on, own netns':>14} {'on / off':>9} "
          f"{'netns - host':>13}")
    for phase in ("prepare", "launch", "cut", "dump", *(("restore",) if options.engine == "criu" else ()), "kill"):
        off, host, isolated = (statistics.median(r[phase] for r in results[name]) for name in configs)
        print(f"{phase:<10} {off:>12.4f} {host:>13.4f} {isolated:>14.4f} "
              f"{isolated / off if off else float('nan'):>9.2f} {isolated - host:>+13.4f}")
    entering = statistics.median(_netns_enter_seconds() for _ in range(max(5, options.repeats)))
    print(f"entering a network namespace (unshare + lo up, runtime/netns.py): {entering * 1000:.2f} ms, "
          f"median of {max(5, options.repeats)}")
    print_job_network_cost(max(5, options.repeats))


def print_job_network_cost(repeats):
    """Prints the median cost of one host's part of a job network across hosts (_job_network_seconds)."""
    runs = [_job_network_seconds() for _ in range(repeats)]
    print(f"a job network across hosts, one host's part (runtime/netns.py JobNetworkPart), median of {repeats}, "
          f"load average {os.getloadavg()[0]:.2f}: " + ", ".join(
              f"{step} {statistics.median(r[step] for r in runs) * 1000:.1f} ms" for step in runs[0]))


if __name__ == "__main__":
    main()
