"""The control loop at scale: hollow agents for 10k and 100k accelerators against PostgreSQL + Redis.

    .venv/bin/python bench/control_plane.py [--sizes 10000,100000]
        [--db postgres://postgres@127.0.0.1:5432/meridian_bench_cl] [--redis redis://127.0.0.1:6379/7]
        [--ticks 3] [--heartbeat-nodes 2000] [--http-threads 16]

Per size, on a fresh database:
  1. a synthetic fleet (8 H100 per node, 2 regions) and jobs filling ~85% of it plus ~10% more
     waiting (W in {1,2,4,8}, a tier mix, half of them elastic), bulk-inserted (setup, not timed);
  2. the placement tick (every job starts: the heaviest apply) - timed;
  3. heartbeats with per-device telemetry from hollow agents over HTTP (a real daphne server,
     the real agent API, one node token each) - heartbeats and device samples ingested per second;
  4. steady-state ticks (all jobs running, the rest waiting) - tick latency end to end split
     into snapshot / plan / apply, and database rows written per tick (measured by
     PostgreSQL's own counters, pg_stat_database tup_inserted+updated+deleted);
  4b. one device-time accrual (jobs.tasks.accounting, every 10 s, apart from the tick);
  5. the size of the telemetry tables before and after the heartbeat rounds: telemetry is
     stored as the latest value per node and device (bounded by the fleet), never appended.
The machine is shared and has 2 cores; daphne, PostgreSQL and this process share them.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/meridian_bench_cl"
DEFAULT_REDIS = "redis://127.0.0.1:6379/7"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10000,100000")
    p.add_argument("--db", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DB))
    p.add_argument("--redis", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS))
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--heartbeat-nodes", type=int, default=1000)
    p.add_argument("--http-threads", type=int, default=8)
    return p.parse_args()


def ensure_database(url):
    import psycopg

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    admin = parsed._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("select 1 from pg_database where datname = %s", (name,)).fetchone():
            conn.execute(f'create database "{name}"')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_django(args, data_dir):
    os.environ["DATABASE_URL"] = args.db
    os.environ["REDIS_URL"] = args.redis
    os.environ["MERIDIAN_DATA_DIR"] = str(data_dir)
    os.environ["DJANGO_SETTINGS_MODULE"] = "portal.settings"
    os.environ["MERIDIAN_JOB_MAX_SPREAD"] = "region"
    os.environ["MERIDIAN_AGENT_ENROLLMENT_TOKEN"] = "bench"
    os.environ.setdefault("MERIDIAN_LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)


def reset_tables():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE jobs_jobevent, jobs_checkpoint, jobs_preemptionrequest, jobs_replica, jobs_job, "
                       "jobs_controllooplease, fleet_accelerator, fleet_node, fleet_cluster, fleet_region CASCADE")


def db_rows_written():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("select tup_inserted + tup_updated + tup_deleted from pg_stat_database "
                       "where datname = current_database()")
        return cursor.fetchone()[0]


def stats_settled(before, *, timeout=5.0):
    """PostgreSQL publishes its counters asynchronously: poll until they stop moving."""
    from django.db import connection

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("select pg_stat_clear_snapshot()")
        value = db_rows_written()
        if value == last:
            return value - before
        last = value
        time.sleep(0.6)
    return last - before


def table_bytes(*tables):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("select sum(pg_total_relation_size(c)) from unnest(%s::regclass[]) c", [list(tables)])
        return int(cursor.fetchone()[0] or 0)


def build_fleet_and_jobs(n_accelerators, rng):
    from django.db import transaction

    from fleet.models import Node, node_token_hash
    from fleet.services import fleet_generate
    from jobs.demo_cast import cast_create
    from jobs.models import Job, Replica, Team

    cast = cast_create()
    clusters = max(1, n_accelerators // 8 // 2 // 250)
    nodes = n_accelerators // 8 // 2 // clusters
    fleet_generate(regions=2, clusters=clusters, nodes=nodes, devices=8, accelerator_type="H100-80GB", prefix="b")
    tokens = {}
    node_rows = list(Node.objects.all().only("id", "hostname"))
    for node in node_rows:
        token = secrets.token_urlsafe(24)
        tokens[node.hostname] = token
        node.agent_token_hash = node_token_hash(token)
    Node.objects.bulk_update(node_rows, ["agent_token_hash"], batch_size=5000)
    Team.objects.update(quotas={"H100-80GB": n_accelerators * 2})
    teams = list(Team.objects.all())
    sizes = rng.choice([1, 2, 4, 8], p=[0.4, 0.2, 0.2, 0.2], size=n_accelerators)
    tiers = rng.choice(["premium", "standard", "basic"], p=[0.2, 0.3, 0.5], size=n_accelerators)
    jobs, total = [], 0
    target = int(n_accelerators * 0.95)
    i = 0
    while total < target:
        w = int(sizes[i])
        jobs.append(Job(name=f"bench-{i}", team=teams[i % len(teams)], submitted_by=cast.alice, tier=tiers[i],
                        accelerator_type="H100-80GB", world_size=w, min_devices=1 if i % 2 else w,
                        entrypoint="train.py", args=["--steps", "100000000"]))
        total += w
        i += 1
    with transaction.atomic():
        Job.objects.bulk_create(jobs, batch_size=5000)
        Replica.objects.bulk_create([Replica(job=j, rank=r) for j in jobs for r in range(j.world_size)],
                                    batch_size=10000)
    return tokens, len(jobs)


def start_daphne(env):
    port = free_port()
    log = open(env["MERIDIAN_DATA_DIR"] + "/daphne.log", "ab")
    process = subprocess.Popen([str(pathlib.Path(sys.executable).parent / "daphne"), "-b", "127.0.0.1", "-p",
                                str(port), "portal.asgi:application"], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    import requests

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            requests.get(f"http://127.0.0.1:{port}/api/agent/desired/", timeout=2)
            return process, f"http://127.0.0.1:{port}"
        except requests.RequestException:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("daphne did not start; see daphne.log")


def heartbeat_round(url, tokens, n_nodes, threads):
    """Returns (heartbeats/s, device samples/s, failures) for one heartbeat from n_nodes hollow nodes."""
    import requests

    from agent.client import ControlPlaneClient
    from agent.hollow import HollowNode

    nodes = []
    for hostname in sorted(tokens)[:n_nodes]:
        client = ControlPlaneClient(url, token=tokens[hostname], session=requests.Session(), retries=2)
        node = HollowNode(hostname, devices=8, device_type="H100-80GB", client=client)
        nodes.append(node)
    from concurrent.futures import ThreadPoolExecutor

    def one(node):
        telemetry = {"utilization": 0.9, "memory_used_gb": 500.0,
                     "devices": [{"index": i, "utilization": 0.9, "memory_used_gb": 62.5} for i in range(8)]}
        try:
            node.client.heartbeat(telemetry=telemetry, jobs=node.observed(), retries=2)
            return True
        except Exception:  # noqa: BLE001 - counted as a failure
            return False

    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        ok = sum(pool.map(one, nodes))
    seconds = time.perf_counter() - began
    return ok / seconds, ok * 8 / seconds, len(nodes) - ok


def timed_tick(now):
    from jobs.tick import tick_run

    before = db_rows_written()
    began = time.perf_counter()
    result = tick_run(now=now)
    wall = time.perf_counter() - began
    rows = stats_settled(before)
    return result, wall, rows


def run_size(n, args, rng, data_dir):
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import Job

    reset_tables()
    t = time.perf_counter()
    tokens, n_jobs = build_fleet_and_jobs(n, rng)
    setup_s = time.perf_counter() - t
    now = timezone.now()
    placement, placement_wall, placement_rows = timed_tick(now)
    # The agents report their jobs running (what their first heartbeats do), in bulk here.
    Job.objects.filter(state=Job.State.SCHEDULED).update(state=Job.State.RUNNING, last_started_at=now)
    env = dict(os.environ, DATABASE_CONN_MAX_AGE="0")  # daphne's thread pool must not hoard connections
    daphne, url = start_daphne(env)
    try:
        telemetry_before = table_bytes("fleet_node", "fleet_accelerator")
        rates = [heartbeat_round(url, tokens, min(args.heartbeat_nodes, len(tokens)), args.http_threads)
                 for _ in range(2)]
        telemetry_after = table_bytes("fleet_node", "fleet_accelerator")
    finally:
        daphne.terminate()
        daphne.wait(timeout=20)
    steady = []
    for k in range(args.ticks):
        now = now + timedelta(seconds=5)
        steady.append(timed_tick(now))
    from jobs.tick import accounting_run

    accounting_run(now=now)  # the first accrual reaches back to submission
    now = now + timedelta(seconds=10)
    before = db_rows_written()
    began = time.perf_counter()
    accounting_run(now=now)
    accrual = (time.perf_counter() - began, stats_settled(before))
    return {"accrual": accrual, "n": n, "jobs": n_jobs, "setup_s": setup_s, "placement": (placement, placement_wall, placement_rows),
            "steady": steady, "heartbeats": rates, "telemetry_bytes": (telemetry_before, telemetry_after)}


def main():
    args = parse_args()
    import numpy as np

    ensure_database(args.db)
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-cp-"))
    setup_django(args, data_dir)
    rng = np.random.default_rng(5)
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        print(f"[bench] {n} accelerators ...", flush=True)
        rows.append(run_size(n, args, rng, data_dir))
    print()
    print(f"control loop on PostgreSQL ({urlparse(args.db).path.lstrip('/')}) + Redis, 2 shared cores; "
          f"{args.ticks} steady ticks, heartbeats from {args.heartbeat_nodes} hollow nodes x 2 rounds "
          f"over HTTP (daphne, {args.http_threads} client threads)")
    header = (f"{'accel':>8} {'jobs':>7} | {'place tick s':>12} {'starts':>7} {'rows':>8} | "
              f"{'steady tick s':>13} {'snap':>6} {'plan':>6} {'apply':>6} {'rows/tick':>9} | "
              f"{'hb/s':>6} {'dev samples/s':>13} {'fail':>4} | {'telemetry MB before→after':>25} | "
              f"{'accrual s':>9} {'rows':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        placement, placement_wall, placement_rows = r["placement"]
        steady = r["steady"]
        med = sorted(steady, key=lambda s: s[1])[len(steady) // 2]
        result, wall, rows_written = med
        hb = max(rate[0] for rate in r["heartbeats"])
        samples = max(rate[1] for rate in r["heartbeats"])
        fails = sum(rate[2] for rate in r["heartbeats"])
        before, after = r["telemetry_bytes"]
        print(f"{r['n']:>8} {r['jobs']:>7} | {placement_wall:>12.2f} {placement.counts.get('start', 0):>7} "
              f"{placement_rows:>8} | {wall:>13.3f} {result.seconds['snapshot']:>6.2f} {result.seconds['plan']:>6.2f} "
              f"{result.seconds['apply']:>6.2f} {rows_written:>9} | {hb:>6.0f} {samples:>13.0f} {fails:>4} | "
              f"{before / 2**20:>11.1f} → {after / 2**20:<11.1f} | {r['accrual'][0]:>9.2f} {r['accrual'][1]:>7}")
    print("\nsteady ticks (all): " + "; ".join(
        f"{r['n']}: " + ", ".join(f"{s[1]:.2f}s/{s[2]} rows" for s in r["steady"]) for r in rows))


if __name__ == "__main__":
    main()
