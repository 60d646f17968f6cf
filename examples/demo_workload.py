"""Keeps a running Meridian busy with real jobs of every tier, shipped as code bundles through
the same path `meridian submit` takes (pack examples/project, HEAD/PUT /api/bundles/<sha256>/,
POST /api/jobs/ with the digest), as the demo user alice.

    python examples/demo_workload.py --control-plane http://127.0.0.1:8000 [--jobs N] [--seed S]
                                     [--every SECONDS] [--max-waiting K]

First a wave that fills the fleet (Basic elastic jobs, then Standard, then Premium jobs that make
the scheduler shrink or preempt); then seeded arrivals (exponential gaps of mean --every
seconds, tiers drawn 45% Basic / 35% Standard / 20% Premium, sizes drawn per tier) for as long
as it runs, or until N jobs were submitted (--jobs N; `./meridian run --demo-workload=N`).
An arrival is held back while --max-waiting jobs already wait, so the queue stays readable.
"""
import argparse
import pathlib
import random
import signal
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.client import Client, CliError  # noqa: E402
from cli.commands import bundle_upload  # noqa: E402
from protocol import bundle as bundle_format  # noqa: E402

PROJECT = ROOT / "examples" / "project"
FIRST_WAVE = [  # (name, tier, W, min devices, epochs)
    ("basic-elastic-a", "basic", 4, 1, 160),
    ("basic-elastic-b", "basic", 4, 1, 160),
    ("basic-c", "basic", 2, 2, 100),
    ("standard-a", "standard", 2, 1, 100),
    ("standard-b", "standard", 4, 2, 100),
    ("premium-a", "premium", 4, 4, 80),
    ("premium-b", "premium", 2, 2, 80),
]
TIER_WEIGHTS = (("basic", 0.45), ("standard", 0.35), ("premium", 0.20))
SIZES = {  # tier -> [(W, min devices)] to draw from
    "basic": [(4, 1), (2, 1), (4, 2)],
    "standard": [(2, 1), (4, 2), (2, 2)],
    "premium": [(2, 2), (4, 4), (1, 1)],
}
EPOCHS = {"basic": (100, 200), "standard": (60, 140), "premium": (40, 100)}


def arrivals(seed: int, every: float):
    """Yields (gap seconds, name, tier, W, min devices, epochs) forever, the same for the same seed."""
    rng = random.Random(seed)
    for n in range(1, 10**9):
        tier = rng.choices([t for t, _ in TIER_WEIGHTS], weights=[w for _, w in TIER_WEIGHTS])[0]
        world_size, min_devices = rng.choice(SIZES[tier])
        yield (rng.expovariate(1.0 / every), f"{tier}-{n}", tier, world_size, min_devices,
               rng.randint(*EPOCHS[tier]))


def login(url: str, user: str, password: str, stop: threading.Event) -> Client:
    anonymous = Client(url, None)
    deadline = time.monotonic() + 120
    while not stop.is_set():
        try:
            answer = anonymous.request("POST", "/api/auth/token/", data={"username": user, "password": password})
            return Client(url, answer.json()["token"])
        except CliError as exc:
            if time.monotonic() > deadline:
                raise CliError(f"cannot log in as {user}: {exc.message}") from None
            stop.wait(1.0)
    raise CliError("stopped")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--control-plane", required=True)
    parser.add_argument("--user", default="alice")
    parser.add_argument("--password", default="alice-demo-pass")
    parser.add_argument("--jobs", type=int, default=0, help="stop after this many jobs (0: never)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--every", type=float, default=40.0, help="mean seconds between arrivals")
    parser.add_argument("--max-waiting", type=int, default=8)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        client = login(args.control_plane.rstrip("/"), args.user, args.password, stop)
    except CliError as exc:
        print(f"[demo] {exc.message}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="meridian-demo-") as scratch:
        archive = pathlib.Path(scratch) / "project.tar.gz"
        sha256, size, files = bundle_format.pack(PROJECT, archive)
        submitted = 0

        def submit(name, tier, world_size, min_devices, epochs):
            nonlocal submitted
            try:
                sent = bundle_upload(client, archive, sha256)
                job = client.post("/api/jobs/", {
                    "name": name, "tier": tier, "accelerator_type": "CPU", "world_size": world_size,
                    "min_devices": min_devices, "entrypoint": "train.py", "bundle": sha256,
                    "args": ["--epochs", str(epochs), "--step-sleep", "0.2"]})
            except CliError as exc:
                print(f"[demo] could not submit {name}: {exc.message}", flush=True)
                return
            submitted += 1
            print(f"[demo] submitted job {job['id']} {name} ({tier}, W={world_size}, min {min_devices}, "
                  f"bundle {sha256[:12]}{', uploaded ' + bundle_format.human_bytes(size) if sent else ''})",
                  flush=True)

        def done():
            return stop.is_set() or (args.jobs and submitted >= args.jobs)

        for job in FIRST_WAVE:
            if done():
                return 0
            submit(*job)
            stop.wait(20.0 if job[1] != "basic" else 2.0)  # let each wave land before the next tier
        for gap, *job in arrivals(args.seed, args.every):
            if done() or stop.wait(gap):
                return 0
            while not stop.is_set():
                try:
                    waiting = client.get("/api/jobs/", params={"state": "pending", "page_size": 1}).get("count", 0)
                except CliError:
                    waiting = 0
                if waiting < args.max_waiting:
                    break
                stop.wait(10.0)
            submit(*job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
