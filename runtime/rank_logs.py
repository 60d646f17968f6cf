"""Where a rank's output lives for the job's life, so the node agent can stream it.

A rank writes its stdout to ``<spool>/rank<r>/out.log`` and its stderr to ``err.log``
(runtime/rank.py): CRIU restores an open file only at the path it had, and the spool path is the
same on every node, so those paths cannot change. But the spool is wiped when a launcher starts
and removed when it exits. So the launcher hard-links each into its job directory,
``<job dir>/logs/rank<r>.log`` (stdout) and ``rank<r>.err`` (stderr) (same inode: the agent
reads what the rank writes as it writes it, and the file outlives the spool), and writes
``<job dir>/logs.json`` (protocol.logs.RankLogs) naming each file, its stream and the byte
offset where this attempt's output starts in it: 0 for a fresh start or a framework restore (new
files); for a CRIU restore, the size of the log carried in the checkpoint (the restored rank
appends to it, at the same path and size, as CRIU requires), so what earlier attempts printed is
not shipped twice. Logs that an earlier attempt left in the job directory under other inodes (a
framework resume or a restart in the same directory) are kept in ``logs/attempt-<n>/``, never
replaced. A checkpoint carries them as ``logs/rank<r>.log`` and ``logs/rank<r>.err.log``
(a checkpoint made before stderr had a file of its own has no .err.log: its ranks' stderr is
their out.log).

Where the spool and the job directory are on different filesystems (a tmpfs /run/meridian) no
hard link can be made: logs.json names the spool file, and at exit the launcher copies it to
the job directory and rewrites logs.json (same bytes, same offsets), so the agent finishes
reading the copy.
"""
from __future__ import annotations

import errno
import os
import pathlib
import shutil
import stat
from typing import TYPE_CHECKING

from protocol.logs import LogStream, RankLog, RankLogs
from runtime import spool as spool_files
from runtime.sandbox import copy_job_file

if TYPE_CHECKING:
    from runtime.launcher import Launcher

MANIFEST = "logs.json"
# stream -> (its file in the spool's rank folder, its file in the job directory, in a checkpoint)
STREAMS: dict[LogStream, tuple[str, str, str]] = {
    "stdout": ("out.log", "rank{rank}.log", "rank{rank}.log"),
    "stderr": ("err.log", "rank{rank}.err", "rank{rank}.err.log")}


def job_log_path(job_dir, rank, stream: LogStream = "stdout") -> pathlib.Path:
    return pathlib.Path(job_dir) / "logs" / STREAMS[stream][1].format(rank=rank)


def spool_log_path(spool, rank, stream: LogStream = "stdout") -> pathlib.Path:
    return spool_files.rank_dir(spool, rank) / STREAMS[stream][0]


def read_manifest(job_dir) -> RankLogs | None:
    """Returns the launcher's logs.json of `job_dir`, or None (none yet, or unreadable)."""
    from protocol import ProtocolError

    try:
        return RankLogs.from_dict(spool_files.read_json(pathlib.Path(job_dir) / MANIFEST))
    except (OSError, ValueError, ProtocolError):
        return None


def _local_ranks(launcher: Launcher):
    """The ranks this launcher runs (all of them, or this host's share of a multi-host job)."""
    return getattr(launcher, "local_ranks", None) or range(launcher.world_size)


def _write_manifest(job_dir, ranks) -> None:
    spool_files.write_json_atomic(pathlib.Path(job_dir) / MANIFEST, RankLogs(ranks=tuple(ranks)).to_dict())


def link(launcher: Launcher) -> RankLogs:
    """Called before the ranks start (or are restored), with the spool's rank folders made and no
    rank running: creates each rank's log files if they are not there (the job's own, under a
    sandbox), links them into the job directory and writes logs.json; returns it.

    Security: a rank may later replace its spool files (its folder is writable by the job), but
    the job directory's link names the inode made here, which the launcher created as a regular
    file: the agent reads that, never a link a rank put in the spool."""
    (launcher.job_dir / "logs").mkdir(parents=True, exist_ok=True)
    sandbox = getattr(launcher, "sandbox", None)
    keep_previous_attempt(launcher)
    ranks = []
    for rank in _local_ranks(launcher):
        for stream in STREAMS:
            source = spool_log_path(launcher.spool, rank, stream)
            fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            try:
                info = os.fstat(fd)
            finally:
                os.close(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"{source} is not a regular file")
            if sandbox is not None:
                sandbox.give_file(source)  # the rank (the job's uid) appends to it
            target = job_log_path(launcher.job_dir, rank, stream)
            target.unlink(missing_ok=True)
            try:
                os.link(source, target, follow_symlinks=False)
                path = target
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                path = source  # copied at exit (keep)
            ranks.append(RankLog(rank=rank, stream=stream, path=str(path), start=info.st_size))
    _write_manifest(launcher.job_dir, ranks)
    return RankLogs(ranks=tuple(ranks))


