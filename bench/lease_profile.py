"""Where a liveness lease's (or a full heartbeat's) CPU goes: through the ASGI application, in process.

    BENCH_REDIS_URL=redis://127.0.0.1:6379/13 PYTHONPATH=$PWD .venv/bin/python bench/lease_profile.py \
        [--nodes 200] [--rounds 20] [--db postgres://postgres@127.0.0.1:5432/meridian_bench_lp] [--profile DIR] \
        [--full [--size 16000]]

`--nodes` nodes (8 H100 each, a token each, as bench/control_plane.py makes them) lease `--rounds`
times each through `portal.asgi.application` (every router in front of the lease, the token map,
the protocol's decoding, the Redis round trip, the answer, the metric), called directly on a uvloop
event loop with the ASGI messages a server would pass: no HTTP parsing, no socket (the server's
floor is bench/control_plane.py's "floor" column). Then the same leases with no token (the 401
before any Redis or database work: the routers' and the answer's share).

Prints the median over rounds of the CPU microseconds per lease (time.process_time, this process;
Redis's own work is not in it) and the wall microseconds per lease (one lease at a time, so the
Redis round trip is in it). With --profile DIR, one cProfile of the warm leases is written
(DIR/lease.prof) and its top functions printed.

--full: full heartbeats (POST /api/agent/heartbeat/) instead, in their common case under
MERIDIAN_HEARTBEAT_FOLD=async: a fleet and its jobs as bench/control_plane.py builds them (`--size`
accelerators, 8 per node, ~95% placed by one tick); `--nodes` hollow nodes (agent/hollow.py) adopt
their jobs through the same application (three warm-up beats, the folder run after each), then each
sends the heartbeat a steady agent sends (a report on every copy, telemetry, the desired version
it holds) `--rounds` times; the folder records each round's heartbeats after it, outside the
measure (its CPU per heartbeat is printed apart). Also: the same heartbeat with a revoked token (the
401 Django answers). With --profile DIR: DIR/heartbeat.prof.
"""
from __future__ import annotations

import argparse
import asyncio
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import control_plane as cp  # noqa: E402  (the database and Django set-up of the control-plane bench)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--db", default=os.environ.get("BENCH_DATABASE_URL",
                                                  "postgres://postgres@127.0.0.1:5432/meridian_bench_lp"))
    p.add_argument("--redis", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13"))
    p.add_argument("--profile", help="a folder for lease.prof (heartbeat.prof with --full)")
    p.add_argument("--full", action="store_true", help="full heartbeats (async fold) instead of leases")
    p.add_argument("--size", type=int, default=16000, help="--full: accelerators (8 per node)")
    return p.parse_args()


def nodes_with_tokens(n):
    """Returns [(node id, token)] of a fresh fleet of n nodes."""
    import secrets

    from fleet.models import Node, node_token_hash
    from fleet.services import fleet_generate

    cp.reset_tables()
    fleet_generate(regions=1, clusters=1, nodes=n, devices=8, accelerator_type="H100-80GB", prefix="lp")
    pairs = []
    rows = list(Node.objects.all().only("id"))
    for node in rows:
        token = secrets.token_urlsafe(24)
        node.agent_token_hash = node_token_hash(token)
        pairs.append((node.pk, token))
    Node.objects.bulk_update(rows, ["agent_token_hash"])
    return pairs


async def lease_once(application, node_id, token, expect):
    body = json.dumps({"v": 1, "node_id": node_id}).encode()
    status, answer = await asgi_post(application, "/api/agent/lease/", token, body)
    if status != expect:
        raise RuntimeError(f"lease answered {status}, not {expect}: {answer!r}")


async def lease_rounds(application, pairs, rounds, *, authenticated=True, profiler=None):
    """Returns [(CPU µs, wall µs) per lease] of each round."""
    figures = []
    for _ in range(rounds):
        cpu, wall = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for node_id, token in pairs:
            await lease_once(application, node_id, token if authenticated else None,
                             200 if authenticated else 401)
        if profiler is not None:
            profiler.disable()
        figures.append(((time.process_time() - cpu) / len(pairs) * 1e6,
                        (time.perf_counter() - wall) / len(pairs) * 1e6))
    return figures


# --- --full: full heartbeats ------------------------------------------------------------------------

def asgi_scope(path, token, length):
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"accept", b"*/*"),
               (b"content-length", str(length).encode())]
    if token:
        headers.append((b"authorization", f"Node {token}".encode()))
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000)}


