"""Per-step cost of meridian-run across emulated hosts vs plain DDP over gloo across the same hosts.

    sudo .venv/bin/python bench/runtime_multihost.py [--ranks 8] [--hosts 2,4] [--steps 150] [--repeats 3]
        [--flat] [--micro]

Starts emulated hosts (tests/hosts/emulated_hosts.py: own network, mount and PID namespaces, a bridge
between them; root only) and runs bench/runtime_scripts/timed_ddp.py (a 3x<width> MLP, Adam) as W
ranks spread evenly over H hosts, two ways:
- plain torch: W processes, torchrun-style env, gloo over the hosts' addresses
  (GLOO_SOCKET_IFNAME=eth0), one intra-op thread, pinned one core per rank as meridian-run pins
  them (rank r on core r mod cores);
- meridian-run, framework engine: one launcher per host (--nodes H), the virtual group's
  rank-order reduction across hosts (each host's shared area, then the chain between hosts:
  runtime/hostchain.py), the consistent-cut flags every step;
- with --flat, also meridian-run on the flat gloo path (MERIDIAN_VPG_HOST_CHAIN=0: a rank-order
  all-to-all + all-gather over TCP, the flags as one more small all-reduce), the path every
  multi-host job took before the chain;
- with --job-network, also meridian-run sandboxed (a job uid, private /tmp and /dev/shm) on the
  node's network and on the job's own network across hosts (runtime/netns.py JobNetworkPart: the
  hosts' chain and the store over veths routed through each host): their difference is what the
  job network costs per step.
Prints the same table as bench/runtime_overhead.py: the median wall and CPU time per step over
the steady state (first 20% of steps dropped), the median over repeats, and the overhead vs plain.
Every emulated host runs on this one machine's cores, so W ranks share its cores whatever H is.
--micro prints a second table: one step's collectives alone on W ranks over the first host count
(bench/runtime_scripts/multihost_micro.py), each variant interleaved in the same processes.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "hosts"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import emulated_hosts as harness  # noqa: E402 - from tests/hosts, put on sys.path above
from multihost_jobs import host_env, start_job, wait_job  # noqa: E402

SCRIPT = os.path.join(ROOT, "bench", "runtime_scripts", "timed_ddp.py")
MICRO = os.path.join(ROOT, "bench", "runtime_scripts", "multihost_micro.py")
PLAIN = "plain torch (gloo), pinned"
CHAIN = "meridian-run, framework"
FLAT = "meridian-run, flat gloo path"
SANDBOX_HOST = "meridian-run, sandboxed, host net"
SANDBOX_NET = "meridian-run, sandboxed, job net"
JOB_UID = 1_650_200  # the sandboxed variants' uid and gid (no passwd entry needed)
FREE_PORT = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[1])"


def run_plain(cluster, hosts, ranks, out, script_args, script=SCRIPT):
    # Plain torch's env:// needs MASTER_PORT before rank 0 starts: ask host 0's kernel for a
    # free one (its network namespace is its own, so nothing else takes it meanwhile).
    port = cluster[0].run([sys.executable, "-c", FREE_PORT]).stdout.strip()
    cores = sorted(os.sched_getaffinity(0))
    per_host = ranks // hosts
    processes = []
    for rank in range(ranks):
        host = cluster[rank // per_host]
        env = host_env({"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank % per_host),
                        "MASTER_ADDR": cluster[0].address, "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                        "GLOO_SOCKET_IFNAME": "eth0", "MERIDIAN_NODE_ADDR": host.address})
        command = ["taskset", "-c", str(cores[rank % len(cores)]), sys.executable, script, out, *script_args]
        processes.append(host.popen(command, env=env))
    codes = [p.wait() for p in processes]
    if any(codes):
        raise SystemExit(f"plain torch run on {hosts} hosts failed: exit codes {codes}")


def sandbox_args(cluster, hosts, *, job_network):
    """The launcher arguments of a sandboxed run (what an agent gives, runtime/sandbox.py): uid and
    gid JOB_UID, the node's network or the job's own across its `hosts` (runtime/netns.py), no cgroup
    (the emulated hosts' own is a v1 freezer); the spec lies in the shared store."""
    from job_uids import reach_for_job_uids

    from protocol.launch import SandboxSpec, job_part_addresses
    from protocol.states import JobNetwork
    reach_for_job_uids()
    spec = SandboxSpec(uid=JOB_UID, gid=JOB_UID, network=JobNetwork.ISOLATED if job_network else JobNetwork.HOST,
                       job_addresses=job_part_addresses(job_id=77, nodes=hosts) if job_network else ())
    name = f"sandbox-{hosts}-{int(job_network)}.json"
    with open(os.path.join(cluster.store_dir, name), "w") as handle:
        json.dump(spec.to_dict(), handle)
    os.chmod(os.path.join(cluster.store_dir, name), 0o600)
    return ("--sandbox", os.path.join(cluster[0].store, name))


def run_meridian(cluster, hosts, ranks, out, script_args, flat=False, sandbox=()):
    _, processes = start_job(cluster.hosts[:hosts], ranks=ranks, script=SCRIPT, args=[out, *script_args],
                             env={"MERIDIAN_VPG_HOST_CHAIN": "0"} if flat else None, launcher_args=sandbox)
    for node, (code, output) in enumerate(wait_job(processes)):
        if code:
            raise SystemExit(f"meridian-run node {node} of {hosts} failed ({code}):\n{output}")


def steady_median(path):
    with open(path) as handle:
        record = json.load(handle)
    wall, cpu = record["step_s"], record["cpu_s"]
    return statistics.median(wall[len(wall) // 5:]), statistics.median(cpu[len(cpu) // 5:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--flat", action="store_true", help="also run meridian-run on the flat gloo path")
    parser.add_argument("--job-network", action="store_true",
                        help="also run meridian-run sandboxed on the node's network and on the job's own")
    parser.add_argument("--micro", action="store_true", help="then time one step's collectives alone")
    parser.add_argument("--micro-only", action="store_true", help="only the --micro table")
    options = parser.parse_args()
    reason = harness.skip_reason()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    host_counts = [int(h) for h in options.hosts.split(",")]
    script_args = ["--steps", str(options.steps), "--width", str(options.width)]
    kinds = (PLAIN, CHAIN, FLAT) if options.flat else (PLAIN, CHAIN)
    if options.job_network:
        kinds = (*kinds, SANDBOX_HOST, SANDBOX_NET)
    variants = [(h, kind) for h in host_counts for kind in kinds]
    results = {v: [] for v in variants}
    with harness.EmulatedHosts(max(host_counts)) as cluster:
        for repeat in range(options.repeats if not options.micro_only else 0):
            for variant in variants:  # interleaved, so drift in machine load hits all alike
                hosts, kind = variant
                name = f"out-{repeat}-{hosts}-{kinds.index(kind)}.json"
                inside = os.path.join(cluster[0].store, name)
                if kind == PLAIN:
                    run_plain(cluster, hosts, options.ranks, inside, script_args)
                elif kind in (SANDBOX_HOST, SANDBOX_NET):
                    run_meridian(cluster, hosts, options.ranks, inside, script_args,
                                 sandbox=sandbox_args(cluster, hosts, job_network=kind == SANDBOX_NET))
                else:
                    run_meridian(cluster, hosts, options.ranks, inside, script_args, flat=kind == FLAT)
                results[variant].append(steady_median(os.path.join(cluster.store_dir, name)))
        if options.micro or options.micro_only:
            inside = os.path.join(cluster[0].store, "micro.json")
            run_plain(cluster, host_counts[0], options.ranks, inside, ["--iters", "100"], script=MICRO)
            with open(os.path.join(cluster.store_dir, "micro.json")) as handle:
                micro = json.load(handle)
    if not options.micro_only:
        print_table(options, host_counts, variants, results)
    if options.micro or options.micro_only:
        print(f"\none step's collectives alone (DDP's two buckets, 263,169 + 295,936 float32), W={options.ranks} "
              f"over {host_counts[0]} hosts, 100 interleaved iterations, rank 0's medians; load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"{'collectives of one step':<40} {'wall ms':>8} {'CPU ms':>8}")
        for name, value in micro.items():
            if name != "chain":
                print(f"{name:<40} {value[0] * 1e3:8.3f} {value[1] * 1e3:8.3f}")


def print_table(options, host_counts, variants, results):
    print(f"\nW={options.ranks} ranks over emulated hosts, 3x{options.width} MLP + Adam, {options.steps} steps, "
          f"{options.repeats} repeats; median of per-run steady-state medians; load average "
          f"{os.getloadavg()[0]:.1f}; {len(os.sched_getaffinity(0))} cores shared by every host. CPU = the rank "
          f"process's CPU time per step (all threads).")
    print(f"{'variant':<44} {'wall ms':>8} {'min':>7} {'max':>7} {'overhead':>8} "
          f"{'CPU ms':>7} {'overhead':>8}")
    for hosts in host_counts:
        base = [statistics.median(v[i] for v in results[(hosts, PLAIN)]) for i in (0, 1)]
        for variant in [v for v in variants if v[0] == hosts]:
            walls = [v[0] for v in results[variant]]
            cpus = [v[1] for v in results[variant]]
            wall, cpu = statistics.median(walls), statistics.median(cpus)
            label = f"{variant[1]}, {hosts} hosts"
            print(f"{label:<44} {wall * 1e3:8.3f} {min(walls) * 1e3:7.2f} {max(walls) * 1e3:7.2f} "
                  f"{100 * (wall / base[0] - 1):7.1f}% {cpu * 1e3:7.3f} {100 * (cpu / base[1] - 1):7.1f}%")


if __name__ == "__main__":
    main()
