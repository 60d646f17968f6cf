"""CRIU checkpoint bytes and stop -> resume downtime: today's runtime vs this checkout's.

    .venv/bin/python bench/criu_incremental.py [--ranks 1] [--repeats 3] [--baseline /work/main]

For each runtime (the checkout at --baseline, e.g. main: every checkpoint stores the whole CRIU
images; this checkout: pages deduplicated against a base checkpoint, runtime/criu_pages.py) a
small-MLP job (bench/runtime_scripts/long_train.py, width 64) is started; once at step 10 it takes
two checkpoints (the first and the next) and is stopped; a second launcher resumes it from the
same store in another job directory. Bytes are what the store holds for each checkpoint itself
(a deduplicated one also needs its base, the first). Downtime runs from the stop command to the
first optimizer step after the resume; "resume s" is the part from the old launcher's exit
(a new launcher process, verify, rebuild, restore, first step), of which "launcher" is the new
launcher's start until its restore begins (Python, imports, verification) and "restore" the
engine's restore (rebuilding the images, criu restore). Prints medians; note the load.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from runtime_migration import launch as launch_any  # noqa: E402
from runtime_migration import poll  # noqa: E402

from runtime.control import JobControl  # noqa: E402


def launch(root, job_dir, job_id, store, ranks, resume, env):
    return launch_any(job_dir, job_id, store, ranks, "criu", 64, resume, env, root=root, keep=2)


def once(root, ranks, workdir):
    job_id = f"inc-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, MERIDIAN_SPOOL_ROOT=os.path.join(workdir, "spool"))
    store = os.path.join(workdir, job_id, "store")
    node_a = os.path.join(workdir, job_id, "node-a", "job")
    node_b = os.path.join(workdir, job_id, "node-b", "job")
    first = launch(root, node_a, job_id, store, ranks, False, env)
    control_a = JobControl(node_a)
    try:
        poll(lambda: control_a.progress()["step"] >= 10, "the job to reach step 10")
        full = control_a.checkpoint()
        after = control_a.checkpoint()
        began = time.monotonic()
        stopped = control_a.stop()
        if first.wait(timeout=300) != 75:
            raise SystemExit(f"{root}: the launcher did not stop cleanly")
    finally:
        if first.poll() is None:
            first.terminate()
            first.wait(timeout=60)
    exited = time.monotonic()
    exited_unix = time.time()
    shutil.rmtree(os.path.dirname(node_a))
    second = launch(root, node_b, job_id, store, ranks, True, env)
    control_b = JobControl(node_b)
    try:
        poll(lambda: control_b.progress()["step"] > stopped["step"], "the first step after the resume")
        resumed = time.monotonic()
    finally:
        second.terminate()  # the launcher kills its ranks on SIGTERM
        second.wait(timeout=60)
    restored = [json.loads(line) for line in open(os.path.join(node_b, "events.jsonl"))
                if '"restored"' in line][0]
    shutil.rmtree(os.path.join(workdir, job_id), ignore_errors=True)
    return {"launch_s": restored["time_unix"] - restored["seconds"] - exited_unix,
            "restore_s": restored["seconds"], "first": full["bytes"], "next": after["bytes"], "stop": stopped["bytes"],
            "stop_s": stopped["seconds"]["total"], "resume_s": resumed - exited,
            "downtime": resumed - began}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default="/work/main",
                        help="checkout of today's runtime (skipped when it is missing)")
    options = parser.parse_args()
    roots = [("today", options.baseline)] if os.path.isdir(options.baseline) else []
    roots.append(("new", ROOT))
    rows = []
    with tempfile.TemporaryDirectory(prefix="meridian-criu-inc-") as workdir:
        for label, root in roots:
            runs = [once(root, options.ranks, workdir) for _ in range(options.repeats)]
            rows.append((label, {k: statistics.median(r[k] for r in runs) for k in runs[0]}))
    load = os.getloadavg()[0]
    print(f"\nCRIU checkpoints of a small MLP, W={options.ranks}, medians of {options.repeats} "
          f"(load average now {load:.1f} on {os.cpu_count()} cores)")
    print(f"{'runtime':<8} {'first MB':>9} {'next MB':>8} {'stop MB':>8} {'next/first':>11} "
          f"{'stop s':>7} {'resume s':>9} {'(launcher':>10} {'restore)':>9} {'downtime s':>11}")
    for label, m in rows:
        print(f"{label:<8} {m['first'] / 1e6:9.1f} {m['next'] / 1e6:8.2f} {m['stop'] / 1e6:8.2f} "
              f"{m['next'] / m['first']:11.3f} {m['stop_s']:7.2f} {m['resume_s']:9.2f} {m['launch_s']:10.2f} "
              f"{m['restore_s']:9.2f} {m['downtime']:11.2f}")
    if len(rows) == 2:
        today, new = rows[0][1], rows[1][1]
        print(f"new/today: next checkpoint bytes {new['next'] / today['next']:.3f}, "
              f"downtime {new['downtime'] / today['downtime']:.2f}")


if __name__ == "__main__":
    main()
