"""Where a full heartbeat's web CPU goes: hollow nodes' heartbeats through Django in this process.

    BENCH_REDIS_URL=redis://127.0.0.1:6379/12 PYTHONPATH=$PWD .venv/bin/python bench/heartbeat_profile.py \
        [--size 16000] [--nodes 200] [--db postgres://postgres@127.0.0.1:5432/meridian_bench_hbp] \
        [--profile DIR] [--fold sync|async|both]

A fleet and its jobs as bench/control_plane.py builds them (8 H100 per node, ~95% placed by one
tick), then `--nodes` hollow nodes (agent/hollow.py) send full heartbeats through the real agent
API (POST /api/agent/heartbeat/: the middleware, authentication, parsing, the report, the desired
state, the answer), in this process through Django's test client (no HTTP server, no ASGI hop:
bench/control_plane.py measures those). Four kinds of heartbeat, each once from every node:

  idle        no job reports (telemetry only); the node holds its desired state's version
  progress    a report on every copy (step, rate), no checkpoint ever taken
  checkpoint  a report on every copy, each with a new checkpoint (the desired state changes:
              restore_from, so the answer carries it whole)
  steady      a report on every copy, each repeating its last checkpoint (what an agent sends
              between checkpoints once its copies have one)

--fold (MERIDIAN_HEARTBEAT_FOLD; "both": sync first, then async, on the same fleet): with async the
request only queues the report (jobs/heartbeat_fold.py) and the folder records the round's
heartbeats afterwards, in this process (jobs.heartbeat_fold.heartbeats_fold_all); its CPU per
heartbeat is printed apart ("folder") and added to the request's ("combined"): the folder's CPU is
control-plane CPU too.

For each: the median and mean CPU milliseconds per heartbeat (time.process_time, this process
only: the database's own work is not in it), the SQL statements per heartbeat, the jobs
reported. With --profile DIR, one cProfile of each kind is written there (DIR/<kind>.prof) and
its top functions printed.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import sys
import tempfile
import time
from urllib.parse import urlparse

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import control_plane as cp  # noqa: E402  (the fleet and jobs of the control-plane bench)

KINDS = ("idle", "progress", "checkpoint", "steady")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=16000, help="accelerators (8 per node)")
    p.add_argument("--nodes", type=int, default=200, help="hollow nodes that heartbeat")
    p.add_argument("--db", default=os.environ.get("BENCH_DATABASE_URL",
                                                  "postgres://postgres@127.0.0.1:5432/meridian_bench_hbp"))
    p.add_argument("--redis", default=os.environ.get("BENCH_REDIS_URL", cp.DEFAULT_REDIS))
    p.add_argument("--profile", default="", help="write one cProfile per kind of heartbeat into this folder")
    p.add_argument("--top", type=int, default=30, help="functions printed per profile")
    p.add_argument("--fold", choices=("sync", "async", "both"), default="sync",
                   help="MERIDIAN_HEARTBEAT_FOLD: record in the request, or queue and fold (both: one then the other)")
    return p.parse_args()


class _Answer:
    """The part of a requests.Response that agent.client reads."""

    def __init__(self, response):
        self.status_code = response.status_code
        self.text = response.content.decode()

    def json(self):
        return json.loads(self.text)


class InProcessSession:
    """A requests.Session stand-in that sends the agent's requests through Django's test client."""

    def __init__(self):
        from django.test import Client

        self.client = Client()

    def request(self, method, url, *, json=None, headers=None, timeout=None):  # noqa: A002 - requests' names
        import json as jsonlib

        body = jsonlib.dumps(json) if json is not None else ""
        response = self.client.generic(method, urlparse(url).path, body, content_type="application/json",
                                       HTTP_AUTHORIZATION=(headers or {}).get("Authorization", ""))
        return _Answer(response)


def build(args):
    import numpy as np
    from django.utils import timezone

    from jobs.models import Job
    from jobs.tick import tick_run

    cp.reset_tables()
    tokens, n_jobs = cp.build_fleet_and_jobs(args.size, np.random.default_rng(5))
    now = timezone.now()
    tick_run(now=now)
    Job.objects.filter(state=Job.State.SCHEDULED).update(state=Job.State.RUNNING, last_started_at=now)
    return tokens, n_jobs


def hollow(tokens, n_nodes):
    from agent.client import ControlPlaneClient
    from agent.hollow import HollowNode
    from fleet.models import Node
    from jobs.models import Replica

    ids = dict(Node.objects.values_list("hostname", "pk"))
    busy = set(Replica.objects.filter(device__isnull=False).values_list("device__node__hostname", flat=True))
    names = [h for h in sorted(tokens) if h in busy][:n_nodes]
    nodes = []
    for hostname in names:
        client = ControlPlaneClient("http://in-process", token=tokens[hostname], session=InProcessSession(), retries=0)
        client.node_id = ids[hostname]
        nodes.append(HollowNode(hostname, devices=8, device_type="H100-80GB", client=client))
    return nodes


# What a real agent reads from NVML each beat (a hollow node reports the node's utilization only).
TELEMETRY = {"utilization": 0.9,
             "devices": [{"index": i, "utilization": 0.9, "memory_used_gb": 62.5} for i in range(8)]}


def send(node, kind, now):
    """Sends one heartbeat of `kind` from `node`; returns the jobs it reported."""
    from protocol.states import CopyState

    node._advance(now)
    if kind == "checkpoint":
        for job in node.jobs.values():
            if job.state == CopyState.RUNNING:
                node._checkpoint(job, now)
    reports = [] if kind == "idle" else node.observed()
    node.client.heartbeat(telemetry=TELEMETRY, jobs=reports, retries=0)
    return len(reports)


def fold():
    """Runs the heartbeat folder until the queue is empty; returns (CPU seconds, beats recorded)."""
    from jobs.heartbeat_fold import heartbeats_fold_all

    began = time.process_time()
    result = heartbeats_fold_all()
    return time.process_time() - began, result.recorded


def measure(nodes, kind, clock):
    """Returns {cpu: [ms per heartbeat], jobs: [reports per heartbeat], folder: ms per heartbeat} of
    one heartbeat of `kind` from every node (folder: 0 when recorded in the request)."""
    clock[0] += 5.0
    cpu, jobs = [], []
    for node in nodes:
        began = time.process_time()
        jobs.append(send(node, kind, clock[0]))
        cpu.append((time.process_time() - began) * 1000)
    folder_seconds, _ = fold()
    return {"cpu": cpu, "jobs": jobs, "folder": folder_seconds * 1000 / len(nodes)}


def statements(nodes, kind, clock):
    """Returns the SQL statements of one heartbeat of `kind` from the first node (BEGIN/COMMIT left out)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    clock[0] += 5.0
    with CaptureQueriesContext(connection) as captured:
        send(nodes[0], kind, clock[0])
    return [q["sql"] for q in captured.captured_queries if q["sql"].split()[0].upper() not in ("BEGIN", "COMMIT")]