PREVIOUS = "attempt-{n}"  # <job dir>/logs/attempt-<n>/: an earlier attempt's logs, kept whole


def keep_previous_attempt(launcher: Launcher) -> pathlib.Path | None:
    """Moves the logs an earlier attempt left in this job directory (a framework resume, a
    restart, a second launcher in the same directory: new spool files, so link() would replace
    them) to ``logs/attempt-<n>/`` (n = 1, 2, ... in attempt order) instead of losing them.
    Returns that folder, or None when there was nothing to keep."""
    logs = launcher.job_dir / "logs"
    earlier = []
    for rank in _local_ranks(launcher):
        for stream in STREAMS:
            target = job_log_path(launcher.job_dir, rank, stream)
            source = spool_log_path(launcher.spool, rank, stream)
            if target.is_file() and not target.is_symlink() and not _same_inode(source, target):
                earlier.append(target)
    if not earlier:
        return None
    n = 1
    while (logs / PREVIOUS.format(n=n)).exists():
        n += 1
    folder = logs / PREVIOUS.format(n=n)
    folder.mkdir()
    for target in earlier:
        os.rename(target, folder / target.name)
    return folder


def _same_inode(source: pathlib.Path, target: pathlib.Path) -> bool:
    try:
        a, b = os.lstat(source), os.lstat(target)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def keep(launcher: Launcher) -> None:
    """Called when the launcher exits, before the spool is removed: every rank's logs end up in
    the job directory (copies where they were not linked, never through a link a rank put in the
    spool) and logs.json names them there."""
    (launcher.job_dir / "logs").mkdir(exist_ok=True)
    manifest = read_manifest(launcher.job_dir)
    starts: dict[tuple[int, str], int] = {(r.rank, r.stream): r.start for r in manifest.ranks} if manifest else {}
    ranks = []
    for rank in _local_ranks(launcher):
        for stream in STREAMS:
            source, target = spool_log_path(launcher.spool, rank, stream), job_log_path(launcher.job_dir, rank, stream)
            if os.path.lexists(source) and not _same_inode(source, target):
                try:
                    copy_job_file(source, target)
                except OSError:
                    pass  # replaced by something else than its log: the linked file (if any) stays
            if target.exists():
                ranks.append(RankLog(rank=rank, stream=stream, path=str(target), start=starts.get((rank, stream), 0)))
    _write_manifest(launcher.job_dir, ranks)


def carry(launcher: Launcher, folder) -> None:
    """Copies every rank's logs into `folder` (a checkpoint's logs/, made here) for a CRIU dump
    (the ranks' own files: never through a link one put in their place)."""
    folder = pathlib.Path(folder)
    folder.mkdir()
    for rank in _local_ranks(launcher):
        for stream, (_, _, carried) in STREAMS.items():
            source = spool_log_path(launcher.spool, rank, stream)
            if os.path.lexists(source):
                copy_job_file(source, folder / carried.format(rank=rank))


def put_back(launcher: Launcher, *folders) -> None:
    """Puts the logs a CRIU checkpoint carried back at their spool paths (and sizes; the job's own
    files), before the ranks are restored, and links them (link), once. Each of this host's ranks
    finds its logs in one of `folders` (the checkpoint's, or those of the parts it restores from:
    runtime/criu_parts.py)."""
    for folder in map(pathlib.Path, folders):
        for rank in _local_ranks(launcher):
            for stream, (_, _, carried) in STREAMS.items():
                if (folder / carried.format(rank=rank)).exists():
                    shutil.copyfile(folder / carried.format(rank=rank), spool_log_path(launcher.spool, rank, stream))
    link(launcher)  # gives them to the job's uid under a sandbox
