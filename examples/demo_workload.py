"""Submits a small real workload of every tier to a running Meridian, as the demo user alice,
then one more job every --every seconds until stopped (so the demo keeps moving).

    python examples/demo_workload.py --control-plane http://127.0.0.1:8000 [--every 90]

Jobs run examples/train_mlp.py (a tiny PyTorch MLP) on CPU slots: Basic elastic jobs fill the
fleet, Standard jobs join, then Premium jobs arrive and make the scheduler shrink or preempt.
"""
import argparse
import itertools
import signal
import sys
import threading
import time

import requests

WORKLOAD = [  # (name, tier, W, min devices, epochs)
    ("basic-elastic-a", "basic", 4, 1, 60),
    ("basic-elastic-b", "basic", 4, 1, 60),
    ("basic-c", "basic", 2, 2, 40),
    ("standard-a", "standard", 2, 1, 40),
    ("standard-b", "standard", 4, 2, 40),
    ("premium-a", "premium", 4, 4, 30),
    ("premium-b", "premium", 2, 2, 30),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--control-plane", required=True)
    parser.add_argument("--user", default="alice")
    parser.add_argument("--password", default="alice-demo-pass")
    parser.add_argument("--every", type=float, default=90.0)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    url = args.control_plane.rstrip("/")
    token = None
    deadline = time.monotonic() + 120
    while token is None and not stop.is_set():
        try:
            answer = requests.post(f"{url}/api/auth/token/", data={"username": args.user, "password": args.password},
                                   timeout=10)
            answer.raise_for_status()
            token = answer.json()["token"]
        except requests.RequestException as exc:
            if time.monotonic() > deadline:
                print(f"[demo] cannot log in as {args.user}: {exc}", file=sys.stderr)
                return 1
            stop.wait(1.0)
    session = requests.Session()
    session.headers["Authorization"] = f"Token {token}"

    def submit(name, tier, world_size, min_devices, epochs):
        spec = {"name": name, "tier": tier, "accelerator_type": "CPU", "world_size": world_size,
                "min_devices": min_devices, "entrypoint": "examples/train_mlp.py",
                "args": ["--epochs", str(epochs), "--step-sleep", "0.2"]}
        response = session.post(f"{url}/api/jobs/", json=spec, timeout=30)
        print(f"[demo] submitted {name} ({tier}, W={world_size}, min {min_devices}): {response.status_code}",
              flush=True)

    for job in WORKLOAD:
        if stop.is_set():
            return 0
        submit(*job)
        stop.wait(20.0 if job[1] != "basic" else 2.0)  # let each wave land before the next tier
    for n in itertools.count(1):
        if stop.wait(args.every):
            return 0
        name, tier, w, m, epochs = WORKLOAD[n % len(WORKLOAD)]
        submit(f"{name}-{n}", tier, w, m, epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
