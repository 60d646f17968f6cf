"""Server time of the portal's fleet page at planet scale (issue 6: under 2 s with 100k
accelerators), on SQLite and on PostgreSQL.

For each backend, in a fresh database: migrate, the demo cast, `fleet_generate` of
4 regions × 8 clusters × 400 nodes × 8 devices = 102,400 accelerators, then a busy
fleet: jobs whose replicas hold about two thirds of the devices, a utilization reading
on every device, 1% of the nodes draining and 1% lost. Then it times the pages through
Django's test client in this process (server time: URL resolution, middleware, queries,
template rendering; no network), as a superuser (sees every team) and as a member:

  fleet page (HTML)   /                 the regions × clusters heatmap, by-type, attention
  fleet live JSON     /?format=json     what the page refetches on every live push
  cluster drill-down  /?cluster=<id>    400 nodes
  node drill-down     /?node=<id>       8 devices

Prints the median and worst of --repeats runs, the queries per request and the response
size (no per-device rows: the HTML stays a few tens of kB whatever the fleet size).

Usage:
  .venv/bin/python bench/portal_fleet_page.py [--backends sqlite,postgres] [--repeats 5]
      [--postgres postgres://postgres@127.0.0.1:5432/meridian_bench_portal]
      [--regions 4 --clusters 8 --nodes 400 --devices 8]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
DEFAULT_POSTGRES = "postgres://postgres@127.0.0.1:5432/meridian_bench_portal"


def child(args):
    """Runs in a subprocess whose DATABASE_URL points at a fresh database; prints JSON rows."""
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django.db.models import F
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from fleet.models import Accelerator, Cluster, Node
    from fleet.services import fleet_generate
    from jobs.demo_cast import cast_create
    from jobs.models import Job, Replica

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # setup speed only
    setup = {}
    started = time.perf_counter()
    call_command("migrate", interactive=False, verbosity=0)
    cast = cast_create()
    setup["migrate_s"] = time.perf_counter() - started
    result = fleet_generate(
        regions=args.regions, clusters=args.clusters, nodes=args.nodes, devices=args.devices,
        accelerator_type="H100-80GB", prefix="bench",
    )
    setup["fleet_generate_s"] = result.seconds

    # A busy fleet: 64-device jobs on two of every three 64-device blocks.
    started = time.perf_counter()
    device_ids = list(Accelerator.objects.order_by("id").values_list("id", flat=True))
    blocks = [device_ids[i:i + 64] for i in range(0, len(device_ids), 64)]
    busy = [block for i, block in enumerate(blocks) if i % 3 != 2 and len(block) == 64]
    jobs = Job.objects.bulk_create(
        [
            Job(name=f"bench-{i}", team=cast.team_a if i % 2 else cast.team_b, submitted_by=cast.alice,
                tier=("premium", "standard", "basic")[i % 3], accelerator_type="H100-80GB", world_size=64,
                min_devices=8, entrypoint="train.py", state="running", device_count=64)
            for i in range(len(busy))
        ],
        batch_size=1000,
    )
    Replica.objects.bulk_create(
        (
            Replica(job_id=job.pk, rank=rank, device_id=device)
            for job, block in zip(jobs, busy)
            for rank, device in enumerate(block)
        ),
        batch_size=5000,
    )
    Accelerator.objects.update(utilization=(F("id") % 97) * 0.01)
    node_ids = list(Node.objects.order_by("id").values_list("id", flat=True))
    Node.objects.filter(id__in=node_ids[::100]).update(state="draining")
    Node.objects.filter(id__in=node_ids[50::100]).update(state="lost")
    setup["load_s"] = time.perf_counter() - started
    setup["accelerators"] = len(device_ids)
    setup["allocated"] = sum(len(b) for b in busy)

    cluster_id = Cluster.objects.order_by("id").values_list("id", flat=True).first()
    node_id = node_ids[1]
    pages = [
        ("fleet page (HTML)", "/"),
        ("fleet live JSON", "/?format=json"),
        ("cluster drill-down", f"/?cluster={cluster_id}"),
        ("node drill-down", f"/?node={node_id}"),
    ]
    rows = []
    for who in (cast.admin, cast.alice):
        client = Client()
        client.force_login(who)
        for label, url in pages:
            client.get(url)  # warm: first-use imports and template compilation
            times, queries, size = [], 0, 0
            for _ in range(args.repeats):
                with CaptureQueriesContext(connection) as captured:
                    started = time.perf_counter()
                    response = client.get(url)
                    times.append(time.perf_counter() - started)
                if response.status_code != 200:
                    raise SystemExit(f"{url} answered {response.status_code}")
                queries, size = len(captured), len(response.content)
            rows.append(
                {"user": who.username, "page": label, "median_s": statistics.median(times), "max_s": max(times),
                 "queries": queries, "bytes": size}
            )
    print("RESULT " + json.dumps({"setup": setup, "rows": rows}))


def run_backend(name, database_url, args):
    with tempfile.TemporaryDirectory(prefix="meridian-bench-") as data_dir:
        env = dict(os.environ, DATABASE_URL=database_url, MERIDIAN_DATA_DIR=data_dir, MERIDIAN_LOG_LEVEL="WARNING",
                   DJANGO_SETTINGS_MODULE="portal.settings")
        command = [sys.executable, __file__, "--child", "--repeats", str(args.repeats),
                   "--regions", str(args.regions), "--clusters", str(args.clusters),
                   "--nodes", str(args.nodes), "--devices", str(args.devices)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
        if result.returncode:
            raise SystemExit(f"{name} run failed:\n{result.stderr[-3000:]}")
        line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])


def postgres_fresh(url):
    import psycopg

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    admin = parsed._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin, name


def postgres_drop(admin, name):
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--postgres", default=os.environ.get("BENCH_POSTGRES_URL", DEFAULT_POSTGRES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=400)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    results = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend == "sqlite":
            with tempfile.TemporaryDirectory(prefix="meridian-bench-db-") as tmp:
                results[backend] = run_backend(backend, f"sqlite:///{tmp}/bench.sqlite3", args)
        elif backend == "postgres":
            admin, name = postgres_fresh(args.postgres)
            try:
                results[backend] = run_backend(backend, args.postgres, args)
            finally:
                postgres_drop(admin, name)
        else:
            raise SystemExit(f"unknown backend {backend!r}; use sqlite and/or postgres")

    print()
    for backend, result in results.items():
        s = result["setup"]
        print(f"{backend}: {s['accelerators']:,} accelerators ({s['allocated']:,} allocated), "
              f"fleet_generate {s['fleet_generate_s']:.1f} s, jobs+telemetry load {s['load_s']:.1f} s")
    print()
    print(f"{'backend':<9} {'user':<6} {'page':<20} {'median ms':>10} {'worst ms':>9} {'queries':>8} {'kB':>7}")
    print("-" * 75)
    for backend, result in results.items():
        for row in result["rows"]:
            print(f"{backend:<9} {row['user']:<6} {row['page']:<20} {row['median_s'] * 1000:>10.0f} "
                  f"{row['max_s'] * 1000:>9.0f} {row['queries']:>8} {row['bytes'] / 1024:>7.1f}")
    worst = max(row["max_s"] for result in results.values() for row in result["rows"])
    print(f"\nworst fleet-page server time: {worst:.2f} s (target: under 2 s)")


if __name__ == "__main__":
    main()
