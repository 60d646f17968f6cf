"""A sandboxed job's private /tmp and /dev/shm on one node, and (run as a script) the root helper
that puts them in place in each rank's own mount namespace.

Why: a rank that runs as the job's uid (runtime/sandbox.py) otherwise shares the node's /tmp and
/dev/shm with every other job and with the agent: it could list and read what they left there when
the modes allow, fill them, or squat their names.

Where (made by the launcher, as root, before any rank starts; `PrivateDirs.create`):
    /tmp      <job dir>/tmp: the job dir is the agent's per-attempt folder under <work dir>/j
              (0700, root's), so no other uid reaches it by its node path; on disk, not in RAM.
    /dev/shm  /dev/shm/meridian-job-<job id>-<nonce>: on the node's /dev/shm tmpfs, so shared memory
              stays memory (runtime/localreduce.py's area lives there; its pages are charged to the
              job's memory cgroup as before).
Both are root:<job gid> mode 1770 (as the node's own are 1777): the ranks create files, no other
uid enters, and the folders the launcher made inside (below) cannot be renamed by the job.

How each rank starts (`PrivateDirs.command` + the setpriv prefix + the rank):
    python -I runtime/private_dirs.py --bind SRC=TARGET ... --cover /tmp=DIR --cover /dev/shm=DIR
        -- setpriv --reuid=<job uid> ... python -m runtime.rank ...
The helper (root, this file, standard library only, `-I` so nothing of the job's environment such
as PYTHONPATH can load code into it) unshares a mount namespace, makes every mount in it private
(nothing it mounts reaches the node, nothing the node mounts later reaches it), bind-mounts the two
folders over /tmp and /dev/shm and execs the rest. Each rank has a namespace of its own, but all of
them bind the same two folders: the ranks of one job on one host share one /tmp and one /dev/shm.

Paths the ranks need that lie under the node's /tmp or /dev/shm (the spool, the workspace, the
checkpoint store, the script's folder, the interpreter: a test node's work dir is often in /tmp)
would be hidden by the cover: each is bound back at its own path inside the private folder first
(`--bind`), on a skeleton of root-owned folders the launcher makes before any rank runs. Only those
paths: the rest of the node's /tmp stays out of sight.

Removal: the launcher removes both folders when its ranks are gone on this host (the end, a stop
for a move, a failure). A launcher that was killed leaves them: the /dev/shm folder is swept
(`sweep`) by the next sandboxed launcher on the node, by the agent at start and after it kills a
job, whoever finds its lock free (the launcher holds a flock on it for its whole life); the /tmp
folder goes with its job dir (the agent removes it after a kill, and old job dirs are collected).

CRIU (runtime/criu.py, runtime/engines.py CriuEngine): a sandboxed rank is dumped and restored by
criu run AS THE JOB'S UID in its unprivileged mode (root here may lack CAP_SYS_RESOURCE, which root's
criu needs for another uid). What that needs from this file:
- the helper binds each kept path from a folder it opened before the covers (not into the private
  folder first): a bind made there stays mounted at a node path inside the job dir too, which criu,
  as the job's uid, cannot reach to recreate it ("Permission denied").
- the helper reopens stdin, stdout and stderr by path inside the new namespace: inherited ones name
  mounts of the node's namespace, which the dump cannot resolve ("Can't lookup mount").
- a restore runs criu inside this helper (no covers, only binds: images, work folder, the new
  private /tmp at "doors" the job's uid can pass, the job dir that holds them being root's, 0700;
  and `--flat-bind /=DOOR`, the node's root without the mounts on it, as criu's --root).
- the contents of both folders travel in the checkpoint (`save_into`, `load_from`: private-tmp.tar,
  private-shm.tar, owners and modes kept): a restored rank holding a file open there gets it back at
  its size. What cannot travel (a device, a fifo, a link leading outside the folder, a file of another
  uid) refuses the checkpoint, naming it. A unix socket file cannot travel either (a copied file is
  no socket): one that a process of the job holds bound (`bound_unix_sockets`: a server a rank
  started, listening there) refuses the checkpoint, naming it, since after a restore its clients
  would find nothing; a stale one (its process ended, the file stayed) is left out and RECORDED:
  save_into returns it with the reason, and the checkpoint's manifest and event say so
  (runtime/engines.py, runtime/launcher.py).
The dump declares /tmp and /dev/shm external ("tmp", "shm") and the restore maps them onto the NEW
folders of the restoring launcher; every restored task is checked before it runs (criu.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import pathlib
import shutil
import stat
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass, field

NODE_TMP = "/tmp"
NODE_SHM = "/dev/shm"
SHM_PREFIX = "meridian-job-"
CREATING_PREFIX = ".meridian-job-"  # made and locked under this name, then renamed (see create)
DIR_MODE = 0o1770  # root:<job gid>, sticky: like the node's 1777, for the job's group only
SKELETON_MODE = 0o755  # root's folders on the way to a bound path: passable, not writable
STALE_CREATING_S = 60.0  # a half-made folder this old, with its lock free, is a killed launcher's

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18


class PrivateDirsError(RuntimeError):
    """The private /tmp or /dev/shm cannot be made; the message says why."""


def _under(path: pathlib.PurePath, root: pathlib.PurePath) -> bool:
    return path != root and path.is_relative_to(root)


@dataclass
class PrivateDirs:
    """One launcher's private /tmp and /dev/shm for its job's ranks on this host."""

    tmp: pathlib.Path
    shm: pathlib.Path
    binds: tuple[tuple[str, str], ...]  # (node path, mount point in a private folder), outer first
    _lock_fd: int | None = field(default=None, repr=False)

    @classmethod
    def create(cls, *, job_dir: os.PathLike | str, job_id: str, gid: int, keep: list[os.PathLike | str]) -> PrivateDirs:
        """Makes the two folders (a leftover <job dir>/tmp of an earlier launcher there is emptied
        first) and the skeleton for each path of `keep` under /tmp or /dev/shm; returns them, with
        the /dev/shm folder's lock held. Raises PrivateDirsError when it cannot."""
        if not os.path.isdir(NODE_SHM):
            raise PrivateDirsError(f"{NODE_SHM} does not exist: the ranks' private /dev/shm is made there")
        tmp = pathlib.Path(job_dir).absolute() / "tmp"
        if os.path.lexists(tmp):
            _remove(tmp)
        os.mkdir(tmp)
        _give(tmp, gid)
        # Made and locked under a name `sweep` ignores, then renamed: a sweep never sees the final
        # name unlocked while its launcher lives.
        nonce = uuid.uuid4().hex[:12]
        creating = pathlib.Path(NODE_SHM) / f"{CREATING_PREFIX}{job_id}-{nonce}"
        os.mkdir(creating, 0o700)
        lock_fd = os.open(creating, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shm = pathlib.Path(NODE_SHM) / f"{SHM_PREFIX}{job_id}-{nonce}"
        os.rename(creating, shm)
        _give(shm, gid)
        dirs = cls(tmp=tmp, shm=shm, binds=(), _lock_fd=lock_fd)
        try:
            dirs.binds = tuple(dirs._skeleton(keep))
        except BaseException:
            dirs.remove()
            raise
        return dirs

    def covers(self) -> tuple[tuple[str, pathlib.Path], ...]:
        return ((NODE_TMP, self.tmp), (NODE_SHM, self.shm))

    def _skeleton(self, keep: list[os.PathLike | str]) -> list[tuple[str, str]]:
        """Returns the binds (node source, mount point) for the paths of `keep` that the covers
        would hide, after making their mount points: root's folders (an empty file for a file)
        inside the private folders. A path is looked at both as given (what the ranks are told)
        and resolved (where a link leads); one inside another comes with the outer one."""
        wanted: dict[pathlib.Path, pathlib.Path] = {}  # where a rank looks -> the node's source
        for path in keep:
            given, real = pathlib.Path(os.path.abspath(path)), pathlib.Path(os.path.realpath(path))
            if not os.path.exists(real):
                continue
            for node_dir, _ in self.covers():
                for root in {pathlib.Path(node_dir), pathlib.Path(os.path.realpath(node_dir))}:
                    for seen in {given, real}:
                        if seen == root:
                            raise PrivateDirsError(f"{path} is the node's {node_dir} itself, which the job's private "
                                                   f"{node_dir} hides; give the job a folder of its own")
                        if _under(seen, root):
                            wanted.setdefault(pathlib.Path(node_dir) / seen.relative_to(root), real)
        binds: list[tuple[str, str]] = []
        taken: list[pathlib.Path] = []
        for target in sorted(wanted, key=lambda p: len(p.parts)):
            if any(target.is_relative_to(outer) for outer in taken):
                continue
            taken.append(target)
            source = wanted[target]
            private = next(p for d, p in self.covers() if _under(target, pathlib.Path(d)))
            node_dir = next(d for d, p in self.covers() if p == private)
            point = private
            parts = target.relative_to(node_dir).parts
            for index, part in enumerate(parts):
                point = point / part
                if not os.path.lexists(point):
                    if index == len(parts) - 1 and not source.is_dir():
                        os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
                    else:
                        os.mkdir(point)
                        os.chmod(point, SKELETON_MODE)
                info = os.lstat(point)
                if info.st_uid != 0 or stat.S_ISLNK(info.st_mode):
                    raise PrivateDirsError(f"{point} is not a folder of the launcher's own")
            binds.append((str(source), str(point)))
        return binds

    def command(self, python: str = sys.executable) -> list[str]:
        """Returns the prefix that runs what follows (setpriv ... rank) with the private folders
        over /tmp and /dev/shm, in a mount namespace of its own."""
        args = [python, "-I", os.path.abspath(__file__)]
        for source, point in self.binds:
            args += ["--bind", f"{source}={point}"]
        for node_dir, private in self.covers():
            args += ["--cover", f"{node_dir}={private}"]
        return args + ["--"]

    def save_into(self, folder: os.PathLike | str, *, uid: int,
                  held_sockets: frozenset[str] | None = None) -> tuple[str, ...]:
        """Writes what the ranks left in both folders into `folder` (a CRIU checkpoint's staging
        folder) as tmp.tar and shm.tar, owners and modes kept: a restored rank finds them again (and
        the files it holds open there, at their sizes). Returns what was left out, one line each
        with why: the stale unix socket files (no process of the job holds them bound), which a
        copy cannot make sockets again. Raises PrivateDirsError, naming it, for what cannot
        travel: a socket file a process of the job holds bound (`held_sockets`, the paths as the
        ranks see them: bound_unix_sockets; one bound at a relative path counts as every socket
        file, since where it lies is unknown), an entry owned by another uid than the job's or
        root's, a device or fifo, a link that leads outside its folder."""
        held = held_sockets or frozenset()
        unknown_place = sorted(path for path in held if not path.startswith("/"))
        left_out: list[str] = []
        for node_dir, private in self.covers():
            for socket_file in _socket_files(private):
                seen = f"{node_dir}/{socket_file}"
                if seen in held or unknown_place:
                    why = ("a process of the job holds it bound" if seen in held else
                           f"a process of the job holds a unix socket bound at the relative path "
                           f"{unknown_place[0]!r}, which may be this one")
                    raise PrivateDirsError(f"{seen} is a unix socket and {why} (a server listening there): a "
                                           "checkpoint cannot carry a live socket (a copied file is no socket), "
                                           "so the restored job would find it gone; refused. Close it before "
                                           "the cut, or use the framework engine")
                left_out.append(f"{seen}: a stale unix socket file (no process of the job holds it): not saved, "
                                "a restored job does not find it")
        for name, private in ((TMP_ARCHIVE, self.tmp), (SHM_ARCHIVE, self.shm)):
            def checked(member: tarfile.TarInfo, root: str = str(private)) -> tarfile.TarInfo:
                if member.uid not in (0, uid):
                    raise PrivateDirsError(f"{member.name} in the ranks' private folder belongs to uid {member.uid}, "
                                           f"neither the job's ({uid}) nor root's: refused in a checkpoint")
                return _travelling(member, root)
            with tarfile.open(pathlib.Path(folder) / name, "w", format=tarfile.PAX_FORMAT) as archive:
                for entry in sorted(os.listdir(private)):
                    try:
                        archive.add(private / entry, arcname=entry, recursive=True, filter=checked)
                    except tarfile.FilterError as exc:
                        raise PrivateDirsError(f"the ranks' private {private}: {exc}: "
                                               "refused in a checkpoint") from None
        return tuple(left_out)

    def load_from(self, folder: os.PathLike | str) -> None:
        """Puts back into both (new) folders what save_into wrote in `folder` (a verified
        checkpoint), owners and modes kept, nothing outside them. A checkpoint without the archives
        (none was saved) puts nothing back."""
        for name, private in ((TMP_ARCHIVE, self.tmp), (SHM_ARCHIVE, self.shm)):
            path = pathlib.Path(folder) / name
            if not path.exists():
                continue
            with tarfile.open(path, "r") as archive:
                try:
                    archive.extractall(private, numeric_owner=True, filter=_travelling)
                except tarfile.FilterError as exc:
                    raise PrivateDirsError(f"{path}: {exc}") from None

    def remove(self) -> None:
        """Removes both folders and lets the lock go (idempotent)."""
        for folder in (self.tmp, self.shm):
            _remove(folder)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


TMP_ARCHIVE, SHM_ARCHIVE = "private-tmp.tar", "private-shm.tar"  # in a CRIU checkpoint


def saved_conflicts(folders) -> list[str]:
    """Returns what the private folders saved in several `folders` (parts of a checkpoint restored
    together onto one host, each with what its host's ranks left) hold at one path but not alike
    (another kind of entry, mode, owner, or content), as "/tmp/<name>: <which folders>" lines,
    sorted; [] when putting them all into one host's folders loses nothing (a path in several is
    the same there: a folder, or a file with the same bytes). Raises PrivateDirsError for an
    archive tarfile cannot read."""
    seen: dict[str, tuple[tuple, str]] = {}
    conflicts = set()
    for folder in map(pathlib.Path, folders):
        for name, shown_as in ((TMP_ARCHIVE, "/tmp"), (SHM_ARCHIVE, "/dev/shm")):
            path = folder / name
            if not path.exists():
                continue
            try:
                with tarfile.open(path, "r") as archive:
                    for member in archive.getmembers():
                        content = archive.extractfile(member) if member.isfile() else None
                        digest = hashlib.sha256(content.read()).hexdigest() if content is not None else None
                        key = (member.type, member.mode, member.uid, member.gid, member.linkname, digest)
                        where = f"{shown_as}/{member.name}"
                        if where in seen and seen[where][0] != key:
                            conflicts.add(f"{where}: differs between {seen[where][1]} and {folder.name}")
                        seen.setdefault(where, (key, folder.name))
            except tarfile.TarError as exc:
                raise PrivateDirsError(f"{path}: {exc}") from None
    return sorted(conflicts)


def _socket_files(folder: pathlib.Path) -> list[str]:
    """Returns the paths (relative to `folder`) of the unix socket files under it, sorted: tarfile
    skips a socket without a word (TarFile.add), so save_into looks for them itself."""
    found = []
    for root, _dirs, files in os.walk(folder):
        for entry in files:
            path = pathlib.Path(root) / entry
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.append(str(path.relative_to(folder)))
    return sorted(found)


def bound_unix_sockets(pids: list[int]) -> frozenset[str]:
    """Returns the paths at which the processes `pids` hold unix sockets bound, as those processes
    see them (/proc/<pid>/net/unix of each one's network namespace, matched to the socket inodes of
    its /proc/<pid>/fd): absolute, or relative to where the process was when it bound. Abstract
    sockets (no file) and processes that are gone are left out."""
    held: set[str] = set()
    tables: dict[str, dict[str, str]] = {}  # network namespace -> socket inode -> bound path
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
            if netns not in tables:
                tables[netns] = _unix_socket_paths(pid)
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        for target in inodes:
            if target.startswith("socket:[") and target[8:-1] in tables[netns]:
                held.add(tables[netns][target[8:-1]])
    return frozenset(held)


def _unix_socket_paths(pid: int) -> dict[str, str]:
    """Returns {socket inode: path} of the bound, non-abstract unix sockets /proc/<pid>/net/unix lists."""
    paths = {}
    with open(f"/proc/{pid}/net/unix") as handle:
        next(handle, None)  # the header
        for line in handle:
            fields = line.split(None, 7)
            if len(fields) == 8 and not fields[7].startswith("@"):
                paths[fields[6]] = fields[7].rstrip("\n")
    return paths


def _travelling(member: tarfile.TarInfo, root: str) -> tarfile.TarInfo:
    """The filter of save_into and load_from: tarfile's "data" checks (no absolute path, nothing
    and no link leading outside `root`, no device or fifo), with the owner and the mode (bar
    setuid, setgid, sticky and group/other write) kept, as its "tar" filter does."""
    tarfile.data_filter(member, root)
    return tarfile.tar_filter(member, root)


def _give(folder: pathlib.Path, gid: int) -> None:
    os.lchown(folder, 0, gid)
    os.chmod(folder, DIR_MODE)


def _remove(folder: os.PathLike | str) -> None:
    """Removes a folder the job wrote into, never following a link it left there."""
    if os.path.islink(folder):
        os.unlink(folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def sweep(shm_root: str = NODE_SHM, *, now: float | None = None) -> list[str]:
    """Removes the private /dev/shm folders of launchers that are gone (their lock is free) and
    half-made ones older than STALE_CREATING_S; returns their paths. Never blocks: a live
    launcher's folder is skipped."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(shm_root))
    except OSError:
        return removed
    for entry in entries:
        creating = entry.name.startswith(CREATING_PREFIX)
        if not (entry.name.startswith(SHM_PREFIX) or creating):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # its launcher lives
                raise
            if creating and now - os.fstat(fd).st_mtime < STALE_CREATING_S:
                continue  # maybe a launcher between mkdir and flock
            if os.path.samestat(os.fstat(fd), os.lstat(entry.path)):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


# -- the helper: runs as root, in the rank's new mount namespace -------------------------------------
def _mount(libc, source: str | None, target: str, flags: int) -> None:
    if libc.mount(source.encode() if source else None, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source or '(none)'} on {target}: {os.strerror(code)}")


def main(argv: list[str]) -> None:
    """--bind SRC=POINT ... --cover NODE_DIR=PRIVATE ... [--flat-bind SRC=POINT ...] -- COMMAND...: see
    the module docstring. --flat-bind binds SRC alone, without the mounts below it (a CRIU restore's
    --root: runtime/criu.py)."""
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    binds: list[tuple[str, str]] = []
    covers: list[tuple[str, str]] = []
    flat: list[tuple[str, str]] = []
    for flag, value in zip(options[::2], options[1::2]):
        left, _, right = value.partition("=")
        {"--bind": binds, "--cover": covers, "--flat-bind": flat}[flag].append((left, right))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare(CLONE_NEWNS): {os.strerror(code)}")
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)
    # The paths bound back are opened before the covers hide them, then bound from the open
    # folder onto their place in the covered tree. (Bound into the private folder first and
    # carried along by the cover, each also stayed mounted at its node path under the private
    # folder: a mount CRIU must recreate at a path inside the job dir, which the job's uid,
    # as which CRIU runs (runtime/criu.py), cannot reach.)
    sources = [(os.open(source, os.O_PATH | os.O_CLOEXEC), _covered_path(point, covers)) for source, point in binds]
    for node_dir, private in covers:
        _mount(libc, private, node_dir, MS_BIND | MS_REC)
    for fd, target in sources:
        _mount(libc, f"/proc/self/fd/{fd}", target, MS_BIND | MS_REC)
        os.close(fd)
    for source, point in flat:
        _mount(libc, source, point, MS_BIND)
    # The working directory still points into the node's tree (under a covered /tmp it would let
    # relative paths reach the node's /tmp): enter it again by name, in the new tree.
    try:
        os.chdir(os.getcwd())
    except OSError:
        os.chdir("/")
    _reopen_standard_fds()
    os.execvp(command[0], command)


def _covered_path(point: str, covers: list[tuple[str, str]]) -> str:
    """Returns where mount point `point` lies once the covers are in place: inside a private folder,
    at the same place under the node folder it covers; elsewhere, where it is."""
    for node_dir, private in covers:
        if _under(pathlib.PurePath(point), pathlib.PurePath(private)):
            return os.path.join(node_dir, os.path.relpath(point, private))
    return point


def _reopen_standard_fds() -> None:
    """Opens stdin, stdout and stderr again by their paths, in this mount namespace. The inherited
    ones were opened in the node's namespace: CRIU dumps the rank's mount namespace and cannot
    resolve a file whose mount is not in it ("Can't lookup mount"). One that is no file of a path
    (a pipe, a socket) or no longer opens is left as it was."""
    for fd, flags in ((0, os.O_RDONLY), (1, os.O_WRONLY | os.O_APPEND), (2, os.O_WRONLY | os.O_APPEND)):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not path.startswith("/") or path.endswith(" (deleted)"):
            continue
        try:
            fresh = os.open(path, flags | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            continue
        os.dup2(fresh, fd)  # dup2's copy is inheritable
        os.close(fresh)


if __name__ == "__main__":
    main(sys.argv[1:])
