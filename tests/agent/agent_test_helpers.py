"""Helpers shared by the agent tests that drive real launchers."""
import time


def poll(what, predicate, timeout=180):
    """Returns predicate()'s first truthy value, checking every 0.1 s; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
