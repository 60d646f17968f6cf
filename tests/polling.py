"""The one way a test waits for something: poll a predicate until a deadline (STYLE.md: no sleeps).

Standard library only, so the end-to-end and browser harnesses (which talk to the system over
HTTP and must not import Django) use it too. Every test directory can import it as `polling`:
pytest puts tests/ on sys.path for the root conftest.py, and the bench that drives the browser
harness adds it itself.
"""
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

FIRST_INTERVAL_S = 0.02  # check again quickly at first: most waits end within a few tenths


class PollTimeout(AssertionError):
    """What a poll that ran out of time raises: an assertion, so the test fails (not errors) with `what`."""


def poll(what: str, predicate: Callable[[], T], *, timeout: float = 180, interval: float = 0.25,
         on_timeout: Callable[[], str] | None = None) -> T:
    """Returns predicate()'s first truthy value; raises PollTimeout naming `what` (plus on_timeout()'s
    diagnostics, if given) once `timeout` seconds pass without one.

    Checks every FIRST_INTERVAL_S at first, doubling the pause up to `interval` seconds, so a short
    wait ends soon and a long one does not hammer what it asks (a web server, a socket, /proc).
    """
    deadline = time.monotonic() + timeout
    delay = min(FIRST_INTERVAL_S, interval)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise PollTimeout(f"timed out after {timeout} s waiting for {what}" + (f"\n{extra}" if extra else ""))
        time.sleep(delay)  # the polling interval, not a wait for an event
        delay = min(delay * 2, interval)
