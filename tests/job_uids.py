"""What the tests that run sandboxed jobs need from this machine (tests/sandbox, tests/e2e).

Job uids must reach the Python interpreter and the runtime. On the machines this project is tested
on, Python lives under /root (mode 0700): `reach_for_job_uids()` gives the folders on the way o+x
(traverse only, no listing) and says so. Without root or usable cgroups there is no sandbox:
`sandbox_unavailable()` says why, and the tests that need one skip with that reason.
"""
import os
import pathlib
import stat
import sys

from agent.sandbox import unreachable

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sandbox_unavailable() -> str | None:
    """Returns why jobs cannot be sandboxed on this machine, or None when they can."""
    from runtime import sandbox as mechanisms

    if os.geteuid() != 0:
        return "the sandbox needs root (job uids, cgroups)"
    try:
        mechanisms.detect_cgroups()
    except mechanisms.SandboxError as exc:
        return str(exc)
    return None


def reach_for_job_uids() -> None:
    """Gives the folders above the interpreter and the checkout o+x (as root; a no-op otherwise)."""
    if os.geteuid() != 0:
        return
    for path in (os.path.realpath(sys.executable), ROOT):
        for entry in unreachable(path):
            folder = entry.split(" (mode")[0]
            os.chmod(folder, os.stat(folder).st_mode | stat.S_IXOTH)
            print(f"[sandboxed tests] gave {folder} o+x so that job uids reach {path}", file=sys.stderr)
