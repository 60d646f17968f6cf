"""Writes 200 KB into /tmp (the job's private /tmp), then waits to be stopped."""
import time

with open("/tmp/huge.bin", "wb") as handle:
    handle.write(b"0" * 200_000)
for _ in range(1200):
    time.sleep(0.1)
