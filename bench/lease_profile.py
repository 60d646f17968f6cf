"""Where a liveness lease's CPU goes: POST /api/agent/lease/ through the ASGI application, in process.

    BENCH_REDIS_URL=redis://127.0.0.1:6379/13 PYTHONPATH=$PWD .venv/bin/python bench/lease_profile.py \
        [--nodes 200] [--rounds 20] [--db postgres://postgres@127.0.0.1:5432/meridian_bench_lp] [--profile DIR]

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
    p.add_argument("--profile", help="a folder for lease.prof")
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


def lease_scope(token):
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"content-length", b"22")]
    if token:
        headers.append((b"authorization", f"Node {token}".encode()))
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/api/agent/lease/", "raw_path": b"/api/agent/lease/",
            "query_string": b"", "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000)}


async def lease_once(application, node_id, token, expect):
    body = json.dumps({"v": 1, "node_id": node_id}).encode()
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    await application(lease_scope(token), receive, send)
    if sent[0]["status"] != expect:
        raise RuntimeError(f"lease answered {sent[0]['status']}, not {expect}: {sent[1].get('body')!r}")


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


def main():
    args = parse_args()
    import uvloop

    cp.ensure_database(args.db)
    cp.setup_django(args, pathlib.Path(tempfile.mkdtemp(prefix="bench-lp-")))
    from portal.asgi import application

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
        folder = pathlib.Path(args.profile)
        folder.mkdir(parents=True, exist_ok=True)
        profiler = cProfile.Profile(time.process_time)
        loop.run_until_complete(lease_rounds(application, pairs, 5, profiler=profiler))
        profiler.dump_stats(folder / "lease.prof")
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
    loop.close()


if __name__ == "__main__":
    main()
