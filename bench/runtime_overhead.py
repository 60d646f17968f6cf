"""Per-step overhead of meridian-run (virtual group + consistent-cut barrier) vs plain torch.

    .venv/bin/python bench/runtime_overhead.py [--ranks 2] [--steps 300] [--repeats 5]
                                               [--fold-devices 4,2,1]

Runs the same DDP script (bench/runtime_scripts/timed_ddp.py, a 3x512 MLP, Adam) W ways:
plain torch (W processes, gloo, torchrun-style env, one intra-op thread each; unpinned, and
pinned one core per rank as meridian-run pins them), and under meridian-run with each engine
(virtual group, consistent-cut flags every step, framework tracker). Prints the median wall and
CPU time per step over the steady state (first 20% of steps dropped), the median over repeats,
and the overhead vs plain torch pinned the same way. --fold-devices adds meridian-run rows folded
(--fold, framework engine) onto each of those device counts (runtime/fold.py): ranks sharing a
device then share its cores and take turns, so those rows measure splicing plus the fold.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "runtime_scripts", "timed_ddp.py")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_plain(ranks, out, script_args, pinned=False, script=SCRIPT, store_port=None):
    port = store_port or free_port()
    cores = sorted(os.sched_getaffinity(0))
    processes = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        command = [sys.executable, script, out] + script_args
        if pinned:  # the same placement meridian-run gives rank r with --devices W
            command = ["taskset", "-c", str(cores[rank % len(cores)])] + command
        processes.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in processes]
    if any(codes):
        raise SystemExit(f"plain torch run failed: exit codes {codes}")


def run_meridian(ranks, out, script_args, engine, workdir, fold_devices=None):
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, MERIDIAN_SPOOL_ROOT=os.path.join(workdir, "spool"))
    fold = [] if fold_devices is None else ["--fold", "--devices", str(fold_devices)]
    code = subprocess.call([sys.executable, "-m", "runtime.launcher", "--ranks", str(ranks),
                            "--engine", engine, "--job-id", job_id, *fold,
                            "--job-dir", os.path.join(workdir, job_id), SCRIPT, out] + script_args,
                           cwd=ROOT, env=env)
    if code:
        raise SystemExit(f"meridian-run ({engine}) failed with exit code {code}")


def steady_median(out):
    """Returns (wall, cpu) medians per step over the steady state (first 20% dropped)."""
    with open(out) as handle:
        record = json.load(handle)
    wall, cpu = record["step_s"], record["cpu_s"]
    return statistics.median(wall[len(wall) // 5:]), statistics.median(cpu[len(cpu) // 5:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--engines", default="framework,criu")
    parser.add_argument("--fold-devices", default="", help="e.g. 4,2,1: folded rows on that many devices")
    options = parser.parse_args()
    script_args = ["--steps", str(options.steps), "--width", str(options.width)]
    sys.path.insert(0, ROOT)
    from runtime import criu
    engines = [e for e in options.engines.split(",") if e]
    if "criu" in engines and not criu.check_available()[0]:
        print(f"(criu row skipped: {criu.check_available()[1]})")
        engines.remove("criu")
    variants = ["plain torch (gloo)", "plain torch, pinned like meridian"] + \
        [f"meridian-run, {e} engine" for e in engines] + \
        [f"meridian-run folded, {d} device(s)" for d in options.fold_devices.split(",") if d.strip()]
    results = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="meridian-bench-") as workdir:
        for repeat in range(options.repeats):
            # Interleave variants so drift in machine load hits all of them alike.
            for variant in variants:
                out = os.path.join(workdir, f"out-{repeat}-{len(results[variant])}-{variant[:5]}.json")
                if variant.startswith("plain"):
                    run_plain(options.ranks, out, script_args, pinned="pinned" in variant)
                elif variant.startswith("meridian-run folded"):
                    run_meridian(options.ranks, out, script_args, "framework", workdir,
                                 fold_devices=int(variant.split(", ")[1].split()[0]))
                else:
                    run_meridian(options.ranks, out, script_args, variant.split(", ")[1].split()[0],
                                 workdir)
                results[variant].append(steady_median(out))
    # The fair baseline is plain torch pinned as meridian-run pins its ranks (one core each).
    base = [statistics.median(v[i] for v in results[variants[1]]) for i in (0, 1)]
    print(f"\nW={options.ranks} ranks, 3x{options.width} MLP + Adam, {options.steps} steps, "
          f"{options.repeats} repeats; median of per-run steady-state medians; load average "
          f"{os.getloadavg()[0]:.1f}. CPU = the rank process's CPU time per step (all threads): "
          f"the figure that machine load disturbs least.")
    print(f"{'variant':<34} {'wall ms':>8} {'min':>7} {'max':>7} {'overhead':>8} "
          f"{'CPU ms':>7} {'overhead':>8}")
    for variant in variants:
        walls = [v[0] for v in results[variant]]
        cpus = [v[1] for v in results[variant]]
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        print(f"{variant:<34} {wall * 1e3:8.3f} {min(walls) * 1e3:7.2f} {max(walls) * 1e3:7.2f} "
              f"{100 * (wall / base[0] - 1):7.1f}% {cpu * 1e3:7.3f} {100 * (cpu / base[1] - 1):7.1f}%")

    micro(options)


def micro(options):
    """Second table: the collectives alone, interleaved inside the same processes."""
    import torch.distributed as dist
    floats = sum(p for p in [64 * options.width + options.width, 2 * (options.width ** 2 + options.width),
                             options.width + 1])
    server = dist.TCPStore("127.0.0.1", 0, options.ranks, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="meridian-micro-") as workdir:
        out = os.path.join(workdir, "micro.json")
        run_plain(options.ranks, out, ["--floats", str(floats), "--iters", "300"],
                  script=os.path.join(ROOT, "bench", "runtime_scripts", "collective_micro.py"),
                  store_port=server.port)
        with open(out) as handle:
            medians = json.load(handle)
    print(f"\ncollectives alone, W={options.ranks}, one DDP bucket of {floats} float32 "
          f"(the MLP's gradients), 300 interleaved iterations, medians")
    print(f"{'collective':<34} {'ms':>8}")
    for name, seconds in medians.items():
        print(f"{name:<34} {seconds * 1e3:8.3f}")


if __name__ == "__main__":
    main()
