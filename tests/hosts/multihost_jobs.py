"""Runs one meridian-run job over several emulated hosts (one launcher per host)."""
import json
import os
import subprocess
import sys
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_env(extra=None):
    """The environment a launcher gets on an emulated host: ours without Meridian's own settings
    (each host has its own spool root, /run/meridian, on its private /run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    env["PYTHONPATH"] = REPO
    env.update(extra or {})
    return env


def start_job(hosts, *, ranks, script, args, engine="framework", job_id=None, launcher_args=(),
              only_nodes=None, env=None, node_args=None):
    """Starts meridian-run on each of `hosts` (node rank = position; `only_nodes`: just those;
    `env`: more environment for the launchers and their ranks; `node_args`: {node rank: more
    launcher arguments for that node only}); returns (job id, Popens)."""
    job_id = job_id or f"mh-{uuid.uuid4().hex[:8]}"
    rendezvous = os.path.join(hosts[0].store, "rendezvous")
    processes = []
    for node_rank, host in enumerate(hosts):
        if only_nodes is not None and node_rank not in only_nodes:
            continue
        command = [sys.executable, "-m", "runtime.launcher", "--ranks", str(ranks), "--engine", engine,
                   "--nodes", str(len(hosts)), "--node-rank", str(node_rank), "--node-addr", host.address,
                   "--rendezvous", rendezvous, "--job-id", job_id,
                   "--job-dir", f"{host.node_dir}/jobs/{job_id}", *launcher_args,
                   *(node_args or {}).get(node_rank, ()), script, *args]
        processes.append(host.popen(command, env=host_env(env), cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
    return job_id, processes


def job_network_sandbox_args(cluster, *, uid, nodes=2, job_number=4242):
    """Returns the launcher arguments of a sandboxed job (what a node agent gives: runtime/sandbox.py),
    its spec in the shared store: uid and gid `uid`, an isolated network over its `nodes` hosts (the
    addresses an agent gives job `job_number`: runtime/netns.py JobNetworkPart), no cgroup (the
    emulated hosts' own is a v1 freezer). Job uids are given the way to the interpreter first."""
    from job_uids import reach_for_job_uids

    from protocol.launch import SandboxSpec, job_part_addresses
    from protocol.states import JobNetwork
    # Without it criu, as the job's uid, cannot stat the rank's mapped interpreter (under /root,
    # 0700, on this project's machines): the tests passed only after a tests/sandbox test had run.
    reach_for_job_uids()
    path = os.path.join(cluster.store_dir, f"sandbox-{uid}.json")
    spec = SandboxSpec(uid=uid, gid=uid, network=JobNetwork.ISOLATED,
                       job_addresses=job_part_addresses(job_id=job_number, nodes=nodes))
    with open(path, "w") as handle:
        json.dump(spec.to_dict(), handle)
    os.chmod(path, 0o600)
    return ("--sandbox", f"{cluster[0].store}/sandbox-{uid}.json")


def wait_job(processes, timeout=600):
    """Waits for every launcher; returns [(exit code, output)]."""
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            output += "\n(timed out)"
        results.append((process.returncode, output))
    return results


def rank_log(host, job_id, rank):
    """Returns a rank's output from its host's job directory (copied there at the launcher's exit)."""
    result = host.run(["cat", f"{host.node_dir}/jobs/{job_id}/logs/rank{rank}.log"], check=False)
    return result.stdout


def assert_equal_states(expected, actual):
    """Parameters and optimizer state (a {"params", "optimizer"} dict as the test scripts save
    them) are torch.equal, element for element."""
    import torch

    for name, tensor in expected["params"].items():
        assert torch.equal(tensor, actual["params"][name]), name
    for index, per_param in expected["optimizer"]["state"].items():
        for key, value in per_param.items():
            assert torch.equal(value, actual["optimizer"]["state"][index][key]), (index, key)
