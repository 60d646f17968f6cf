"""The lease's one Redis command, two ways, alternating in one process: redis-py's asyncio client
(`execute_command`, what fleet/lease_api.py used before session 22) and fleet.lease_api's
LeaseConnections (the command packed once, sent on redis-py's own connections without the client's
per-command machinery).

    PYTHONPATH=$PWD .venv/bin/python bench/lease_redis_call.py [--redis redis://127.0.0.1:6379/13]
        [--blocks 20] [--calls 200]

Each block makes --calls leases (EVALSHA of the lease script: HSET meridian:lease, HGET the serial)
one after the other on a uvloop event loop, one way then the other; prints the median over blocks
of the CPU µs per call (time.process_time: this process only, Redis's own work is not in it) and
of the wall µs per call (the round trip in it), and whether hiredis was importable (redis-py parses
replies with it when it is). The machine is shared: compare the two columns of one run.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redis", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13"))
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    return p.parse_args()


async def block(call, calls):
    """Returns (CPU µs, wall µs) per call of `calls` calls of `call(node_id, now)`."""
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(calls):
        await call(i % 200 + 1, time.time())
    return (time.process_time() - cpu) / calls * 1e6, (time.perf_counter() - wall) / calls * 1e6


async def compare(args):
    import redis.asyncio

    from fleet.lease_api import (
        EVAL_PREFIX,
        EVALSHA_PREFIX,
        LEASE_REDIS_TIMEOUT_SECONDS,
        LEASE_SCRIPT,
        LEASE_SCRIPT_SHA,
        LeaseConnections,
    )
    from fleet.leases import DESIRED_SERIAL_KEY, LEASE_KEY

    client = redis.asyncio.Redis.from_url(args.redis, socket_timeout=LEASE_REDIS_TIMEOUT_SECONDS,
                                          socket_connect_timeout=LEASE_REDIS_TIMEOUT_SECONDS)
    await client.execute_command("EVAL", LEASE_SCRIPT, 2, LEASE_KEY, DESIRED_SERIAL_KEY, 0, "0")  # cached
    connections = LeaseConnections(args.redis)

    async def by_client(node_id, now):
        return await client.execute_command("EVALSHA", LEASE_SCRIPT_SHA, 2, LEASE_KEY, DESIRED_SERIAL_KEY,
                                            node_id, repr(now))

    async def by_lease_connections(node_id, now):
        return await connections.call(EVALSHA_PREFIX, node_id, now)

    assert EVAL_PREFIX  # the EVAL fallback is the same path (tests/fleet/test_node_lease.py)
    ways = {"redis-py client": by_client, "LeaseConnections": by_lease_connections}
    for call in ways.values():  # connect, warm up
        await block(call, args.calls)
    figures = {name: [] for name in ways}
    for _ in range(args.blocks):
        for name, call in ways.items():
            figures[name].append(await block(call, args.calls))
    await client.hdel(LEASE_KEY, *range(0, 201))
    await client.aclose()
    return figures


def main():
    args = parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")  # fleet.leases reads settings
    import django
    import redis.utils
    import uvloop

    django.setup()

    figures = uvloop.run(compare(args))
    print(f"\nthe lease's Redis command, {args.blocks} blocks x {args.calls} calls each way, alternating "
          f"(Redis {args.redis}; hiredis {'in use' if redis.utils.HIREDIS_AVAILABLE else 'not installed'})")
    print(f"{'way':>18} | {'CPU µs':>7} {'wall µs':>8}")
    print("-" * 37)
    for name, rows in figures.items():
        cpu, wall = (statistics.median(r[i] for r in rows) for i in (0, 1))
        print(f"{name:>18} | {cpu:>7.0f} {wall:>8.0f}")
    client_cpu = statistics.median(r[0] for r in figures["redis-py client"])
    lean_cpu = statistics.median(r[0] for r in figures["LeaseConnections"])
    print(f"client / LeaseConnections CPU: {client_cpu / lean_cpu:.2f}x")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