def main():
    args = parse_args()
    cp.ensure_database(args.db)
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-hbp-"))
    cp.setup_django(args, data_dir)
    from django.conf import settings

    settings.DEBUG = False
    began = time.perf_counter()
    tokens, n_jobs = build(args)
    print(f"[bench] {args.size} accelerators, {n_jobs} jobs built and placed in {time.perf_counter() - began:.0f} s",
          flush=True)
    nodes = hollow(tokens, args.nodes)
    clock = [time.monotonic()]
    # warm-up: the first heartbeat fetches the desired state (the nodes adopt their jobs), the
    # second reports them and fills this process's desired-state cache
    for _ in range(2):
        clock[0] += 5.0
        for node in nodes:
            node.beat(now=clock[0])
        fold()
    modes = ("sync", "async") if args.fold == "both" else (args.fold,)
    tables = {}
    for mode in modes:
        settings.MERIDIAN_HEARTBEAT_FOLD = mode
        tables[mode] = run_kinds(args, nodes, clock)
    print(f"\nfull heartbeats in process (Django test client, no HTTP server): {len(nodes)} hollow nodes, "
          f"{args.size} accelerators on PostgreSQL")
    print("cpu ms: the request's (median, mean, p90); folder: the heartbeat folder's CPU per heartbeat of the round "
          "(MERIDIAN_HEARTBEAT_FOLD=async only); combined: mean + folder")
    print(f"{'mode':>5} {'kind':>10} | {'jobs/hb':>7} | {'cpu ms median':>13} {'mean':>6} {'p90':>6} | "
          f"{'folder':>6} {'combined':>8} | {'statements':>10}")
    for mode, (results, queries) in tables.items():
        for kind in KINDS:
            cpu = sorted(results[kind]["cpu"])
            folder = results[kind]["folder"]
            print(f"{mode:>5} {kind:>10} | {statistics.mean(results[kind]['jobs']):>7.1f} | "
                  f"{statistics.median(cpu):>13.2f} {statistics.mean(cpu):>6.2f} {cpu[int(len(cpu) * 0.9)]:>6.2f} | "
                  f"{folder:>6.2f} {statistics.mean(cpu) + folder:>8.2f} | {len(queries[kind]):>10}")
    for mode, (_results, queries) in tables.items():
        for kind in KINDS:
            print(f"\nstatements of one {kind} heartbeat ({mode}; async: the request's only):")
            for sql in queries[kind]:
                print("   ", sql[:160])
    print(f"\nload average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def run_kinds(args, nodes, clock):
    """Returns ({kind: measure(...)}, {kind: statements}) of the four kinds, after one warm-up round."""
    for node in nodes:  # warm-up in this mode: the outcomes known, each process cache filled
        node.beat(now=clock[0])
    fold()
    results, queries = {}, {}
    for kind in KINDS:
        results[kind] = measure(nodes, kind, clock)
        queries[kind] = statements(nodes, kind, clock)
        fold()
        if args.profile:
            folder = pathlib.Path(args.profile)
            folder.mkdir(parents=True, exist_ok=True)
            profiler = cProfile.Profile(time.process_time)  # CPU, not time spent waiting for the database
            clock[0] += 5.0
            profiler.enable()
            for node in nodes:
                send(node, kind, clock[0])
            fold()
            profiler.disable()
            name = f"{kind}-{settings_mode()}"
            profiler.dump_stats(folder / f"{name}.prof")
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
            print(f"\n=== profile: {name} ({len(nodes)} heartbeats, and the folder), by cumulative time ===")
            print(text.getvalue()[-12000:])
    return results, queries


def settings_mode():
    from django.conf import settings

    return settings.MERIDIAN_HEARTBEAT_FOLD


if __name__ == "__main__":
    main()
