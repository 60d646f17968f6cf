"""The CRIU checkpoint engine: dump and restore whole rank processes (CRIU >= 4.0, root).

Each rank runs as the init of its own PID namespace (``unshare --pid --fork setsid``), so its
PIDs are free again at restore time on any node (restore needs the original PIDs) and CRIU does
not refuse a session leader outside the namespace. Ranks are dumped serially (parallel dumps
from one working directory race in CRIU: "Can't get /proc fd") once they are parked at a
consistent cut with no socket and no io_uring fd open (the virtual group closed its inner
gloo group). Restored processes are detached (``criu restore -d``) and, because the launcher
is a child subreaper, become the launcher's children.

A PID-namespace init ignores SIGTERM from outside: stop a rank with SIGKILL.

SANDBOXED RANKS (runtime/sandbox.py: the job's uid, its own mount namespace with the job's private
/tmp and /dev/shm, its network namespace) are dumped and restored by criu run AS THE JOB'S UID in
CRIU's unprivileged mode (`JobCredentials`): root here may lack CAP_SYS_RESOURCE, which root's criu
needs to dump another uid's tasks. criu gets the capabilities DUMP_CAPS (RESTORE_CAPS) as ambient
ones, for itself only. The rank's PID and mount namespaces are dumped with it; the private /tmp and
/dev/shm are external mounts ("tmp", "shm") that a restore maps onto the restoring launcher's NEW
private folders; the paths bound back into them (spool, store, interpreter...) are auto-mapped to the
same node paths. The network namespace is the launcher's (runtime/netns.py), which criu runs in: it
is not dumped, and a restored rank joins the restoring launcher's own (loopback only; for a job
spanning hosts, the restoring host's part of the job's network, whose address is the same part's,
each host dumping and restoring its own part the same way: runtime/engines.py dump_host_ranks,
runtime/criu_parts.py).
A restore runs inside the private-dirs helper (runtime/private_dirs.py) so that criu, as the job's
uid, reaches the new private /tmp, its work folder and the images through bind mounts ("doors") of
a mount namespace of its own (the job dir that holds them is root's, 0700), with --root on a flat
bind of the node's root: the restored namespace holds the rank's own mounts and nothing of criu's,
so a restored rank can be dumped and restored again. The restored tasks are left
stopped (--leave-stopped) and `restored_refusal` checks every one of them (the job's uid and gid,
no capability, no_new_privs, the launcher's user and network namespaces and cgroups, its own PID and
mount namespaces) before anything lets them run: criu holds sys_admin while it restores, and the
images were written by the job's uid. (While criu writes them, every process of the job on this
host is stopped, and each rank's images are sealed, root's, before any runs again: runtime/engines.py
CriuEngine.dump. The check holds whatever an image says all the same.) The private folders'
CONTENTS travel in the checkpoint (`PrivateDirs.save_into`): a restored rank may hold files open
there, which criu reopens by path and size.
"""
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

MIN_MAJOR = 4
PR_SET_CHILD_SUBREAPER = 36
# What criu needs, as the job's uid, to dump (restore) a sandboxed rank: tried one by one (devlog
# lead19): sys_chroot to setns into the rank's mount namespace, sys_admin to read and rebuild it,
# setpcap for the restorer to drop the bounding set to the image's.
DUMP_CAPS = ("checkpoint_restore", "sys_ptrace", "sys_admin", "sys_chroot")
RESTORE_CAPS = (*DUMP_CAPS, "setpcap")
EXTERNAL_TMP, EXTERNAL_SHM = "tmp", "shm"  # the keys of the private /tmp and /dev/shm in the images


@dataclass(frozen=True)
class JobCredentials:
    """The job's uid and gid, as which criu dumps and restores a sandboxed rank."""

    uid: int
    gid: int

    def prefix(self, caps: tuple[str, ...]) -> list[str]:
        """Returns the command prefix that runs criu as this uid with `caps` (ambient: criu's own;
        the restorer gives the restored tasks the image's, which restored_refusal checks)."""
        binary = shutil.which("setpriv")
        if binary is None:
            raise CriuUnavailable("setpriv (util-linux) is not installed; criu runs as the job's uid through it")
        wanted = ",".join(f"+{cap}" for cap in caps)
        return [binary, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                f"--inh-caps={wanted}", f"--ambient-caps={wanted}", "--"]


@dataclass(frozen=True)
class SandboxedRestore:
    """Where a sandboxed rank is restored: its credentials, the restoring launcher's NEW private
    /tmp and /dev/shm, and `doors`, a root folder the job's uid can pass through where the helper
    binds the folders criu needs (`restore`)."""

    job: JobCredentials
    tmp: str
    shm: str
    doors: str


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