async def asgi_post(application, path, token, body):
    """Returns (status, body) of POST `path` through `application` (the messages a server would pass)."""
    sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Future()  # the client stays connected (Django waits for a disconnect until it answers)

    async def send(message):
        sent.append(message)

    await application(asgi_scope(path, token, len(body)), receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


class AsgiSession:
    """A requests.Session stand-in: the agent's requests through the ASGI application on `loop`."""

    def __init__(self, application, loop):
        self.application, self.loop = application, loop

    def request(self, method, url, *, json=None, headers=None, timeout=None):  # noqa: A002 - requests' names
        import json as jsonlib
        from urllib.parse import urlparse

        token = (headers or {}).get("Authorization", "").removeprefix("Node ")
        status, body = self.loop.run_until_complete(
            asgi_post(self.application, urlparse(url).path, token, jsonlib.dumps(json).encode()))
        return _Answer(status, body)


class _Answer:
    """The part of a requests.Response that agent.client reads."""

    def __init__(self, status, body):
        self.status_code, self.text = status, body.decode()

    def json(self):
        return json.loads(self.text)


def hollow_fleet(application, loop, size, n_nodes):
    """Returns [(hollow node, token)] of n busy nodes of a fresh fleet of `size` accelerators, each
    holding its jobs and its desired state's version (three beats, the folder after each)."""
    import numpy as np
    from django.utils import timezone

    from agent.client import ControlPlaneClient
    from agent.hollow import HollowNode
    from fleet.models import Node
    from jobs.heartbeat_fold import heartbeats_fold_all
    from jobs.models import Job, Replica
    from jobs.tick import tick_run

    cp.reset_tables()
    tokens, _ = cp.build_fleet_and_jobs(size, np.random.default_rng(5))
    now = timezone.now()
    tick_run(now=now)
    Job.objects.filter(state=Job.State.SCHEDULED).update(state=Job.State.RUNNING, last_started_at=now)
    ids = dict(Node.objects.values_list("hostname", "pk"))
    busy = set(Replica.objects.filter(device__isnull=False).values_list("device__node__hostname", flat=True))
    nodes = []
    for hostname in [h for h in sorted(tokens) if h in busy][:n_nodes]:
        client = ControlPlaneClient("http://127.0.0.1", token=tokens[hostname], session=AsgiSession(application, loop),
                                    retries=0)
        client.node_id = ids[hostname]
        nodes.append((HollowNode(hostname, devices=8, device_type="H100-80GB", client=client,
                                 checkpoint_every_s=1e9), tokens[hostname]))
    clock = time.monotonic()
    for _ in range(3):
        clock += 5.0
        for node, _token in nodes:
            node._advance(clock)
            node.client.heartbeat(telemetry=node.telemetry(), jobs=node.observed(), retries=0)
            node.beat(now=clock)  # adopts what the answer says (a full heartbeat: its planner's first)
        heartbeats_fold_all()
    return nodes


def steady_bodies(nodes):
    """Returns [(token, body)]: each node's steady heartbeat (its copies' reports, the version it holds)."""
    from protocol.node import Heartbeat

    bodies = []
    for node, token in nodes:
        held = node.client.desired_held
        if held is None:
            raise RuntimeError(f"{node.hostname} holds no desired state after the warm-up")
        heartbeat = Heartbeat(telemetry=node.telemetry(), jobs=tuple(node.observed()), desired_version=held[0])
        bodies.append((token, json.dumps(heartbeat.to_dict()).encode()))
    return bodies


async def heartbeat_rounds(application, bodies, rounds, *, expect=200, profiler=None, fold_cpu=None):
    """Returns [(CPU µs, wall µs) per heartbeat] of each round; the folder runs after each round,
    outside the measure (its CPU per heartbeat appended to `fold_cpu`)."""
    from asgiref.sync import sync_to_async

    from jobs.heartbeat_fold import heartbeats_fold_all

    figures = []
    for _ in range(rounds):
        cpu, wall = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for token, body in bodies:
            status, answer = await asgi_post(application, "/api/agent/heartbeat/", token, body)
            if status != expect:
                raise RuntimeError(f"heartbeat answered {status}, not {expect}: {answer[:300]!r}")
        if profiler is not None:
            profiler.disable()
        figures.append(((time.process_time() - cpu) / len(bodies) * 1e6,
                        (time.perf_counter() - wall) / len(bodies) * 1e6))
        began = time.process_time()
        # in Django's sync thread, where the web path's connection is (one connection, no lock wait)
        await sync_to_async(heartbeats_fold_all)()
        if fold_cpu is not None:
            fold_cpu.append((time.process_time() - began) / len(bodies) * 1e6)
    return figures


def heartbeat_parts(bodies, rounds):
    """Returns {part: median over rounds of the CPU µs per heartbeat} of each step of today's common
    case (jobs/heartbeat_api.py, jobs/heartbeats.py), each called directly in this thread, in order;
    the queue is folded after each round, outside the measure."""
    from django.conf import settings
    from rest_framework.renderers import JSONRenderer

    from fleet.leases import desired_serial_of
    from fleet.selectors import node_get_by_token
    from jobs.desired_version import node_desired_answer
    from jobs.heartbeat_fold import heartbeat_enqueue, heartbeats_fold_all
    from jobs.heartbeats import heartbeat_answer_of
    from protocol.node import Heartbeat

    def decode(token, body):
        return token, body, json.loads(body)

    parts = {"JSON decode": None, "Heartbeat.from_dict": None, "node_get_by_token (DB)": None,
             "desired_serial_of (Redis)": None, "node_desired_answer (DB)": None,
             "heartbeat_enqueue (Redis)": None, "answer: to_dict + JSONRenderer": None}
    figures = {name: [] for name in parts}
    for _ in range(rounds):
        spent = dict.fromkeys(parts, 0.0)
        for token, body in bodies:
            t0 = time.process_time()
            wire = json.loads(body)
            t1 = time.process_time()
            heartbeat = Heartbeat.from_dict(wire)
            t2 = time.process_time()
            node = node_get_by_token(token=token)
            t3 = time.process_time()
            serial = desired_serial_of(node_id=node.pk)
            t4 = time.process_time()
            desired, version = node_desired_answer(node=node, held_version=heartbeat.desired_version)
            t5 = time.process_time()
            if desired is not None:
                raise RuntimeError(f"node {node.pk}: its desired state changed during the measure")
            outcome = heartbeat_enqueue(node_id=node.pk, token_digest=node.agent_token_hash, wire=wire, body=body)
            t6 = time.process_time()
            JSONRenderer().render(heartbeat_answer_of(outcome, desired=None, version=version, serial=serial).to_dict())
            t7 = time.process_time()
            for name, took in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6), strict=True):
                spent[name] += took
        for name in parts:
            figures[name].append(spent[name] / len(bodies) * 1e6)
        heartbeats_fold_all()
    assert settings.MERIDIAN_HEARTBEAT_FOLD == "async"
    return {name: statistics.median(values) for name, values in figures.items()}


