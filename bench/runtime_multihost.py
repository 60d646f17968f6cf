"""Per-step cost of meridian-run across emulated hosts vs plain DDP over gloo across the same hosts.

    sudo .venv/bin/python bench/runtime_multihost.py [--ranks 8] [--hosts 2,4] [--steps 150] [--repeats 3]

Starts emulated hosts (tests/hosts/emulated_hosts.py: own network, mount and PID namespaces, a bridge
between them; root only) and runs bench/runtime_scripts/timed_ddp.py (a 3x<width> MLP, Adam) as W
ranks spread evenly over H hosts, two ways:
- plain torch: W processes, torchrun-style env, gloo over the hosts' addresses
  (GLOO_SOCKET_IFNAME=eth0), one intra-op thread, pinned one core per rank as meridian-run pins
  them (rank r on core r mod cores);
- meridian-run, framework engine: one launcher per host (--nodes H), the virtual group's
  rank-order reduction over gloo between hosts, the consistent-cut flags every step.
Prints the same table as bench/runtime_overhead.py: the median wall and CPU time per step over
the steady state (first 20% of steps dropped), the median over repeats, and the overhead vs plain.
Every emulated host runs on this one machine's cores, so W ranks share its cores whatever H is.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "hosts"))

import emulated_hosts as harness  # noqa: E402 - from tests/hosts, put on sys.path above
from multihost_jobs import host_env, start_job, wait_job  # noqa: E402

SCRIPT = os.path.join(ROOT, "bench", "runtime_scripts", "timed_ddp.py")
FREE_PORT = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[1])"


def run_plain(cluster, hosts, ranks, out, script_args):
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
                        "GLOO_SOCKET_IFNAME": "eth0"})
        command = ["taskset", "-c", str(cores[rank % len(cores)]), sys.executable, SCRIPT, out, *script_args]
        processes.append(host.popen(command, env=env))
    codes = [p.wait() for p in processes]
    if any(codes):
        raise SystemExit(f"plain torch run on {hosts} hosts failed: exit codes {codes}")


def run_meridian(cluster, hosts, ranks, out, script_args):
    _, processes = start_job(cluster.hosts[:hosts], ranks=ranks, script=SCRIPT, args=[out, *script_args])
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
    options = parser.parse_args()
    reason = harness.skip_reason()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    host_counts = [int(h) for h in options.hosts.split(",")]
    script_args = ["--steps", str(options.steps), "--width", str(options.width)]
    variants = [(h, kind) for h in host_counts for kind in ("plain torch (gloo), pinned", "meridian-run, framework")]
    results = {v: [] for v in variants}
    with harness.EmulatedHosts(max(host_counts)) as cluster:
        for repeat in range(options.repeats):
            for variant in variants:  # interleaved, so drift in machine load hits all alike
                hosts, kind = variant
                name = f"out-{repeat}-{hosts}-{kind[:5]}.json"
                inside = os.path.join(cluster[0].store, name)
                runner = run_plain if kind.startswith("plain") else run_meridian
                runner(cluster, hosts, options.ranks, inside, script_args)
                results[variant].append(steady_median(os.path.join(cluster.store_dir, name)))
    print(f"\nW={options.ranks} ranks over emulated hosts, 3x{options.width} MLP + Adam, {options.steps} steps, "
          f"{options.repeats} repeats; median of per-run steady-state medians; load average "
          f"{os.getloadavg()[0]:.1f}; {len(os.sched_getaffinity(0))} cores shared by every host. CPU = the rank "
          f"process's CPU time per step (all threads).")
    print(f"{'variant':<34} {'wall ms':>8} {'min':>7} {'max':>7} {'overhead':>8} "
          f"{'CPU ms':>7} {'overhead':>8}")
    for hosts in host_counts:
        base = [statistics.median(v[i] for v in results[(hosts, variants[0][1])]) for i in (0, 1)]
        for variant in [v for v in variants if v[0] == hosts]:
            walls = [v[0] for v in results[variant]]
            cpus = [v[1] for v in results[variant]]
            wall, cpu = statistics.median(walls), statistics.median(cpus)
            label = f"{variant[1]}, {hosts} hosts"
            print(f"{label:<34} {wall * 1e3:8.3f} {min(walls) * 1e3:7.2f} {max(walls) * 1e3:7.2f} "
                  f"{100 * (wall / base[0] - 1):7.1f}% {cpu * 1e3:7.3f} {100 * (cpu / base[1] - 1):7.1f}%")


if __name__ == "__main__":
    main()
