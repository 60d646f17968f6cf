"""Migration downtime: stop a running job at a consistent cut on node A, resume it on node B.

    .venv/bin/python bench/runtime_migration.py [--ranks 2] [--repeats 3] [--big]

Node A and node B are two job directories on this host sharing one checkpoint store (a shared
filesystem on a fleet); node A's job directory and spool are deleted before node B starts.
Downtime runs from the stop command to the first optimizer step completed on node B. Phases:
cut (request to all ranks at the cut), dump (CRIU images / framework state), commit (store:
sha256 manifest, fsync, rename), restore (node B: copy + verify, restore or re-launch, until the
first step). --big adds a single-process ~100 MB-parameter model (three 2900x2900 layers + Adam).
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "runtime_scripts", "long_train.py")
sys.path.insert(0, ROOT)

from runtime import criu  # noqa: E402
from runtime.control import JobControl, JobControlError  # noqa: E402


def launch(job_dir, job_id, store, ranks, engine, width, resume, env, *, root=ROOT, keep=1):
    """Starts meridian-run of the checkout at `root` (bench/criu_incremental.py runs main's too)."""
    command = [sys.executable, "-m", "runtime.launcher", "--ranks", str(ranks), "--engine", engine,
               "--job-id", job_id, "--job-dir", job_dir, "--store", store, "--keep", str(keep)]
    if resume:
        command.append("--resume")
    script = os.path.join(root, os.path.relpath(SCRIPT, ROOT))
    command += [script, os.path.join(job_dir, "..", "out.pt"), "--width", str(width)]
    return subprocess.Popen(command, cwd=root, env=dict(env, PYTHONPATH=root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def poll(fn, what, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = fn()
        except (JobControlError, OSError):
            value = None
        if value:
            return value
        time.sleep(0.01)
    raise SystemExit(f"timed out waiting for {what}")


def migrate_once(engine, ranks, width, workdir):
    job_id = f"mig-{uuid.uuid4().hex[:8]}"
    spool_root = os.path.join(workdir, "spool")
    env = dict(os.environ, MERIDIAN_SPOOL_ROOT=spool_root)
    store = os.path.join(workdir, job_id, "store")
    node_a = os.path.join(workdir, job_id, "node-a", "job")
    node_b = os.path.join(workdir, job_id, "node-b", "job")
    first = launch(node_a, job_id, store, ranks, engine, width, False, env)
    control_a = JobControl(node_a)
    poll(lambda: control_a.progress()["step"] >= 20, "the job to reach step 20")
    began = time.monotonic()
    answer = control_a.stop()
    stopped_at = time.monotonic()
    if first.wait(timeout=120) != 75:
        raise SystemExit(f"{engine}: node A's launcher did not stop cleanly")
    shutil.rmtree(os.path.dirname(node_a))
    shutil.rmtree(os.path.join(spool_root, job_id), ignore_errors=True)
    second = launch(node_b, job_id, store, ranks, engine, width, True, env)
    control_b = JobControl(node_b)
    try:
        poll(lambda: control_b.progress()["step"] > answer["step"], "the first step on node B")
        resumed_at = time.monotonic()
    finally:
        second.terminate()  # the launcher kills its ranks on SIGTERM
        second.wait(timeout=60)
    return {"cut": answer["seconds"]["cut"], "dump": answer["seconds"]["dump"],
            "commit": answer["seconds"]["commit"], "restore": resumed_at - stopped_at,
            "downtime": resumed_at - began, "bytes": answer["bytes"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--big", action="store_true")
    options = parser.parse_args()
    engines = ["criu", "framework"] if criu.check_available()[0] else ["framework"]
    cases = [(f"small MLP, W={options.ranks}", options.ranks, 64)]
    if options.big:
        cases.append(("~100 MB params, W=1", 1, 2900))
    rows = []
    with tempfile.TemporaryDirectory(prefix="meridian-migrate-") as workdir:
        for label, ranks, width in cases:
            for engine in engines:
                runs = [migrate_once(engine, ranks, width, workdir) for _ in range(options.repeats)]
                rows.append((label, engine, {k: statistics.median(r[k] for r in runs) for k in runs[0]}))
    print(f"\nmigration node A -> node B (same host, shared store), medians of {options.repeats}")
    print(f"{'job':<22} {'engine':<10} {'cut s':>6} {'dump s':>7} {'commit s':>9} "
          f"{'restore s':>10} {'downtime s':>11} {'checkpoint':>11}")
    for label, engine, m in rows:
        print(f"{label:<22} {engine:<10} {m['cut']:6.2f} {m['dump']:7.2f} {m['commit']:9.2f} "
              f"{m['restore']:10.2f} {m['downtime']:11.2f} {m['bytes'] / 1e6:9.1f} MB")


if __name__ == "__main__":
    main()