async def queued_parts(bodies, rounds):
    """Returns {part: median over rounds of the CPU µs per heartbeat} of each step of the common case
    as jobs.heartbeat_api._queued_answer takes it (each awaited in turn on this loop; the version
    check's hop into Django's sync thread is in its part); folded after each round, outside the measure."""
    from asgiref.sync import sync_to_async
    from rest_framework.renderers import JSONRenderer

    from fleet.lease_api import desired_serial_fetch, node_of_token_digest
    from fleet.models import node_token_hash
    from jobs.heartbeat_api import _version_current
    from jobs.heartbeat_fold import heartbeat_enqueue_packed, heartbeats_fold_all
    from jobs.heartbeats import heartbeat_answer_of
    from protocol.node import Heartbeat

    names = ("JSON decode", "Heartbeat.from_dict", "token map", "serial (Redis, packed)",
             "version check (hop + 1 statement)", "enqueue (Redis, packed)", "answer: to_dict + JSONRenderer")
    figures = {name: [] for name in names}
    for _ in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        for token, body in bodies:
            marks = [time.process_time()]
            wire = json.loads(body)
            marks.append(time.process_time())
            heartbeat = Heartbeat.from_dict(wire)
            marks.append(time.process_time())
            digest = node_token_hash(token)
            node_id = await node_of_token_digest(digest)
            marks.append(time.process_time())
            serial = await desired_serial_fetch(node_id)
            marks.append(time.process_time())
            if not await sync_to_async(_version_current)(node_id, digest, heartbeat.desired_version):
                raise RuntimeError(f"node {node_id}: not answered on the loop")
            marks.append(time.process_time())
            outcome = await heartbeat_enqueue_packed(node_id=node_id, token_digest=digest, wire=wire, body=body,
                                                     now=time.time())
            marks.append(time.process_time())
            JSONRenderer().render(heartbeat_answer_of(outcome, desired=None, version=heartbeat.desired_version,
                                                      serial=serial).to_dict())
            marks.append(time.process_time())
            for name, began, ended in zip(names, marks[:-1], marks[1:], strict=True):
                spent[name] += ended - began
        for name in names:
            figures[name].append(spent[name] / len(bodies) * 1e6)
        await sync_to_async(heartbeats_fold_all)()
    return {name: statistics.median(values) for name, values in figures.items()}


