"""The first placement tick at scale on PostgreSQL: every waiting job starts (the heaviest apply).

    .venv/bin/python bench/placement_tick.py [--sizes 100000,1000000] [--against REV] [--repeats 1]
        [--db postgres://postgres@127.0.0.1:5432/meridian_bench_place]

Per size, on a fresh database (tables emptied): the synthetic fleet and jobs of
bench/control_plane.py (8 H100 per node, 2 regions; jobs of W in {1,2,4,8} filling ~95% of the
fleet, half elastic; not timed), then ANALYZE and a CHECKPOINT, then one tick_run - timed:
  - wall seconds, and the tick's phases (snapshot / plan / apply);
  - client CPU: this process's user+system seconds (the web/beat process doing the tick);
  - db CPU: the PostgreSQL backend's user+system seconds (from /proc: server and bench share the
    machine), so that the work is comparable when the shared machine is busy; on an idle machine
    wall ~ client CPU + db CPU + the commit's flush.
--against REV runs the same rows with the code of git revision REV (a `git archive` in a temp
folder, same interpreter), for before/after ratios on the same machine. It gets a database of its
own (the --db name + "_against"): a migration of this tree (a constraint dropped, say) stays out of
the old code's schema, which its own migrate would not undo.
The 1M row needs ~2 GB of RAM and several minutes of set-up.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/meridian_bench_place"


def one_size(n: int, db: str, seed: int) -> dict:
    """Runs in a child process whose sys.path starts at the code under test."""
    import control_plane as cp
    import numpy as np

    class Args:
        pass

    args = Args()
    args.db, args.redis = db, os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/9")
    cp.ensure_database(db)
    cp.setup_django(args, tempfile.mkdtemp(prefix="placement-"))
    from django.db import connection
    from django.utils import timezone

    from jobs.tick import tick_run

    cp.reset_tables()
    _, jobs = cp.build_fleet_and_jobs(n, np.random.default_rng(seed))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
        cursor.execute("CHECKPOINT")
        cursor.execute("select pg_backend_pid()")
        backend = cursor.fetchone()[0]

    def backend_cpu() -> float:
        fields = pathlib.Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    load_before = os.getloadavg()[0]
    before_rows = cp.db_rows_written()
    began, cpu, db_cpu = time.perf_counter(), time.process_time(), backend_cpu()
    result = tick_run(now=timezone.now())
    wall, cpu, db_cpu = time.perf_counter() - began, time.process_time() - cpu, backend_cpu() - db_cpu
    rows = cp.stats_settled(before_rows)
    cp.reset_tables()
    return {"n": n, "jobs": jobs, "started": result.counts.get("start", 0), "wall": wall, "client_cpu": cpu,
            "db_cpu": db_cpu, "rows": rows, "phases": result.seconds,
            "load": (load_before, os.getloadavg()[0])}


def run_child(code_root: pathlib.Path, n: int, args, *, db: str) -> dict:
    script = (f"import sys, json; sys.path[:0] = [{str(code_root)!r}, {str(code_root / 'bench')!r}]; "
              f"import placement_tick as p; print('RESULT ' + json.dumps(p.one_size({n}, {db!r}, {args.seed})))")
    env = dict(os.environ, PYTHONPATH=str(code_root), MERIDIAN_LOG_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", script], cwd=code_root, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"the run at {n} accelerators failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100000")
    p.add_argument("--db", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DB))
    p.add_argument("--against", help="also run the code of this git revision (before/after)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    codes = [("this tree", ROOT)]
    if args.against:
        old = pathlib.Path(tempfile.mkdtemp(prefix="placement-against-"))
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        if not (old / "bench" / "placement_tick.py").exists():  # an older tree: measure it with this script
            (old / "bench" / "placement_tick.py").write_text(pathlib.Path(__file__).read_text())
        codes.append((args.against, old))
    print(f"{'code':>12} {'accel':>8} {'jobs':>7} {'started':>7} | {'wall s':>7} {'snap':>5} {'plan':>5} "
          f"{'apply':>6} | {'client CPU s':>12} {'db CPU s':>8} {'CPU sum':>7} | {'rows':>8} | load")
    for n in [int(s) for s in args.sizes.split(",")]:
        for _ in range(args.repeats):
            for name, root in codes:
                r = run_child(root, n, args, db=args.db if root == ROOT else f"{args.db}_against")
                ph = r["phases"]
                print(f"{name[:12]:>12} {r['n']:>8} {r['jobs']:>7} {r['started']:>7} | {r['wall']:>7.2f} "
                      f"{ph['snapshot']:>5.2f} {ph['plan']:>5.2f} {ph['apply']:>6.2f} | {r['client_cpu']:>12.2f} "
                      f"{r['db_cpu']:>8.2f} {r['client_cpu'] + r['db_cpu']:>7.2f} | {r['rows']:>8} | "
                      f"{r['load'][0]:.1f}->{r['load'][1]:.1f}", flush=True)


if __name__ == "__main__":
    main()
