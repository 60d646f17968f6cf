"""The launcher's exit codes and the one error it reports in words: shared by the launcher and the
checkpoint engines (runtime/engines.py), which raise it from inside a cut, a dump or a restore."""

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 75
# A rank's (not the launcher's): the framework engine refused to resume the re-run script (it is
# not the run that was cut); the reason is in <spool>/rank<r>/refused.json.
EXIT_RESUME_REFUSED = 77
REFUSED_FILE = "refused.json"


class LaunchError(RuntimeError):
    """A failure the launcher reports in words and an exit code, not a traceback."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code
