"""The launcher's exit codes and the one error it reports in words: shared by the launcher and the
checkpoint engines (runtime/engines.py), which raise it from inside a cut, a dump or a restore."""

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 75
# A rank's (not the launcher's): the framework engine refused to resume the re-run script (it is
# not the run that was cut); the reason is in <spool>/rank<r>/refused.json.
EXIT_RESUME_REFUSED = 77
# The launcher's: it fenced itself, its node agent silent past the lost-node limit (runtime/fence.py).
EXIT_FENCED = 78
REFUSED_FILE = "refused.json"


CHILD_END_WAIT_S = 2.0


def end_children() -> int:
    """Called by a rank just before it ends with os._exit (a stop at a cut, a refused resume, its
    launcher gone): SIGKILLs and reaps the processes it started through multiprocessing (the
    script's DataLoader workers) and returns how many. os._exit runs no iterator shutdown, so the
    workers are not told: they live on until their watchdog sees the rank gone (~5 s), and one
    caught in a lock at fork (the rank has threads) never does, holding the rank's memory, cgroup
    and output pipes for good (seen: a test's pipes held 300 s). Their state is in no checkpoint:
    the framework engine rebuilds the loaders at a resume, CRIU has dumped them already."""
    import multiprocessing
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        # torch's DataLoader turns a worker's death into an exception in the main thread (its
        # SIGCHLD handler): these deaths are ours, and the rank ends next.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(CHILD_END_WAIT_S)
    return len(children)


class LaunchError(RuntimeError):
    """A failure the launcher reports in words and an exit code, not a traceback."""

    def __init__(self, message: str, code: int = EXIT_FAILED, *, host_failure: bool = False):
        super().__init__(message)
        self.code = code
        # The job cannot go on because a host of it failed under it (this one fenced itself, a
        # peer fell silent, the leader is unreachable), not because of its code: restarted from
        # its last checkpoint by the control plane, not failed (protocol.launch.Failed.host_failure).
        self.host_failure = host_failure or code == EXIT_FENCED
