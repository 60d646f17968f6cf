"""Replica splicing overhead: W ranks time-sliced on fewer devices vs the ideal serial time.

    .venv/bin/python bench/runtime_splicing.py [--steps 150] [--repeats 3] [--width 512]

Device 0 is core 0 (the launcher runs under `taskset -c 0`, so a one-device map is that core).
The ideal serial time of W ranks on one device is W x the step time of one rank alone on it
(same model, same batch: the work a rank does per step). Splicing overhead is the spliced step
time (rank 0's wall time per optimizer step, which includes every other rank's turn and the
collectives) over that ideal.
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


def run(ranks, devices, out, script_args, workdir, cores="0"):
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
        times = json.load(handle)["step_s"]
    return statistics.median(times[len(times) // 5:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    options = parser.parse_args()
    script_args = ["--steps", str(options.steps), "--width", str(options.width)]
    layouts = [(1, 1), (2, 1), (4, 1)]
    results = {layout: [] for layout in layouts}
    with tempfile.TemporaryDirectory(prefix="meridian-splice-") as workdir:
        for repeat in range(options.repeats):
            for ranks, devices in layouts:
                out = os.path.join(workdir, f"{repeat}-{ranks}-{devices}.json")
                results[(ranks, devices)].append(run(ranks, devices, out, script_args, workdir))
    single = statistics.median(results[(1, 1)])
    print(f"\n3x{options.width} MLP + Adam, {options.steps} steps, {options.repeats} repeats, "
          f"device 0 = core 0; medians of steady-state per-step medians")
    print(f"{'ranks W':>7} {'devices':>7} {'ms/step':>9} {'ideal serial':>13} {'overhead':>9}")
    for (ranks, devices), values in results.items():
        measured = statistics.median(values)
        ideal = single * ranks / devices
        print(f"{ranks:>7} {devices:>7} {measured * 1e3:9.3f} {ideal * 1e3:13.3f} "
              f"{100 * (measured / ideal - 1):8.1f}%")


if __name__ == "__main__":
    main()
