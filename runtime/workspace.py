"""A job's workspace: its working directory on a node (the unpacked bundle plus whatever the
script writes there, its outputs), saved with every checkpoint and restored before a resume.

Layout:
    <workspace>/                         the ranks' cwd; the same absolute path on every node
                                         (a CRIU-restored process reopens its files by path)
    <outputs>/objects/<ab>/<sha256>      content-addressed copies of the workspace's files,
                                         shared by every checkpoint and generation of the job
    <outputs>/latest.json                the workspace manifest of the newest checkpoint
    <outputs>/final.json                 ... of the job's end (finished or failed)
    <checkpoint>/workspace.json          the workspace manifest of that checkpoint, inside the
                                         checkpoint folder: listed (size, sha256) in its
                                         MANIFEST.json, so a checkpoint without its workspace
                                         part is incomplete and never restored.

A manifest maps each relative path to {"size", "sha256", "mode"} (a file), {"link": target}
(a symlink) or {"dir": true} (a folder). Persisting is incremental: a file whose (size,
mtime_ns, inode) is unchanged since the last persist is not read again (a node-local cache),
and an object already in the store is not copied again. Restoring makes the workspace exactly
the manifest: missing or different files come from the objects (checked against their sha256),
files the manifest does not list are removed.

Persist runs at a consistent cut (the ranks are parked or frozen) or after the ranks exited,
so the files do not change while they are read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import uuid
from pathlib import Path

from protocol.bundle import OUTPUTS_FINAL as FINAL
from protocol.bundle import OUTPUTS_LATEST as LATEST
from protocol.bundle import WORKSPACE_MANIFEST, object_relpath

MANIFEST_FORMAT = 1
CHUNK = 1 << 20


class WorkspaceError(Exception):
    """The workspace cannot be saved or restored; the message says which file and why."""


class WorkspaceQuotaExceeded(WorkspaceError):
    pass


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def object_path(outputs: Path, sha256: str) -> Path:
    try:
        return outputs / object_relpath(sha256)
    except ValueError as exc:
        raise WorkspaceError(str(exc)) from None


def scan(workspace: Path) -> dict[str, os.stat_result]:
    """Returns {relative path: lstat} of every file, symlink and folder under `workspace`
    (sockets, FIFOs and devices are skipped: they are not outputs)."""
    found: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(workspace):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            full = base / name
            info = full.lstat()
            if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode) or stat.S_ISDIR(info.st_mode):
                found[full.relative_to(workspace).as_posix()] = info
    return found


def check_quota(workspace: Path, quota_bytes: int | None, files: dict[str, os.stat_result] | None = None, *,
                tmp: Path | None = None) -> int:
    """Returns the bytes the workspace's files hold (with those of `tmp`, the job's private /tmp
    on this node, when given); raises WorkspaceQuotaExceeded naming the biggest files when that is
    above `quota_bytes` (None or 0: no quota)."""
    files = scan(workspace) if files is None else files
    sizes = {rel: info.st_size for rel, info in files.items() if stat.S_ISREG(info.st_mode)}
    if tmp is not None:
        sizes.update({f"/tmp/{rel}": info.st_size for rel, info in scan(tmp).items() if stat.S_ISREG(info.st_mode)})
    total = sum(sizes.values())
    if quota_bytes and total > quota_bytes:
        top = sorted(sizes.items(), key=lambda item: -item[1])[:5]
        where = "workspace and /tmp hold" if tmp is not None else "workspace holds"
        raise WorkspaceQuotaExceeded(
            f"the job's {where} {_human(total)}, above its quota of {_human(quota_bytes)}; "
            f"the biggest files: " + ", ".join(f"{rel} ({_human(size)})" for rel, size in top)
            + ". Write less (or large outputs to shared storage), or ask for a larger quota")
    return total


def open_as_scanned(path: Path, scanned: os.stat_result):
    """Opens the regular file `path` for reading only if it is still the file that was scanned
    (same device and inode) and not a link: the launcher reads a job's workspace as root while
    the job's processes may still be running, so a file (or a folder above it) swapped for a link
    to a node's file after the scan is refused here rather than copied into the job's outputs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WorkspaceError(f"cannot read {path}: {exc.strerror or exc} (changed while it was saved?)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (scanned.st_dev, scanned.st_ino):
        os.close(fd)
        raise WorkspaceError(f"{path} changed while the workspace was saved (it is no longer the file that "
                             f"was scanned); not saved")
    return os.fdopen(fd, "rb")


def _copy_into_objects(source: Path, outputs: Path, scanned: os.stat_result) -> tuple[str, int, bool]:
    """Copies `source` (the file `scanned` described) into the object store, hashing as it copies;
    returns (sha256, size, copied). An object already there is not replaced (content-addressed)."""
    tmp_dir = outputs / "objects" / ".tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / uuid.uuid4().hex
    digest = hashlib.sha256()
    size = 0
    try:
        with open_as_scanned(source, scanned) as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(CHUNK):
                digest.update(chunk)
                fout.write(chunk)
                size += len(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        sha = digest.hexdigest()
        final = object_path(outputs, sha)
        if final.exists():
            return sha, size, False
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        return sha, size, True
    finally:
        tmp.unlink(missing_ok=True)


def _hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Workspace:
    """One job's workspace on this node, with its object store and a stat cache."""

    def __init__(self, path: str | os.PathLike, outputs: str | os.PathLike, *, quota_bytes: int | None = None,
                 cache: str | os.PathLike | None = None):
        self.path = Path(path).absolute()
        self.outputs = Path(outputs).absolute()
        self.quota_bytes = quota_bytes
        self.cache_path = Path(cache) if cache else None

    def _load_cache(self) -> dict[str, list]:
        if self.cache_path is None:
            return {}
        try:
            loaded = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def persist(self) -> dict:
        """Saves the workspace's files into the object store; returns its manifest (with
        "bytes", and "copied_bytes"/"copied_files": what this call had to copy). Raises
        WorkspaceQuotaExceeded above the quota, before copying anything."""
        self.path.mkdir(parents=True, exist_ok=True)
        found = scan(self.path)
        total = check_quota(self.path, self.quota_bytes, found)
        # A regular file the workspace's owner does not own was not written by the job (under the
        # sandbox the workspace is the job uid's): a hard link to a node's file, say. Never saved.
        owner = os.lstat(self.path).st_uid
        foreign = sorted(rel for rel, info in found.items() if stat.S_ISREG(info.st_mode) and info.st_uid != owner)
        if foreign:
            raise WorkspaceError(f"the workspace holds files its owner (uid {owner}) does not own: "
                                 f"{', '.join(foreign[:5])}; they are not saved (the job did not write them)")
        cache = self._load_cache()
        new_cache: dict[str, list] = {}
        entries: dict[str, dict] = {}
        copied_bytes = copied_files = 0
        for rel, info in found.items():
            full = self.path / rel
            if stat.S_ISDIR(info.st_mode):
                entries[rel] = {"dir": True}
                continue
            if stat.S_ISLNK(info.st_mode):
                entries[rel] = {"link": os.readlink(full)}
                continue
            key = [info.st_size, info.st_mtime_ns, info.st_ino]
            cached = cache.get(rel)
            sha = cached[3] if isinstance(cached, list) and len(cached) == 4 and cached[:3] == key else None
            if sha is None or not object_path(self.outputs, sha).is_file():
                sha, _, copied = _copy_into_objects(full, self.outputs, info)
                if copied:
                    copied_bytes += info.st_size
                    copied_files += 1
            entries[rel] = {"size": info.st_size, "sha256": sha, "mode": 0o755 if info.st_mode & 0o100 else 0o644}
            new_cache[rel] = [*key, sha]
        if self.cache_path is not None:
            self.cache_path.write_text(json.dumps(new_cache))
        return {"format": MANIFEST_FORMAT, "workspace": str(self.path), "files": entries, "bytes": total,
                "copied_bytes": copied_bytes, "copied_files": copied_files}

    def persist_into(self, folder: str | os.PathLike) -> dict:
        """Persists and writes the manifest to `folder`/workspace.json (a checkpoint's staging folder)."""
        manifest = self.persist()
        (Path(folder) / WORKSPACE_MANIFEST).write_text(json.dumps(manifest, sort_keys=True))
        return manifest

    def write_pointer(self, name: str, manifest: dict, **extra) -> None:
        """Writes <outputs>/<name> (latest.json, final.json) atomically: what a download serves."""
        self.outputs.mkdir(parents=True, exist_ok=True)
        target = self.outputs / name
        tmp = target.with_name(f".{name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps({**manifest, **extra}, sort_keys=True))
        os.replace(tmp, target)

    def restore(self, manifest: dict) -> dict[str, int]:
        """Makes the workspace hold exactly `manifest`'s files; returns {"copied", "kept",
        "removed"} counts. A missing or damaged object is a WorkspaceError naming the file."""
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise WorkspaceError("the workspace manifest has no file list")
        self.path.mkdir(parents=True, exist_ok=True)
        counts = {"copied": 0, "kept": 0, "removed": 0}
        for rel, info in sorted(scan(self.path).items(), reverse=True):  # children before folders
            wanted = files.get(rel)
            full = self.path / rel
            is_dir = stat.S_ISDIR(info.st_mode)
            kind_ok = wanted is not None and (("dir" in wanted) == is_dir) and (("link" in wanted)
                                                                                == stat.S_ISLNK(info.st_mode))
            if not kind_ok:
                shutil.rmtree(full) if is_dir else full.unlink()
                counts["removed"] += 1
        for rel, entry in sorted(files.items()):
            _check_relative(rel)
            full = self.path / rel
            if entry.get("dir"):
                full.mkdir(parents=True, exist_ok=True)
                continue
            full.parent.mkdir(parents=True, exist_ok=True)
            if "link" in entry:
                if os.path.islink(full) and os.readlink(full) == entry["link"]:
                    counts["kept"] += 1
                    continue
                if os.path.lexists(full):
                    full.unlink()
                os.symlink(entry["link"], full)
                counts["copied"] += 1
                continue
            if full.is_file() and full.stat().st_size == entry["size"] and _hash(full) == entry["sha256"]:
                os.chmod(full, entry.get("mode", 0o644))
                counts["kept"] += 1
                continue
            source = object_path(self.outputs, entry["sha256"])
            if not source.is_file():
                raise WorkspaceError(f"cannot restore {rel}: its saved copy {source} is missing")
            tmp = full.with_name(f".meridian-restore-{uuid.uuid4().hex}")
            try:
                shutil.copyfile(source, tmp)
                if tmp.stat().st_size != entry["size"] or _hash(tmp) != entry["sha256"]:
                    raise WorkspaceError(f"cannot restore {rel}: its saved copy {source} is damaged")
                os.chmod(tmp, entry.get("mode", 0o644))
                os.replace(tmp, full)
            finally:
                tmp.unlink(missing_ok=True)
            counts["copied"] += 1
        return counts


def _check_relative(rel: str) -> None:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or ".." in parts or "" in parts:
        raise WorkspaceError(f"the workspace manifest names {rel!r}, not a path inside the workspace")


def read_manifest(path: str | os.PathLike) -> dict | None:
    """Returns a workspace manifest (a checkpoint's workspace.json, latest.json or final.json),
    or None when there is none."""
    try:
        loaded = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise WorkspaceError(f"cannot read the workspace manifest {path}: {exc}") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("files"), dict):
        raise WorkspaceError(f"{path} is not a workspace manifest")
    return loaded


# --- the launcher's hooks (runtime/launcher.py calls these; each does nothing without --workspace) ---

WORKSPACE_ENV = "MERIDIAN_WORKSPACE"
QUOTA_CHECK_SECONDS = 5.0


def add_arguments(parser) -> None:
    parser.add_argument("--workspace", default=None,
                        help="the job's workspace (the ranks' cwd): saved with every checkpoint, restored "
                             "before a resume (default: none; the ranks run in their spool folders)")
    parser.add_argument("--outputs", default=None,
                        help="where the workspace's saved files go (default <store>/../outputs)")
    parser.add_argument("--workspace-quota-bytes", type=int, default=None,
                        help="fail the job when its workspace holds more than this")


def from_options(options, job_dir: Path) -> Workspace | None:
    if not getattr(options, "workspace", None):
        return None
    from runtime.store import path_from_uri
    outputs = options.outputs or (path_from_uri(options.store).parent / "outputs" if options.store
                                  else job_dir / "outputs")
    return Workspace(options.workspace, path_from_uri(str(outputs)), quota_bytes=options.workspace_quota_bytes,
                     cache=job_dir / "workspace-cache.json")


def persist_at_checkpoint(workspace: Workspace | None, staging: Path) -> dict | None:
    from runtime.exits import LaunchError
    if workspace is None:
        return None
    try:
        return workspace.persist_into(staging)
    except (WorkspaceError, OSError) as exc:
        raise LaunchError(f"the workspace could not be saved with the checkpoint: {exc}") from None


def point_latest(workspace: Workspace | None, saved: dict | None, *, step: int, checkpoint: str) -> None:
    if workspace is not None and saved is not None:
        workspace.write_pointer(LATEST, saved, step=step, checkpoint=checkpoint)


def restore_for_resume(workspace: Workspace | None, checkpoint_dir: Path, meta: dict) -> dict[str, int] | None:
    """Before a resume: puts the checkpoint's workspace back, at the path it had when the
    checkpoint was taken (a CRIU image reopens files there). A checkpoint of a job with a
    workspace that lacks its workspace part is refused rather than resumed without its files."""
    from runtime.exits import EXIT_USAGE, LaunchError
    if workspace is None:
        return None
    recorded = meta.get("workspace")
    if recorded:
        workspace.path = Path(recorded)
    try:
        manifest = read_manifest(Path(checkpoint_dir) / WORKSPACE_MANIFEST)
        if manifest is None:
            if recorded:
                raise LaunchError(f"--resume: the checkpoint {checkpoint_dir} has no workspace part", EXIT_USAGE)
            return None  # a checkpoint from before the job had a workspace
        return workspace.restore(manifest)
    except WorkspaceError as exc:
        raise LaunchError(f"--resume: {exc}", EXIT_USAGE) from None


def check_quota_now(workspace: Workspace | None, launcher, *, tmp: Path | None = None) -> None:
    """Every QUOTA_CHECK_SECONDS: fails the job (LaunchError) when its workspace is over quota.
    `tmp`, a sandboxed job's private /tmp on this node (runtime/private_dirs.py: on the node's
    disk, not in memory), counts against the same quota: without it a job could fill the node's
    disk through /tmp. (Its private /dev/shm is memory, bounded by the job's memory cgroup.)"""
    import time

    from runtime.exits import LaunchError
    if workspace is None or not workspace.quota_bytes:
        return
    now = time.monotonic()
    if now - launcher._quota_checked_at < QUOTA_CHECK_SECONDS:
        return
    launcher._quota_checked_at = now
    try:
        check_quota(workspace.path, workspace.quota_bytes, tmp=tmp)
    except WorkspaceQuotaExceeded as exc:
        raise LaunchError(str(exc)) from None
    except OSError:
        pass  # a file vanished while it was scanned: the next check sees the workspace again


def persist_at_end(workspace: Workspace | None, state: str) -> None:
    """When the job finished or failed: saves the workspace once more as <outputs>/final.json
    (what a download serves). A stopped copy's outputs are its stop checkpoint's (latest.json)."""
    import logging
    # "running"/"stopping" here: a LaunchError is on its way out (the job failed); "starting": the
    # launch failed before a rank ran (nothing new to keep); "stopped": latest.json is the outputs.
    if workspace is None or state in ("starting", "stopped"):
        return
    try:
        workspace.quota_bytes = None  # over quota or not, keep what there is for the user to see
        workspace.write_pointer(FINAL, workspace.persist(), state="finished" if state == "finished" else "failed")
    except (WorkspaceError, OSError) as exc:
        logging.getLogger("runtime.workspace").warning("could not save the workspace at the end: %s", exc)
