"""The CRIU checkpoint engine: dump and restore whole rank processes (CRIU >= 4.0, root).

Each rank runs as the init of its own PID namespace (``unshare --pid --fork setsid``), so its
PIDs are free again at restore time on any node (restore needs the original PIDs) and CRIU does
not refuse a session leader outside the namespace. Ranks are dumped serially (parallel dumps
from one working directory race in CRIU: "Can't get /proc fd") once they are parked at a
consistent cut with no socket and no io_uring fd open (the virtual group closed its inner
gloo group). Restored processes are detached (``criu restore -d``) and, because the launcher
is a child subreaper, become the launcher's children.

A PID-namespace init ignores SIGTERM from outside: stop a rank with SIGKILL.

SANDBOXED RANKS ARE NOT DUMPED (runtime/sandbox.py criu_refusal_for_sandbox refuses them): each
starts in a mount namespace of its own with the job's private /tmp and /dev/shm bind-mounted over
the node's, and runs as the job's uid. `dump` and `restore` below run criu as root with no
external mounts. A recipe that dumped and restored such a rank by hand (criu as the job's uid, its
private folders declared external), and what building it needs, is in runtime/private_dirs.py.
"""
import contextlib
import ctypes
import os
import re
import shutil
import subprocess

MIN_MAJOR = 4
PR_SET_CHILD_SUBREAPER = 36


class CriuUnavailable(RuntimeError):
    """CRIU cannot be used here; the message says why and what to do."""


def criu_binary():
    return shutil.which("criu") or ("/usr/local/sbin/criu" if os.path.exists("/usr/local/sbin/criu") else None)


def check_available():
    """Returns (True, version) when CRIU >= 4 is installed and `criu check` passes as root,
    else (False, reason a person can act on)."""
    binary = criu_binary()
    if binary is None:
        return False, "criu is not installed (run scripts/install-criu.sh as root)"
    if os.geteuid() != 0:
        return False, "criu needs root and this process is not root"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not match or int(match.group(1)) < MIN_MAJOR:
        return False, (f"criu at {binary} is too old ({version.strip() or 'unknown version'}); "
                       f"need >= {MIN_MAJOR}.0 (run scripts/install-criu.sh)")
    check = subprocess.run([binary, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        return False, f"`criu check` failed on this kernel: {(check.stderr or check.stdout).strip()[-500:]}"
    return True, f"{match.group(1)}.{match.group(2)}.{match.group(3) or 0}"


def become_subreaper():
    """Makes orphaned descendants (restored ranks) children of this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def namespace_command(command, *, own_proc=False):
    """Returns the command that runs `command` as the init of a fresh PID namespace.

    `own_proc`: also in a mount namespace of its own with a /proc of its PID namespace. Needed by
    a rank that runs as an unprivileged uid (the sandbox): CRIU's parasite, which runs with the
    rank's credentials, must open a /proc that belongs to the rank's PID namespace, and only root
    may mount one there itself ("can't dump unprivileged task whose /proc doesn't belong to it")."""
    # No --kill-child: it sets PR_SET_PDEATHSIG, which CRIU restores, and the restored rank
    # would be killed when its restoring criu process exits.
    return ["unshare", "--pid", "--fork"] + (["--mount-proc"] if own_proc else []) + ["setsid"] + list(command)


def namespace_init_pid(unshare_pid, deadline_s=30.0):
    """Returns the host PID of the process unshare forked (the rank), polling until it exists."""
    import time
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as handle:
                children = handle.read().split()
        except FileNotFoundError:
            raise RuntimeError(f"unshare (pid {unshare_pid}) exited before starting the rank") from None
        if children:
            return int(children[0])
        time.sleep(0.005)
    raise RuntimeError(f"unshare (pid {unshare_pid}) did not start the rank within {deadline_s} s")


def _run(args, log_path, what):
    binary = criu_binary()
    result = subprocess.run([binary] + args + ["--log-file", str(log_path), "-v2"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        tail = ""
        try:
            with open(log_path) as handle:
                tail = "".join(handle.readlines()[-15:])
        except OSError:
            pass
        raise RuntimeError(f"criu {what} failed (exit {result.returncode}): "
                           f"{result.stderr.strip()}\n--- tail of {log_path} ---\n{tail}")


def dump(pid, image_dir, *, leave_running):
    """Dumps the process tree rooted at `pid` (a PID-namespace init) into image_dir."""
    # Not makedirs: a staging folder that is gone (swept as abandoned: runtime/store.py) must fail
    # this dump, not be recreated half empty.
    with contextlib.suppress(FileExistsError):
        os.mkdir(image_dir)
    args = ["dump", "-t", str(pid), "-D", str(image_dir)]
    if leave_running:
        args.append("--leave-running")
    _run(args, os.path.join(os.path.dirname(str(image_dir).rstrip("/")),
                            f"dump-{os.path.basename(str(image_dir).rstrip('/'))}.log"), "dump")


def restore(image_dir, *, work_dir):
    """Restores a dumped rank detached; returns its host PID (a child of this subreaper)."""
    os.makedirs(work_dir, exist_ok=True)
    name = os.path.basename(str(image_dir).rstrip("/"))
    pidfile = os.path.join(work_dir, f"restore-{name}.pid")
    if os.path.exists(pidfile):
        os.unlink(pidfile)
    _run(["restore", "-D", str(image_dir), "-d", "--pidfile", pidfile],
         os.path.join(work_dir, f"restore-{name}.log"), "restore")
    with open(pidfile) as handle:
        return int(handle.read().strip())
