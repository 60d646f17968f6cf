"""The control loop at scale: hollow agents for 10k and 100k accelerators against PostgreSQL + Redis.

    .venv/bin/python bench/control_plane.py [--sizes 10000,100000]
        [--db postgres://postgres@127.0.0.1:5432/meridian_bench_cl] [--redis redis://127.0.0.1:6379/7]
        [--ticks 3] [--heartbeat-nodes 2000] [--http-threads 16]
        [--server uvicorn|daphne,uvicorn,...] [--fold sync|async]

Per size, on a fresh database:
  1. a synthetic fleet (8 H100 per node, 2 regions) and jobs filling ~85% of it plus ~10% more
     waiting (W in {1,2,4,8}, a tier mix, half of them elastic), bulk-inserted (setup, not timed);
  2. the placement tick (every job starts: the heaviest apply) - timed;
  3. heartbeats with per-device telemetry from hollow agents over HTTP (real web processes, the
     real agent API, one node token each) - heartbeats and device samples ingested per second,
     and the web server's own CPU per heartbeat (user + system, from /proc: the part of the cost that
     does not depend on how busy the shared machine is);
  3a. with --busy: the agents' minute of beats (below) again, with the fleet's tick running beside
     it (a process ticking every MERIDIAN_TICK_SECONDS, as the Celery worker does) and --viewers
     portal viewers polling the fleet summary, utilization and job list every 5 s through a web
     process of their own: the web CPU per beat of the agents' processes, the ticks' durations
     meanwhile, the viewers' answers and latency;
  3b. the liveness lease from the same hollow nodes (POST /api/agent/lease/, answered before
     Django: fleet/lease_api.py) - leases per second and the web CPU per lease, beside the full
     heartbeat's; and the server's per-request floor (an unauthenticated lease: a 401 before any Redis
     or database work);
  4. steady-state ticks (all jobs running, the rest waiting) - tick latency end to end split
     into snapshot / plan / apply, and database rows written per tick (measured by
     PostgreSQL's own counters, pg_stat_database tup_inserted+updated+deleted);
  4b. one device-time accrual (jobs.tasks.accounting, every 10 s, apart from the tick);
  5. the size of the telemetry tables before and after the heartbeat rounds: the latest value
     per node and device (bounded by the fleet) plus the history's per-node minute buckets;
  6. one heartbeat's telemetry write in process (fleet.services.node_heartbeat_record: median
     ms and statements over --inproc-heartbeats heartbeats, no HTTP);
  7. telemetry history at steady state: --history-hours (default 6, what is kept) of per-node
     minute buckets for every node, bulk-filled - rows and size; the beat task
     fleet.tasks.telemetry_rollup rolling them all at once (catch-up) into cluster minutes, node
     hours and cluster hours; its steady per-minute run (one more minute); then a day later
     deleting the expired minutes in batches (rows and size left, after VACUUM).
--fold async (MERIDIAN_HEARTBEAT_FOLD=async): the web processes queue full heartbeats and a folder
process of its own (jobs.heartbeat_fold.heartbeats_fold_all in a loop, as the Celery task runs it)
records them; each round waits for the queue to drain, and the folder's CPU per beat is printed
beside the web processes' and added to it ("combined"): both are control-plane CPU.
Steps 3-3b run once per server named in --server (comma-separated; uvicorn as portal.web_server
starts it, or daphne with its defaults, what served Meridian before session 21), each on fresh hollow
nodes against the same fleet, and a table puts them side by side with the daphne/uvicorn ratios.
The machine is shared and has 2 cores; the web processes, PostgreSQL and this process share them.
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
    p.add_argument("--web-processes", type=int, default=2, help="web processes the hollow nodes spread over")
    p.add_argument("--inproc-heartbeats", type=int, default=500)
    p.add_argument("--history-hours", type=int, default=6, help="hours of per-node minute buckets to bulk-fill")
    p.add_argument("--drop", action="store_true", help="drop the database afterwards")
    p.add_argument("--busy", action="store_true",
                   help="measure the agents' beats again with the tick and portal viewers running beside them")
    p.add_argument("--viewers", type=int, default=20, help="portal viewers polling every 5 s (--busy)")
    p.add_argument("--server", default="uvicorn",
                   help="the ASGI server(s) of the web processes, comma-separated, each measured in turn on the "
                        "same fleet (e.g. daphne,uvicorn,daphne,uvicorn): uvicorn (Meridian's, portal.web_server) "
                        "or daphne (before session 21); either with +nohiredis: its web processes and folder "
                        "without hiredis (e.g. uvicorn+nohiredis,uvicorn); uvicorn with +noaccesslog: without "
                        "the access line per request (e.g. uvicorn+noaccesslog,uvicorn)")
    p.add_argument("--checkpoint-seconds", type=float, default=60.0,
                   help="how often each hollow copy checkpoints (real jobs: every 10-30 minutes)")
    p.add_argument("--fold", choices=("sync", "async"), default="sync",
                   help="MERIDIAN_HEARTBEAT_FOLD of the web processes (async: with a folder process, its CPU counted)")
    p.add_argument("--skip-history", action="store_true",
                   help="leave out steps 6-7 (e.g. to run this bench against code from before the history)")
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

    from fleet import leases

    store = leases.lease_store()  # the bench's own Redis database (--redis): its lease keys only
    store.delete(leases.LEASE_KEY, leases.DESIRED_SERIAL_KEY, leases.DESIRED_NODES_KEY, "meridian:heartbeats",
                 *store.keys("meridian:heartbeat-outcome:*"))

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE jobs_jobevent, jobs_checkpoint, jobs_preemptionrequest, jobs_replica, jobs_job, "
                       "jobs_controllooplease, fleet_nodetelemetrybucket, fleet_clustertelemetrybucket, "
                       "fleet_accelerator, fleet_node, fleet_cluster, fleet_region CASCADE")


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


def start_web(env, server, *, access_log=True):
    """Starts one web process: `server` "uvicorn" (Meridian's, as portal.web_server runs it) or
    "daphne" (what served Meridian before session 21, with its defaults); returns (process, its URL).
    `access_log`: uvicorn writes its access line per request (portal.web_server's default)."""
    from portal.web_server import web_server_argv

    port = free_port()
    log = open(env["MERIDIAN_DATA_DIR"] + f"/{server}.log", "ab")
    bin_dir = pathlib.Path(sys.executable).parent
    if server == "uvicorn":
        command = web_server_argv(bin_dir=bin_dir, port=port, access_log=access_log)
    else:
        command = [str(bin_dir / "daphne"), "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    import requests

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            requests.get(f"http://127.0.0.1:{port}/api/agent/desired/", timeout=2)
            return process, f"http://127.0.0.1:{port}"
        except requests.RequestException:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"{server} did not start; see {server}.log")


def process_cpu_seconds(pid):
    """Returns the user + system CPU seconds process `pid` has used (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hollow_nodes(urls, tokens, n_nodes, *, checkpoint_seconds=60.0):
    """Returns n_nodes hollow nodes (one token each), spread round-robin over the web processes `urls`."""
    import requests

    from agent.client import ControlPlaneClient
    from agent.hollow import HollowNode
    from fleet.models import Node

    ids = dict(Node.objects.values_list("hostname", "pk"))
    nodes = [HollowNode(hostname, devices=8, device_type="H100-80GB", checkpoint_every_s=checkpoint_seconds,
                        client=ControlPlaneClient(urls[i % len(urls)], token=tokens[hostname],
                                                  session=requests.Session(), retries=2))
             for i, hostname in enumerate(sorted(tokens)[:n_nodes])]
    for node in nodes:
        node.client.node_id = ids[node.hostname]  # what registration tells a real agent
    return nodes


# What the bench's helper processes (the folder, the tick) run first: Django on the bench's database.
LOOP_PREAMBLE = """
import json, signal, sys, time
sys.path[:0] = [{root!r}, {bench!r}]
import control_plane as cp
class Args: db, redis = {db!r}, {redis!r}
cp.setup_django(Args, {data_dir!r})
from django.conf import settings
"""

FOLDER = [None]  # --fold async: the folder process (start_folder)

# The folder process of --fold async: heartbeats_fold_all in a loop (the Celery task's body), a
# pause of MERIDIAN_HEARTBEAT_FOLD_SECONDS when the queue is empty, until SIGINT.
FOLD_LOOP = LOOP_PREAMBLE + """from jobs.heartbeat_fold import heartbeats_fold_all
stop = []
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
print("READY", flush=True)
while not stop:
    if not heartbeats_fold_all(max_seconds=5.0).entries:
        time.sleep(settings.MERIDIAN_HEARTBEAT_FOLD_SECONDS)
"""


def start_folder(args, data_dir, env):
    code = FOLD_LOOP.format(root=str(ROOT), bench=str(ROOT / "bench"), db=args.db, redis=args.redis,
                            data_dir=str(data_dir))
    path = env.get("PYTHONPATH", str(ROOT))  # +nohiredis puts its folder first (heartbeat_stage)
    folder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(env, PYTHONPATH=path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if folder.stdout.readline().strip() != "READY":
        raise RuntimeError(f"the folder process did not start: {folder.communicate()[0][-2000:]}")
    FOLDER[0] = folder
    return folder


def folder_cpu_seconds() -> float:
    return process_cpu_seconds(FOLDER[0].pid) if FOLDER[0] is not None else 0.0


def folder_drained(*, timeout=300.0) -> None:
    """Waits until the folder has recorded every queued heartbeat (--fold async)."""
    if FOLDER[0] is None:
        return
    from fleet.leases import lease_store

    store, deadline = lease_store(), time.monotonic() + timeout
    while store.xlen("meridian:heartbeats") and time.monotonic() < deadline:
        time.sleep(0.05)


def timed_round(one, nodes, threads, server_pids):
    """Runs one(node) for every node on `threads` threads; returns (successes, wall seconds, the
    servers' CPU ms per success: all web processes together, NaN without their pids, the folder's
    CPU ms per success: 0 without --fold async). The wall time ends when the folder is done too."""
    from concurrent.futures import ThreadPoolExecutor

    began = time.perf_counter()
    cpu_before, folder_before = sum(process_cpu_seconds(pid) for pid in server_pids), folder_cpu_seconds()
    with ThreadPoolExecutor(threads) as pool:
        ok = sum(pool.map(one, nodes))
    folder_drained()
    seconds = time.perf_counter() - began
    cpu = sum(process_cpu_seconds(pid) for pid in server_pids) - cpu_before
    folder = folder_cpu_seconds() - folder_before
    return ok, seconds, cpu / max(ok, 1) * 1000 if server_pids else float("nan"), folder / max(ok, 1) * 1000


def lease_round(nodes, threads, server_pids=(), *, authenticated=True):
    """Returns (leases/s, failures, server CPU ms per lease) for one lease from each hollow node
    (POST /api/agent/lease/, answered before Django: fleet/lease_api.py). `authenticated=False`
    sends no token: the 401 the lease handler answers without Redis or the database is the server's
    own per-request floor (HTTP parsing, the ASGI hop), the least any request through it costs."""

    def one(node):
        try:
            if authenticated:
                node.client.lease()
                return True
            response = node.client.session.post(f"{node.client.url}/api/agent/lease/", data=b"{}", timeout=30)
            return response.status_code == 401
        except Exception:  # noqa: BLE001 - counted as a failure
            return False

    ok, seconds, cpu_ms, _folder_ms = timed_round(one, nodes, threads, server_pids)
    return ok / seconds, len(nodes) - ok, cpu_ms


def agent_rounds(nodes, threads, server_pids=(), *, clock, rounds=13, period=5.0):
    """Returns (beats/s, failures, server CPU ms per beat, leases, full heartbeats, the folder's CPU
    ms per beat: --fold async) of `rounds`
    beats of every hollow node as an agent beats (agent/liveness.py: a lease, or a full heartbeat
    when a report changed, its desired state changed, or every full-heartbeat period), the nodes'
    clocks advancing `period` seconds per round: 13 rounds are a minute of a fleet's life at the
    defaults (a lease every 5 s, a full heartbeat every 30 s), run as fast as the server answers
    (with --fold async, each round's heartbeats are recorded by the folder before the next).
    `clock`: [the nodes' current time], advanced here."""
    from concurrent.futures import ThreadPoolExecutor

    counts = {"failures": 0}

    def one(node, now):
        try:
            node.beat(now=now)
            return True
        except Exception:  # noqa: BLE001 - counted as a failure
            return False

    began = time.perf_counter()
    cpu_before, folder_before = sum(process_cpu_seconds(pid) for pid in server_pids), folder_cpu_seconds()
    leases_before = sum(n.planner.counts["leases"] for n in nodes)
    full_before = sum(n.planner.counts["full"] for n in nodes)
    ok = 0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):
            clock[0] += period
            ok += sum(pool.map(lambda node, now=clock[0]: one(node, now), nodes))
            # A round is `period` seconds of the agents' life and the folder runs every second: by
            # the next round it has recorded this one's heartbeats (--fold async; run as fast as the
            # server answers, a round takes ~1 s here, so without this the agents would hear
            # "deferred" for reports a real fleet's folder had long recorded).
            folder_drained()
    seconds = time.perf_counter() - began
    cpu = sum(process_cpu_seconds(pid) for pid in server_pids) - cpu_before
    folder = folder_cpu_seconds() - folder_before
    counts["failures"] = rounds * len(nodes) - ok
    return (ok / seconds, counts["failures"], cpu / max(ok, 1) * 1000 if server_pids else float("nan"),
            sum(n.planner.counts["leases"] for n in nodes) - leases_before,
            sum(n.planner.counts["full"] for n in nodes) - full_before, folder / max(ok, 1) * 1000)


def heartbeat_round(nodes, threads, server_pids=()):
    """Returns (heartbeats/s, device samples/s, failures, server CPU ms per heartbeat) for one
    heartbeat from each hollow node. The servers' CPU per heartbeat (all web processes together)
    does not depend on how busy the shared machine is, unlike heartbeats/s. A node's client names
    the desired-state version it holds: from the second round on, unchanged desired states are
    neither rebuilt nor sent."""

    def one(node):
        telemetry = {"utilization": 0.9, "memory_used_gb": 500.0,
                     "devices": [{"index": i, "utilization": 0.9, "memory_used_gb": 62.5} for i in range(8)]}
        try:
            node.client.heartbeat(telemetry=telemetry, jobs=node.observed(), retries=2)
            return True
        except Exception:  # noqa: BLE001 - counted as a failure
            return False

    ok, seconds, cpu_ms, folder_ms = timed_round(one, nodes, threads, server_pids)
    return ok / seconds, ok * 8 / seconds, len(nodes) - ok, cpu_ms, folder_ms


HISTORY_TABLES = ("fleet_nodetelemetrybucket", "fleet_clustertelemetrybucket")


def history_rows():
    from fleet.models import ClusterTelemetryBucket, NodeTelemetryBucket

    return NodeTelemetryBucket.objects.count() + ClusterTelemetryBucket.objects.count()


def inproc_heartbeats(n):
    """Returns (median ms, statements) of node_heartbeat_record for n heartbeats of 8 devices, each
    in its own transaction as node_report_apply runs it."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from fleet.models import Node
    from fleet.services import node_heartbeat_record

    nodes = list(Node.objects.order_by("id")[:n])
    telemetry = {"utilization": 0.8, "memory_used_gb": 400.0,
                 "devices": [{"index": i, "utilization": 0.8, "memory_used_gb": 50.0} for i in range(8)]}
    times = []
    for node in nodes:
        began = time.perf_counter()
        with transaction.atomic():
            with connection.cursor() as cursor:  # as node_report_apply does
                cursor.execute("SET LOCAL synchronous_commit = off")
            node_heartbeat_record(node=node, telemetry=telemetry, now=timezone.now())
        times.append(time.perf_counter() - began)
    with CaptureQueriesContext(connection) as captured, transaction.atomic():
        node_heartbeat_record(node=nodes[0], telemetry=telemetry, now=timezone.now())
    statements = [q for q in captured.captured_queries if q["sql"] not in ("BEGIN", "COMMIT")]  # 3
    times.sort()
    return times[len(times) // 2] * 1000, len(statements)


def history_day(hours):
    """Bulk-fills `hours` of per-node minute buckets (every node, H100s, one heartbeat per 5 s)
    ending now; times the rollup, then the retention a day later. Returns a dict of figures."""
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from fleet.models import TelemetryResolution, telemetry_bucket_start
    from fleet.services import telemetry_rollup

    end = telemetry_bucket_start(timezone.now(), TelemetryResolution.HOUR)
    start = end - timedelta(hours=hours)
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE fleet_nodetelemetrybucket, fleet_clustertelemetrybucket")
        cursor.execute(
            "INSERT INTO fleet_nodetelemetrybucket (node_id, resolution, bucket_start, accelerator_type, heartbeats, "
            "device_samples, utilization_sum, utilization_max, memory_used_gb_sum, memory_used_gb_max) "
            "SELECT n.id, 60, t, 'H100-80GB', 12, 96, 96 * 0.7, 0.95, 96 * 50.0, 70.0 FROM fleet_node n, "
            "generate_series(%s::timestamptz, %s::timestamptz - interval '1 minute', interval '1 minute') t",
            [start, end])
        cursor.execute("ANALYZE fleet_nodetelemetrybucket")
    filled = (history_rows(), table_bytes(*HISTORY_TABLES))
    began = time.perf_counter()
    rolled = telemetry_rollup(now=end + timedelta(seconds=30))
    rollup_s = time.perf_counter() - began
    after_rollup = (history_rows(), table_bytes(*HISTORY_TABLES))
    # Steady state: the beat task each minute rolls one more minute (and deletes one).
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO fleet_nodetelemetrybucket (node_id, resolution, bucket_start, accelerator_type, heartbeats, "
            "device_samples, utilization_sum, utilization_max, memory_used_gb_sum, memory_used_gb_max) "
            "SELECT n.id, 60, %s, 'H100-80GB', 12, 96, 96 * 0.7, 0.95, 96 * 50.0, 70.0 FROM fleet_node n", [end])
    began = time.perf_counter()
    telemetry_rollup(now=end + timedelta(minutes=1, seconds=30))
    minute_s = time.perf_counter() - began
    began = time.perf_counter()
    pruned = telemetry_rollup(now=end + timedelta(days=1, minutes=1))
    prune_s = time.perf_counter() - began
    with connection.cursor() as cursor:
        cursor.execute("VACUUM fleet_nodetelemetrybucket")  # what autovacuum does: the space is reusable
    return {"filled": filled, "rollup_s": rollup_s, "minute_s": minute_s, "written": sum(rolled.written.values()),
            "after_rollup": after_rollup, "prune_s": prune_s, "deleted": sum(pruned.deleted.values()),
            "left": (history_rows(), table_bytes(*HISTORY_TABLES))}


# The tick process of --busy: ticks as the Celery worker does, every MERIDIAN_TICK_SECONDS, until
# SIGINT, which ends it between two ticks (its lease released, so the bench's own ticks run after);
# prints each tick's wall seconds.
TICK_LOOP = LOOP_PREAMBLE + """from jobs.tick import tick_run
stop = []
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
print("READY", flush=True)
while not stop:
    began = time.perf_counter()
    result = tick_run()
    wall = time.perf_counter() - began
    print(json.dumps({{"wall": wall, "ran": result.ran}}), flush=True)
    time.sleep(max(0.0, settings.MERIDIAN_TICK_SECONDS - wall))
"""


class BusyPlane:
    """--busy: the fleet's tick in a process of its own and portal viewers on a web process of
    their own, for as long as the `with` block runs; .summary() says what they did meanwhile."""

    def __init__(self, args, data_dir, env, server):
        self.args, self.data_dir, self.env, self.server = args, data_dir, env, server

    def __enter__(self):
        import threading

        import requests
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        user, _ = get_user_model().objects.get_or_create(username="bench-viewer",
                                                         defaults={"is_superuser": True, "is_staff": True})
        token = Token.objects.get_or_create(user=user)[0].key
        self.portal, url = start_web(self.env, self.server)
        # Nodes that do not beat (all but --heartbeat-nodes) must not be found lost by this tick.
        env = dict(self.env, MERIDIAN_NODE_LOST_AFTER_SECONDS="1e9", MERIDIAN_LOG_LEVEL="WARNING",
                   PYTHONPATH=str(ROOT))
        code = TICK_LOOP.format(root=str(ROOT), bench=str(ROOT / "bench"), db=self.args.db, redis=self.args.redis,
                                data_dir=str(self.data_dir))
        self.ticker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
        if self.ticker.stdout.readline().strip() != "READY":
            raise RuntimeError(f"the tick process did not start: {self.ticker.communicate()[0][-2000:]}")
        self.cpu = {"portal": process_cpu_seconds(self.portal.pid), "tick": process_cpu_seconds(self.ticker.pid)}
        self.stop, self.answers = threading.Event(), []
        paths = ["/api/fleet/summary/", "/api/fleet/utilization/", "/api/jobs/?page_size=50"]

        def view():
            session = requests.Session()
            session.headers["Authorization"] = f"Token {token}"
            while not self.stop.is_set():
                began = time.perf_counter()
                for path in paths:
                    t = time.perf_counter()
                    try:
                        ok = session.get(url + path, timeout=30).status_code == 200
                    except requests.RequestException:
                        ok = False
                    self.answers.append((ok, time.perf_counter() - t))
                self.stop.wait(max(0.0, 5.0 - (time.perf_counter() - began)))

        self.viewers = [threading.Thread(target=view, daemon=True) for _ in range(self.args.viewers)]
        for viewer in self.viewers:
            viewer.start()
        return self

    def __exit__(self, *exc):
        import json
        import signal

        self.cpu = {"portal": process_cpu_seconds(self.portal.pid) - self.cpu["portal"],
                    "tick": process_cpu_seconds(self.ticker.pid) - self.cpu["tick"]}
        self.stop.set()
        for viewer in self.viewers:
            viewer.join(timeout=60)
        self.ticker.send_signal(signal.SIGINT)
        out = self.ticker.communicate(timeout=120)[0]
        self.ticks = [json.loads(line)["wall"] for line in out.splitlines() if line.startswith("{")]
        self.portal.terminate()
        self.portal.wait(timeout=20)

    def summary(self) -> dict:
        import statistics

        latencies = sorted(seconds for _, seconds in self.answers)
        return {"ticks": len(self.ticks), "tick_median": statistics.median(self.ticks) if self.ticks else float("nan"),
                "tick_max": max(self.ticks, default=float("nan")), "requests": len(self.answers),
                "failed": sum(1 for ok, _ in self.answers if not ok),
                "latency_median": statistics.median(latencies) if latencies else float("nan"),
                "latency_p99": latencies[int(len(latencies) * 0.99)] if latencies else float("nan"),
                "cpu": self.cpu}


def timed_tick(now):
    from jobs.tick import tick_run

    before = db_rows_written()
    began = time.perf_counter()
    result = tick_run(now=now)
    wall = time.perf_counter() - began
    rows = stats_settled(before)
    return result, wall, rows


def without_hiredis_path(data_dir) -> str:
    """Returns a folder holding a `hiredis` module that fails to import: first on PYTHONPATH, it makes
    redis-py fall back to its pure-Python reply parser (redis.utils.HIREDIS_AVAILABLE), so one run
    measures the same code with and without hiredis."""
    folder = pathlib.Path(data_dir) / "without-hiredis"
    folder.mkdir(exist_ok=True)
    (folder / "hiredis.py").write_text('raise ImportError("hidden by bench/control_plane.py: +nohiredis")\n')
    return str(folder)


def heartbeat_stage(args, tokens, data_dir, server):
    """Steps 3, 3a and 3b with `server` as the web processes' ASGI server, on fresh hollow nodes
    (the fleet and its jobs as the stages before left them); returns its figures. A server named
    with "+nohiredis" (e.g. uvicorn+nohiredis) runs its web processes and the folder without hiredis;
    "uvicorn+noaccesslog" runs uvicorn without its access line per request."""
    env = dict(os.environ, DATABASE_CONN_MAX_AGE="0")  # the servers' thread pools must not hoard connections
    base_server, _, variant = server.partition("+")
    if variant == "nohiredis":
        env["PYTHONPATH"] = os.pathsep.join([without_hiredis_path(data_dir), str(ROOT)])
    servers = [start_web(env, base_server, access_log=variant != "noaccesslog") for _ in range(args.web_processes)]
    if args.fold == "async":
        start_folder(args, data_dir, env)
    try:
        nodes = hollow_nodes([url for _, url in servers], tokens, min(args.heartbeat_nodes, len(tokens)),
                             checkpoint_seconds=args.checkpoint_seconds)
        # round 1: every desired state built and sent; rounds 2-3: the agents hold their versions
        pids = [p.pid for p, _ in servers]
        rates = [heartbeat_round(nodes, args.http_threads, server_pids=pids) for _ in range(3)]
        # the liveness lease beside it (3 rounds; the first warms each process's token map), and the
        # server's floor: an unauthenticated lease, refused before any Redis or database work
        lease_rates = [lease_round(nodes, args.http_threads, server_pids=pids) for _ in range(3)]
        floor_rates = [lease_round(nodes, args.http_threads, server_pids=pids, authenticated=False)
                       for _ in range(2)]
        # the mix: every node beating as an agent does, over a minute of its (simulated) time
        # warm-up: a first full heartbeat, one that reports the jobs adopted, one that learns the serial
        clock = [time.monotonic()]
        agent_rounds(nodes, args.http_threads, server_pids=pids, clock=clock, rounds=3)
        mix = agent_rounds(nodes, args.http_threads, server_pids=pids, clock=clock)
        busy = None
        if args.busy:
            with BusyPlane(args, data_dir, env, base_server) as plane:
                began = time.perf_counter()
                mix_busy = agent_rounds(nodes, args.http_threads, server_pids=pids, clock=clock)
                seconds = time.perf_counter() - began
            busy = {"mix": mix_busy, "seconds": seconds, **plane.summary()}
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=20)
        if FOLDER[0] is not None:
            import signal

            FOLDER[0].send_signal(signal.SIGINT)
            FOLDER[0].communicate(timeout=120)
            FOLDER[0] = None
    return {"server": server, "heartbeats": rates, "leases": lease_rates, "floor": floor_rates, "mix": mix,
            "busy": busy, "load": os.getloadavg()[0]}


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
    telemetry_before = table_bytes("fleet_node", "fleet_accelerator", *HISTORY_TABLES)
    stages = [heartbeat_stage(args, tokens, data_dir, server) for server in args.server.split(",")]
    telemetry_after = table_bytes("fleet_node", "fleet_accelerator", *HISTORY_TABLES)
    heartbeat_history_rows = None if args.skip_history else history_rows()
    steady = []
    for _ in range(args.ticks):
        now = now + timedelta(seconds=5)
        steady.append(timed_tick(now))
    from jobs.accounting import accounting_run

    accounting_run(now=now)  # the first accrual reaches back to submission
    now = now + timedelta(seconds=10)
    before = db_rows_written()
    began = time.perf_counter()
    accounting_run(now=now)
    accrual = (time.perf_counter() - began, stats_settled(before))
    # Last: their bulk writes would show in the ticks' row counters (published asynchronously).
    inproc = inproc_heartbeats(min(args.inproc_heartbeats, len(tokens)))
    history = None if args.skip_history else history_day(args.history_hours)
    return {"accrual": accrual, "n": n, "jobs": n_jobs, "setup_s": setup_s,
            "placement": (placement, placement_wall, placement_rows), "steady": steady, "stages": stages,
            "telemetry_bytes": (telemetry_before, telemetry_after),
            "heartbeat_history_rows": heartbeat_history_rows, "inproc": inproc, "history": history}


def stage_figures(stage) -> dict:
    """Returns a heartbeat stage's figures in ms of web CPU per request (warm rounds, best) and per
    beat of the agents' minute (web + folder: control-plane CPU)."""
    mix = stage["mix"][2] + stage["mix"][5]
    busy = stage["busy"]["mix"][2] + stage["busy"]["mix"][5] if stage["busy"] else float("nan")
    return {"heartbeat": min(x[3] for x in stage["heartbeats"][1:]), "lease": min(x[2] for x in stage["leases"][1:]),
            "floor": min(x[2] for x in stage["floor"]), "mix": mix, "busy": busy}


def minute_text(mix) -> str:
    """The agents' minute of beats (a stage's "mix" figures) in words: its beats, their CPU per beat
    in the web processes and the folder, and the beats per second per core that makes."""
    beats, fails, cpu_ms, n_leases, n_full, folder_ms = mix
    return (f"{n_leases} leases + {n_full} full heartbeats, {cpu_ms:.2f} ms web CPU per beat = "
            f"{1000 / cpu_ms:.0f} beats/s per core ({beats:.0f} beats/s wall, {fails} failed); folder "
            f"{folder_ms:.2f} ms per beat, combined {cpu_ms + folder_ms:.2f} ms = "
            f"{1000 / (cpu_ms + folder_ms):.0f} beats/s per core of control-plane CPU")


def print_stage(n, stage, args):
    server, figures = stage["server"], stage_figures(stage)
    print(f"\n--- {n} accelerators, {server} (load average {stage['load']:.1f} at its end)")
    print("heartbeats per round (hb/s, web CPU ms/hb; round 1 builds and sends every desired state): " + ", ".join(
        f"{x[0]:.0f}/s {x[3]:.1f} ms" for x in stage["heartbeats"]))
    print(f"liveness lease vs full heartbeat (web CPU per request, all {server} processes; warm rounds, best):")
    header = (f"{'accel':>8} | {'hb/s':>6} {'cpu ms/hb':>9} {'hb/s/core':>9} | {'lease/s':>7} {'cpu ms/lease':>12} "
              f"{'leases/s/core':>13} {'fail':>4} | {'floor/s':>7} {'cpu ms/401':>10}")
    print(header)
    print("-" * len(header))
    print(f"{n:>8} | {max(x[0] for x in stage['heartbeats'][1:]):>6.0f} {figures['heartbeat']:>9.2f} "
          f"{1000 / figures['heartbeat']:>9.0f} | {max(x[0] for x in stage['leases'][1:]):>7.0f} "
          f"{figures['lease']:>12.2f} {1000 / figures['lease']:>13.0f} {sum(x[1] for x in stage['leases']):>4} | "
          f"{max(x[0] for x in stage['floor']):>7.0f} {figures['floor']:>10.2f}")
    folder_line = (f": the folder process's CPU per full heartbeat (warm rounds): "
                   f"{min(x[4] for x in stage['heartbeats'][1:]):.2f} ms, combined with the web's "
                   f"{min(x[3] + x[4] for x in stage['heartbeats'][1:]):.2f} ms")
    print(f"MERIDIAN_HEARTBEAT_FOLD={args.fold}, hollow copies checkpoint every {args.checkpoint_seconds:.0f} s"
          + (folder_line if args.fold == "async" else ""))
    print(f"agents beating for a minute of their time: {minute_text(stage['mix'])}")
    if stage["busy"] is not None:
        b = stage["busy"]
        print(f"the same beside the tick and {args.viewers} portal viewers ({b['seconds']:.0f} s): "
              f"{minute_text(b['mix'])}; "
              f"{b['ticks']} ticks meanwhile, median {b['tick_median']:.2f} s, max {b['tick_max']:.2f} s "
              f"(tick process CPU {b['cpu']['tick']:.1f} s); {b['requests']} portal requests, {b['failed']} failed, "
              f"median {b['latency_median'] * 1000:.0f} ms, p99 {b['latency_p99'] * 1000:.0f} ms "
              f"(their web process: {b['cpu']['portal']:.1f} s CPU)")
    print("leases per round (leases/s, web CPU ms/lease; round 1 loads each process's token map): " + ", ".join(
        f"{x[0]:.0f}/s {x[2]:.2f} ms" for x in stage["leases"]))


def print_server_comparison(rows):
    """The servers side by side, in the order they ran (repeat a server in --server to see the
    noise): ms of CPU per request or beat, and beats per second per core of control-plane CPU."""
    print("\nASGI servers side by side (ms of CPU; the agents' minute: web + folder per beat, in brackets "
          "beats/s per core of control-plane CPU)")
    header = (f"{'accel':>8} {'server':>8} {'load':>5} | {'floor':>6} {'lease':>6} {'full hb':>7} | "
              f"{'minute, alone':>15} {'minute, busy':>15}")
    print(header)
    print("-" * len(header))
    for r in rows:
        for stage in r["stages"]:
            f = stage_figures(stage)
            print(f"{r['n']:>8} {stage['server']:>8} {stage['load']:>5.1f} | {f['floor']:>6.2f} {f['lease']:>6.2f} "
                  f"{f['heartbeat']:>7.2f} | {f['mix']:>6.2f} ({1000 / f['mix']:>5.0f}) "
                  f"{f['busy']:>6.2f} ({1000 / f['busy']:>5.0f})")
        by_server: dict = {}
        for stage in r["stages"]:
            by_server.setdefault(stage["server"], []).append(stage_figures(stage))
        if {"daphne", "uvicorn"} <= by_server.keys():
            import statistics

            ratio = {key: statistics.median(x[key] for x in by_server["daphne"])
                     / statistics.median(x[key] for x in by_server["uvicorn"])
                     for key in ("floor", "lease", "heartbeat", "mix", "busy")}
            print(f"{r['n']:>8} daphne/uvicorn (medians): floor {ratio['floor']:.2f}x, lease {ratio['lease']:.2f}x, "
                  f"full heartbeat {ratio['heartbeat']:.2f}x, minute alone {ratio['mix']:.2f}x, "
                  f"beside the tick and the portal {ratio['busy']:.2f}x")
        for server in by_server:
            base, _, variant = server.partition("+")
            if variant and base in by_server:
                import statistics

                ratio = {key: statistics.median(x[key] for x in by_server[server])
                         / statistics.median(x[key] for x in by_server[base])
                         for key in ("floor", "lease", "heartbeat", "mix", "busy")}
                print(f"{r['n']:>8} {server}/{base} (medians): floor {ratio['floor']:.2f}x, "
                      f"lease {ratio['lease']:.2f}x, full heartbeat {ratio['heartbeat']:.2f}x, minute alone "
                      f"{ratio['mix']:.2f}x, beside the tick and the portal {ratio['busy']:.2f}x")


def main():
    args = parse_args()
    if not set(args.server.split(",")) <= {"daphne", "uvicorn", "daphne+nohiredis", "uvicorn+nohiredis",
                                           "uvicorn+noaccesslog"}:
        raise SystemExit(f"--server: daphne or uvicorn (either with +nohiredis; uvicorn with +noaccesslog), "
                         f"comma-separated; "
                         f"not {args.server!r}")
    os.environ["MERIDIAN_HEARTBEAT_FOLD"] = args.fold
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
          f"{args.ticks} steady ticks, heartbeats from {args.heartbeat_nodes} hollow nodes x 3 rounds "
          f"over HTTP ({args.web_processes} web processes of each of {args.server}, "
          f"{args.http_threads} client threads; "
          f"the heartbeat columns: {args.server.split(',')[0]})")
    header = (f"{'accel':>8} {'jobs':>7} | {'place tick s':>12} {'starts':>7} {'rows':>8} | "
              f"{'steady tick s':>13} {'snap':>6} {'plan':>6} {'apply':>6} {'rows/tick':>9} | "
              f"{'hb/s':>6} {'cpu ms/hb':>10} {'dev samples/s':>13} {'fail':>4} | {'telemetry MB before→after':>25} | "
              f"{'accrual s':>9} {'rows':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        placement, placement_wall, placement_rows = r["placement"]
        steady = r["steady"]
        med = sorted(steady, key=lambda s: s[1])[len(steady) // 2]
        result, wall, rows_written = med
        first = r["stages"][0]["heartbeats"]  # the first --server's
        warm = first[1:]  # the agents hold their desired-state versions
        hb = max(rate[0] for rate in warm)
        samples = max(rate[1] for rate in warm)
        fails = sum(rate[2] for rate in first)
        server_cpu = min(rate[3] for rate in warm)
        before, after = r["telemetry_bytes"]
        print(f"{r['n']:>8} {r['jobs']:>7} | {placement_wall:>12.2f} {placement.counts.get('start', 0):>7} "
              f"{placement_rows:>8} | {wall:>13.3f} {result.seconds['snapshot']:>6.2f} {result.seconds['plan']:>6.2f} "
              f"{result.seconds['apply']:>6.2f} {rows_written:>9} | "
              f"{hb:>6.0f} {server_cpu:>10.1f} {samples:>13.0f} {fails:>4} | "
              f"{before / 2**20:>11.1f} → {after / 2**20:<11.1f} | {r['accrual'][0]:>9.2f} {r['accrual'][1]:>7}")
    if args.skip_history:
        print("\nheartbeat telemetry write in process: " + ", ".join(
            f"{r['n']}: {r['inproc'][0]:.2f} ms, {r['inproc'][1]} statements" for r in rows))
    print()
    if not args.skip_history:
        print(f"telemetry history (per-node minute buckets; {args.history_hours} h bulk-filled for every node; "
              f"rollup = fleet.tasks.telemetry_rollup; sizes include indexes)")
        header = (f"{'accel':>8} | {'hb write ms':>11} {'stmts':>5} | {'rows after hb':>13} | "
                  f"{'filled rows':>11} {'MB':>7} | {'rollup s':>8} {'rows out':>8} {'+1 min s':>9} | "
                  f"{'retention s':>11} {'deleted':>8} | {'rows left':>9} {'MB left':>7}")
        print(header)
        print("-" * len(header))
        for r in rows:
            h = r["history"]
            print(f"{r['n']:>8} | {r['inproc'][0]:>11.2f} {r['inproc'][1]:>5} | {r['heartbeat_history_rows']:>13} | "
                  f"{h['filled'][0]:>11} {h['filled'][1] / 2**20:>7.1f} | {h['rollup_s']:>8.2f} {h['written']:>8} "
                  f"{h['minute_s']:>9.2f} | "
                  f"{h['prune_s']:>11.2f} {h['deleted']:>8} | {h['left'][0]:>9} {h['left'][1] / 2**20:>7.1f}")
        print("(MB left: the table files keep the freed space for new rows after VACUUM; they do not grow further)")
    for r in rows:
        for stage in r["stages"]:
            print_stage(r["n"], stage, args)
    print_server_comparison(rows)
    print(f"\nload average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\nsteady ticks (all): " + "; ".join(
        f"{r['n']}: " + ", ".join(f"{s[1]:.2f}s/{s[2]} rows" for s in r["steady"]) for r in rows))
    if args.drop:
        drop_database(args.db)


def drop_database(url):
    import psycopg
    from django.db import connections

    connections.close_all()
    parsed = urlparse(url)
    admin = parsed._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'drop database if exists "{parsed.path.lstrip("/")}" with (force)')


if __name__ == "__main__":
    main()
