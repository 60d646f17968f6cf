"""Replica splicing overhead: W ranks time-sliced on fewer devices vs the ideal serial time.

    .venv/bin/python bench/runtime_splicing.py [--steps 150] [--repeats 3] [--width 512]

Each job of W ranks runs on d_ref = the largest divisor of W that is at most the core count cores
(the launcher under `taskset -c 0..d-1`, so device k is core k) and is then spliced onto fewer
devices d (W/d ranks per device = core, taking turns). Splicing overhead, as Singularity defines
it, is the spliced step time over the time-slicing ideal (d_ref / d) x the step time on d_ref
devices: what time-slicing itself costs (token hand-overs, context switches, caches), with the
job's own communication in both. The table also gives the stricter compute-only ideal (W/d x one
rank alone, no communication), which charges the spliced job for the collectives as well.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "runtime_scripts", "timed_ddp.py")


def run(ranks, devices, out, script_args, workdir, cores):
    """Returns (wall, cpu) steady-state medians per step of rank 0 (its CPU time, all threads)."""
    job_id = f"splice-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, MERIDIAN_SPOOL_ROOT=os.path.join(workdir, "spool"))
    code = subprocess.call(["taskset", "-c", cores, sys.executable, "-m", "runtime.launcher",
                            "--ranks", str(ranks), "--devices", str(devices),
                            "--engine", "framework", "--job-id", job_id,
                            "--job-dir", os.path.join(workdir, job_id), SCRIPT, out] + script_args,
                           cwd=ROOT, env=env)
    if code:
        raise SystemExit(f"meridian-run W={ranks} d={devices} failed with exit code {code}")
    with open(out) as handle:
        record = json.load(handle)
    wall, cpu = record["step_s"], record["cpu_s"]
    return statistics.median(wall[len(wall) // 5:]), statistics.median(cpu[len(cpu) // 5:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--ranks", default="2,4")
    options = parser.parse_args()
    script_args = ["--steps", str(options.steps), "--width", str(options.width)]
    cores = sorted(os.sched_getaffinity(0))
    layouts = [(1, 1, "0")]
    for ranks in (int(r) for r in options.ranks.split(",")):
        reference = max(d for d in range(1, min(ranks, len(cores)) + 1) if ranks % d == 0)
        # A device is one core: d devices = the first d cores (the launcher under taskset).
        layouts += [(ranks, d, ",".join(str(c) for c in cores[:d]))
                    for d in range(reference, 0, -1) if ranks % d == 0]
    results = {layout: [] for layout in layouts}
    with tempfile.TemporaryDirectory(prefix="meridian-splice-") as workdir:
        for repeat in range(options.repeats):
            for ranks, devices, pool in layouts:  # interleaved: load drift hits all alike
                out = os.path.join(workdir, f"{repeat}-{ranks}-{devices}.json")
                results[(ranks, devices, pool)].append(
                    run(ranks, devices, out, script_args, workdir, pool))

    def medians(layout):
        values = results[layout]
        return statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)

    single_wall, single_cpu = medians(layouts[0])
    print(f"\n3x{options.width} MLP + Adam, {options.steps} steps, {options.repeats} repeats, "
          f"medians of steady-state per-step medians; load average {os.getloadavg()[0]:.1f}")
    print("time-slicing ideal = (d_ref / d) x the step time of the same job on d_ref devices of one "
          "core each (what the job does, communication included, run k times slower);\n"
          "compute-only ideal = W / d x one rank alone with no communication at all.")
    print(f"{'W':>3} {'d':>3} {'cores':>6} {'wall ms':>9} {'time-slicing':>13} {'overhead':>9} "
          f"{'compute-only':>13} {'overhead':>9} {'CPU ms':>8}")
    reference_of = {}
    for ranks, devices, pool in layouts:
        wall, cpu = medians((ranks, devices, pool))
        reference_of.setdefault(ranks, (devices, wall))
        ref_devices, ref_wall = reference_of[ranks]
        slicing_ideal = ref_wall * ref_devices / devices
        compute_ideal = single_wall * ranks / devices
        print(f"{ranks:>3} {devices:>3} {pool:>6} {wall * 1e3:9.3f} {slicing_ideal * 1e3:13.3f} "
              f"{100 * (wall / slicing_ideal - 1):8.1f}% {compute_ideal * 1e3:13.3f} "
              f"{100 * (wall / compute_ideal - 1):8.1f}% {cpu * 1e3:8.3f}")


if __name__ == "__main__":
    main()