def _run(args, log_path, what, *, prefix=()):
    binary = criu_binary()
    result = subprocess.run([*prefix, binary] + args + ["--log-file", str(log_path), "-v2"],
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


def dump(pid, image_dir, *, leave_running, job: JobCredentials | None = None):
    """Dumps the process tree rooted at `pid` (a PID-namespace init) into image_dir. With `job`
    (a sandboxed rank): as the job's uid, its private /tmp and /dev/shm declared external; the image
    folder is the job's while criu writes it (the caller seals it after)."""
    # Not makedirs: a staging folder that is gone (swept as abandoned: runtime/store.py) must fail
    # this dump, not be recreated half empty.
    with contextlib.suppress(FileExistsError):
        os.mkdir(image_dir)
    args = ["dump", "-t", str(pid), "-D", str(image_dir)]
    if leave_running:
        args.append("--leave-running")
    log = os.path.join(os.path.dirname(str(image_dir).rstrip("/")),
                       f"dump-{os.path.basename(str(image_dir).rstrip('/'))}.log")
    if job is None:
        _run(args, log, "dump")
        return
    os.chown(image_dir, job.uid, job.gid)
    os.chmod(image_dir, 0o700)
    args += ["--unprivileged", "--external", f"mnt[/tmp]:{EXTERNAL_TMP}",
             "--external", f"mnt[/dev/shm]:{EXTERNAL_SHM}", "--ext-mount-map", "auto",
             "--enable-external-sharing", "--enable-external-masters"]
    # criu writes its log as the job's uid: into the image folder, moved out by root after.
    inside = os.path.join(str(image_dir), "dump.log")
    try:
        _run(args, inside, "dump", prefix=job.prefix(DUMP_CAPS))
    finally:
        if os.path.lexists(inside):
            os.replace(inside, log)


def restore(image_dir, *, work_dir, sandboxed: SandboxedRestore | None = None):
    """Restores a dumped rank detached; returns its host PID (a child of this subreaper). With
    `sandboxed`, as the job's uid onto the new private folders, and LEFT STOPPED: the caller checks
    the tasks (restored_refusal) before it lets them run (resume_restored)."""
    os.makedirs(work_dir, exist_ok=True)
    name = os.path.basename(str(image_dir).rstrip("/"))
    pidfile = os.path.join(work_dir, f"restore-{name}.pid")
    if os.path.exists(pidfile):
        os.unlink(pidfile)
    log = os.path.join(work_dir, f"restore-{name}.log")
    if sandboxed is None:
        _run(["restore", "-D", str(image_dir), "-d", "--pidfile", pidfile], log, "restore")
    else:
        _restore_as_job(image_dir, work_dir=work_dir, name=name, sandboxed=sandboxed)
    with open(pidfile) as handle:
        return int(handle.read().strip())


def _restore_as_job(image_dir, *, work_dir, name, sandboxed: SandboxedRestore):
    """Runs `criu restore` as the job's uid, in a mount namespace of its own where the helper
    (runtime/private_dirs.py) bound the images, the work folder and the new private /tmp at doors
    the uid can pass (all three lie in folders of root's it cannot enter)."""
    from runtime import private_dirs
    job = sandboxed.job
    os.chown(work_dir, job.uid, job.gid)  # criu writes its log and pidfile there
    os.chmod(work_dir, 0o700)
    doors = {key: os.path.join(sandboxed.doors, key) for key in ("images", "work", "tmp", "root")}
    os.makedirs(sandboxed.doors, exist_ok=True)
    os.chmod(sandboxed.doors, 0o755)
    for door in doors.values():
        with contextlib.suppress(FileExistsError):
            os.mkdir(door, 0o755)
    helper = [sys.executable, "-I", os.path.abspath(private_dirs.__file__),
              "--bind", f"{os.path.abspath(image_dir)}={doors['images']}",
              "--bind", f"{os.path.abspath(work_dir)}={doors['work']}",
              "--bind", f"{sandboxed.tmp}={doors['tmp']}", "--flat-bind", f"/={doors['root']}", "--"]
    # The restored mount namespace starts from a bind of --root WITH the mounts below it: with
    # "/", it took every mount of criu's namespace (the doors, and criu's own /tmp/cr-tmpfs.*),
    # which the next dump recorded and the next restore could not recreate as the job's uid
    # (found: "Can't bind-mount ... .criu-restore/work: Permission denied"). The node's root
    # alone, flat, is the base: every mount the rank had is in its images (auto-mapped).
    args = ["restore", "--unprivileged", "-D", doors["images"], "-d", "--root", doors["root"], "--leave-stopped",
            "--pidfile", os.path.join(doors["work"], f"restore-{name}.pid"),
            "--external", f"mnt[{EXTERNAL_TMP}]:{doors['tmp']}",
            "--external", f"mnt[{EXTERNAL_SHM}]:{sandboxed.shm}", "--ext-mount-map", "auto"]
    binary = criu_binary()
    result = subprocess.run([*helper, *job.prefix(RESTORE_CAPS), binary, *args,
                             "--log-file", os.path.join(doors["work"], f"restore-{name}.log"), "-v2"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        tail = ""
        with contextlib.suppress(OSError):
            with open(os.path.join(work_dir, f"restore-{name}.log")) as handle:
                tail = "".join(handle.readlines()[-15:])
        raise RuntimeError(f"criu restore (as uid {job.uid}) failed (exit {result.returncode}): "
                           f"{result.stderr.strip()[-2000:]}\n--- tail of its log ---\n{tail}")


# -- a restored sandboxed rank, checked before it runs ------------------------------------------------
CAP_FIELDS_NONE = ("CapInh", "CapPrm", "CapEff", "CapAmb")


def _status(path: str) -> dict[str, str]:
    with open(path) as handle:
        return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)


def restored_tasks(pid: int) -> list[int]:
    """Returns `pid` and every process below it (children of all its threads), parents first."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        found.append(current)
        for tid in os.listdir(f"/proc/{current}/task"):
            with open(f"/proc/{current}/task/{tid}/children") as handle:
                queue.extend(int(child) for child in handle.read().split())
    return found


def restored_refusal(pid: int, *, job: JobCredentials) -> str | None:
    """Returns None when the restored tree rooted at `pid` is what a sandboxed rank must be, else
    the first thing that is not: every thread of every process runs as the job's uid and gid (real,
    effective, saved, filesystem) with no supplementary group, holds no capability (inheritable,
    permitted, effective, ambient) and no bounding capability this launcher lacks, has no_new_privs
    set (setpriv --no-new-privs started it so), is in this launcher's user and network namespaces and
    its cgroups (the job's), and in PID and mount namespaces other than the launcher's (its own).
    The root must be this launcher's child (a pidfile the job's uid could write names no other)."""
    mine = _status("/proc/self/status")
    bounding = int(mine["CapBnd"], 16)
    with open("/proc/self/cgroup") as handle:
        cgroups = handle.read()
    try:
        root = _status(f"/proc/{pid}/status")
        if int(root["PPid"]) != os.getpid():
            return f"pid {pid} is not a process criu restored for this launcher (its parent is {root['PPid']})"
        for process in restored_tasks(pid):
            for name in ("user", "net"):
                if os.readlink(f"/proc/{process}/ns/{name}") != os.readlink(f"/proc/self/ns/{name}"):
                    return f"restored process {process} is in another {name} namespace than its launcher's"
            for name in ("pid", "mnt"):
                if os.readlink(f"/proc/{process}/ns/{name}") == os.readlink(f"/proc/self/ns/{name}"):
                    return f"restored process {process} is in its launcher's {name} namespace, not its own"
            with open(f"/proc/{process}/cgroup") as handle:
                if handle.read() != cgroups:
                    return f"restored process {process} is not in the job's cgroups"
            for tid in os.listdir(f"/proc/{process}/task"):
                status = _status(f"/proc/{process}/task/{tid}/status")
                where = f"restored task {tid} (process {process})"
                if {int(v) for v in status["Uid"].split()} != {job.uid}:
                    return f"{where} has uids {status['Uid'].split()}, not the job's {job.uid}"
                if {int(v) for v in status["Gid"].split()} != {job.gid}:
                    return f"{where} has gids {status['Gid'].split()}, not the job's {job.gid}"
                if status.get("Groups", "").strip():
                    return f"{where} has supplementary groups {status['Groups'].strip()}"
                for field in CAP_FIELDS_NONE:
                    if int(status[field], 16):
                        return f"{where} holds capabilities ({field} {status[field]})"
                if int(status["CapBnd"], 16) & ~bounding:
                    return f"{where} has bounding capabilities its launcher lacks ({status['CapBnd']})"
                if status.get("NoNewPrivs", "0").strip() != "1":
                    return f"{where} lost no_new_privs"
    except (OSError, KeyError, ValueError) as exc:
        return f"the restored tasks of pid {pid} cannot be checked: {exc}"
    return None


def resume_restored(pid: int) -> None:
    """Lets a checked, stopped restored tree run (SIGCONT to each of its processes)."""
    for process in restored_tasks(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGCONT)


def kill_restored(pid: int) -> None:
    """Kills a restored tree that must not run (SIGKILL reaches stopped tasks too)."""
    try:
        processes = restored_tasks(pid)
    except OSError:
        processes = [pid]
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGKILL)