async def full_path_only(token, heartbeat, wire, body):
    return None  # jobs.heartbeat_api._queued_answer's "take the full path"


def print_parts(title, parts):
    print(f"\n{title} (CPU µs per heartbeat, median over rounds)")
    for name, value in parts.items():
        print(f"{name:>36} | {value:>7.0f}")
    print(f"{'sum':>36} | {sum(parts.values()):>7.0f}")


def main_full(args, loop, application):
    import secrets

    from jobs import heartbeat_api

    on_loop = heartbeat_api._queued_answer
    nodes = hollow_fleet(application, loop, args.size, args.nodes)
    bodies = steady_bodies(nodes)
    refused = [(secrets.token_urlsafe(24), body) for _token, body in bodies]
    loop.run_until_complete(heartbeat_rounds(application, bodies, 2))
    # Alternating rounds: the common case on the event loop (hb24), and through the full path in
    # Django's sync thread (what every heartbeat took before: heartbeat_api._queued_answer saying None).
    figures = {"on the loop (hb24)": [], "full path (before)": []}
    fold_cpu = {name: [] for name in figures}
    for _ in range(args.rounds):
        for name, answer in (("on the loop (hb24)", on_loop), ("full path (before)", full_path_only)):
            heartbeat_api._queued_answer = answer
            figures[name] += loop.run_until_complete(heartbeat_rounds(application, bodies, 1, fold_cpu=fold_cpu[name]))
    heartbeat_api._queued_answer = on_loop
    unknown = loop.run_until_complete(heartbeat_rounds(application, refused, max(2, args.rounds // 4), expect=401))
    print(f"\nfull heartbeats (async fold, the agent holds its desired state) through portal.asgi.application in "
          f"process (uvloop; {len(bodies)} nodes x {args.rounds} rounds of each, alternating; "
          f"{args.size} accelerators; "
          f"{statistics.mean(len(b) for _t, b in bodies):.0f} bytes per body; "
          f"PostgreSQL {args.db.rsplit('/', 1)[-1]}, Redis {args.redis})")
    print(f"{'request':>28} | {'CPU µs':>7} {'wall µs':>8} | {'folder CPU µs':>13}")
    print("-" * 63)
    for name, rounds in figures.items():
        print(f"{'200, ' + name:>28} | {statistics.median(f[0] for f in rounds):>7.0f} "
              f"{statistics.median(f[1] for f in rounds):>8.0f} | {statistics.median(fold_cpu[name]):>13.0f}")
    print(f"{'unknown token (401, Django)':>28} | {statistics.median(f[0] for f in unknown):>7.0f} "
          f"{statistics.median(f[1] for f in unknown):>8.0f} |")
    pairs = [before[0] / after[0] for after, before in zip(*figures.values(), strict=True)]
    print(f"CPU per heartbeat, full path / on the loop: median of the {len(pairs)} round pairs "
          f"{statistics.median(pairs):.2f}x (min {min(pairs):.2f}, max {max(pairs):.2f})")
    print_parts("the full path's steps called one by one in this thread (the rest of its CPU: the ASGI plumbing "
                "and the hop)", heartbeat_parts(bodies, args.rounds))
    print_parts("the loop's steps awaited one by one (the rest: the ASGI plumbing)",
                loop.run_until_complete(queued_parts(bodies, args.rounds)))
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.profile:
        profiled(loop, lambda profiler: heartbeat_rounds(application, bodies, 5, profiler=profiler),
                 pathlib.Path(args.profile) / "heartbeat.prof", orders=("tottime", "cumulative"), top=40)


def profiled(loop, rounds, path, *, orders, top):
    """Runs `rounds(profiler)` (a coroutine) on `loop` under cProfile (CPU time), writes the profile
    to `path` and prints its top functions in each of `orders`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile(time.process_time)
    loop.run_until_complete(rounds(profiler))
    profiler.dump_stats(path)
    for order in orders:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
        print(out.getvalue())


def main():
    args = parse_args()
    import uvloop

    cp.ensure_database(args.db)
    if args.full:
        os.environ["MERIDIAN_HEARTBEAT_FOLD"] = "async"
    cp.setup_django(args, pathlib.Path(tempfile.mkdtemp(prefix="bench-lp-")))
    from portal.asgi import application

    if args.full:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        main_full(args, loop, application)
        loop.close()
        return

    pairs = nodes_with_tokens(args.nodes)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(lease_rounds(application, pairs, 2))  # the token map, Redis's connection
    leases = loop.run_until_complete(lease_rounds(application, pairs, args.rounds))
    refused = loop.run_until_complete(lease_rounds(application, pairs, args.rounds, authenticated=False))
    print(f"\nleases through portal.asgi.application in process (uvloop; {args.nodes} nodes x {args.rounds} rounds; "
          f"PostgreSQL {args.db.rsplit('/', 1)[-1]}, Redis {args.redis})")
    print(f"{'request':>28} | {'CPU µs':>7} {'wall µs':>8}")
    print("-" * 47)
    for name, figures in (("lease (200)", leases), ("no token (401)", refused)):
        print(f"{name:>28} | {statistics.median(f[0] for f in figures):>7.0f} "
              f"{statistics.median(f[1] for f in figures):>8.0f}")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.profile:
        profiled(loop, lambda profiler: lease_rounds(application, pairs, 5, profiler=profiler),
                 pathlib.Path(args.profile) / "lease.prof", orders=("tottime",), top=30)
    loop.close()


if __name__ == "__main__":
    main()
