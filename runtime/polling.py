"""A daemon thread that calls check() every interval_s (the rank's launcher and cut watchers)."""
import threading
import time


class PollingThread:
    """Subclasses set interval_s and implement check(); start() runs it on a daemon thread."""

    interval_s: float
    thread_name = "meridian-poll"

    def start(self):
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while True:
            time.sleep(self.interval_s)
            self.check()

    def check(self):
        raise NotImplementedError
