"""Where a rank's output lives for the job's life, so the node agent can stream it.

A rank writes its stdout and stderr to ``<spool>/rank<r>/out.log`` (runtime/rank.py): CRIU
restores an open file only at the path it had, and the spool path is the same on every node, so
that path cannot change. But the spool is wiped when a launcher starts and removed when it exits.
So the launcher hard-links each rank's log into its job directory, ``<job dir>/logs/rank<r>.log``
(same inode: the agent reads what the rank writes as it writes it, and the file outlives the
spool), and writes ``<job dir>/logs.json`` (protocol.logs.RankLogs) naming each rank's file and
the byte offset where this attempt's output starts in it: 0 for a fresh start or a framework
restore (a new file); for a CRIU restore, the size of the log carried in the checkpoint (the
restored rank appends to it, at the same path and size, as CRIU requires), so what earlier
attempts printed is not shipped twice.

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
from typing import TYPE_CHECKING

from protocol.logs import RankLog, RankLogs
from runtime import spool as spool_files

if TYPE_CHECKING:
    from runtime.launcher import Launcher

MANIFEST = "logs.json"


def job_log_path(job_dir, rank) -> pathlib.Path:
    return pathlib.Path(job_dir) / "logs" / f"rank{rank}.log"


def spool_log_path(spool, rank) -> pathlib.Path:
    return spool_files.rank_dir(spool, rank) / "out.log"


def read_manifest(job_dir) -> RankLogs | None:
    """Returns the launcher's logs.json of `job_dir`, or None (none yet, or unreadable)."""
    from protocol import ProtocolError

    try:
        return RankLogs.from_dict(spool_files.read_json(pathlib.Path(job_dir) / MANIFEST))
    except (OSError, ValueError, ProtocolError):
        return None


def _write_manifest(job_dir, ranks) -> None:
    spool_files.write_json_atomic(pathlib.Path(job_dir) / MANIFEST, RankLogs(ranks=tuple(ranks)).to_dict())


def link(launcher: Launcher) -> RankLogs:
    """Called before the ranks start (or are restored), with the spool's rank folders made:
    creates each rank's out.log if it is not there, links it into the job directory and writes
    logs.json; returns it."""
    logs = launcher.job_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ranks = []
    for rank in range(launcher.world_size):
        source = spool_log_path(launcher.spool, rank)
        fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.close(fd)
        start = source.stat().st_size
        target = job_log_path(launcher.job_dir, rank)
        target.unlink(missing_ok=True)
        try:
            os.link(source, target)
            path = target
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            path = source  # copied at exit (keep)
        ranks.append(RankLog(rank=rank, path=str(path), start=start))
    _write_manifest(launcher.job_dir, ranks)
    return RankLogs(ranks=tuple(ranks))


def keep(launcher: Launcher) -> None:
    """Called when the launcher exits, before the spool is removed: every rank's log ends up in
    the job directory (a copy where it was not linked) and logs.json names it there."""
    logs = launcher.job_dir / "logs"
    logs.mkdir(exist_ok=True)
    manifest = read_manifest(launcher.job_dir)
    starts = {r.rank: r.start for r in manifest.ranks} if manifest else {}
    ranks = []
    for rank in range(launcher.world_size):
        source, target = spool_log_path(launcher.spool, rank), job_log_path(launcher.job_dir, rank)
        if source.exists() and not (target.exists() and os.path.samefile(source, target)):
            shutil.copyfile(source, target)
        ranks.append(RankLog(rank=rank, path=str(target), start=starts.get(rank, 0)))
    _write_manifest(launcher.job_dir, ranks)
