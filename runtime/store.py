"""Checkpoint store: a local directory or a shared filesystem path, addressed by URI.

Both checkpoint engines hand the store a directory tree (a CRIU dump is a directory of image
files; the framework engine writes ``rank-<r>/`` folders).  The store copies (or, when the tree
was written into one of its own staging folders, renames) it into place:

    <root>/ckpt-<step:012d>-<commit ns>/          one committed checkpoint
        MANIFEST.json                             written last: step, engine, meta, and the
                                                  byte size and sha256 of every other file
        <the engine's files, any depth>

A checkpoint may depend on *base* checkpoints of the same store (a CRIU checkpoint whose pages
are deduplicated against an earlier one: runtime/criu_pages.py). The engine names them in a
``BASES.json`` of its staging folder; at commit the store checks each is a committed checkpoint
of this store without bases of its own, and records it in the manifest as
``"bases": [{"name": "ckpt-...", "manifest_sha256": hex}]`` (so the one manifest digest the control
plane records pins the bases too: a hash chain). Every verification checks the bases against
those digests and their files; a missing or altered base refuses the checkpoint with its reason.
Retention keeps every base a kept checkpoint needs, and never removes the checkpoint the control
plane accepted last, nor one newer than it (the *pin*, ``accepted_file``): a copy cut off from its
agent keeps committing for a few seconds before it fences itself, and the checkpoint the control
plane restores from elsewhere must still be there (the chaos soak found one pruned under it).

A checkpoint exists only once its folder has its final name: files are written into a
``.tmp-*`` folder, each fsynced, the manifest written and fsynced, the folder renamed and the
parent folder fsynced.  A crash at any moment leaves either the old set of checkpoints or the new
one, never a half-written checkpoint under a final name.  Restores verify sha256 of every file;
``latest_good()`` skips a corrupt or incomplete checkpoint (and logs why) and returns the one
before it.

A writer killed mid-checkpoint (a launcher, a host) leaves its ``.staging-*`` or ``.tmp-*`` folder
behind: nothing lists, restores or commits it, but it may hold a whole checkpoint's bytes.
``sweep_abandoned`` removes those idle for ``ABANDONED_AFTER_S`` (no file in them written, and the
folder not touched: a live checkpoint's launcher touches its staging folder every
``KEEP_ALIVE_S``, ``keep_alive``, even while it only waits for the cut). A sweep renames a folder
away before removing it, so a writer that was only frozen and comes back fails cleanly: its
commit's rename finds nothing, and the engines never recreate a staging folder that is gone.

Only ``file://`` URIs and plain paths are supported: an object store (s3://, gs://) would need a
client this project does not ship, and is refused with a clear error.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("runtime.store")

MANIFEST_NAME = "MANIFEST.json"
BASES_NAME = "BASES.json"
MANIFEST_FORMAT = 1
CHECKPOINT_DIR_PATTERN = re.compile(r"^ckpt-(\d{12})-(\d+)$")
STAGING_PREFIX = ".staging-"
TMP_PREFIX = ".tmp-"
SWEPT_PREFIX = ".swept-"
# A staging or commit folder idle this long belongs to a writer that is gone (module docstring): far
# above KEEP_ALIVE_S, and above any pause of a live writer's file activity (a hash pass over a
# staging folder of ~1 TB, the longest a commit reads without writing).
ABANDONED_AFTER_S = 3600.0
KEEP_ALIVE_S = 60.0
HASH_CHUNK_BYTES = 8 << 20
DEFAULT_KEEP = 3
# The node agent writes the name of the job's newest accepted checkpoint here, in the job folder
# (agent/node.py), and the launcher's store keeps it (CheckpointStore.accepted_file).
ACCEPTED_FILE = "accepted-checkpoint"
# Checkpoints newer than the accepted one are kept while the control plane has not confirmed them,
# up to this many (a pin that lags for good, its agent gone, must not fill the disk).
MAX_UNCONFIRMED = 16


class CheckpointError(Exception):
    """Base class: a checkpoint cannot be written or used."""


class CheckpointMissing(CheckpointError):
    """A checkpoint, or a file it lists, is not there."""

    def __init__(self, path, reason="is missing"):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"checkpoint file {self.path} {reason}")


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is there but its size or sha256 is not what its manifest says."""

    def __init__(self, path, reason):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"checkpoint file {self.path} is corrupt: {reason}")


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    """One committed checkpoint. ``sha256`` is the digest of its manifest's file list."""

    uri: str
    step: int
    engine: str
    bytes: int
    sha256: str
    base: str | None = None  # URI of the base checkpoint it depends on (runtime/criu_pages.py), if any

    @property
    def path(self) -> Path:
        return path_from_uri(self.uri)


# --------------------------------------------------------------------------- low-level helpers

def path_from_uri(uri) -> Path:
    """Returns the local path a ``file://`` URI or a plain path names; refuses other schemes."""
    uri = str(uri)
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("", "file"):
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"checkpoint URI {uri!r}: file:// URIs must name a local path "
                                 f"(file:///abs/path), not host {parsed.netloc!r}")
            return Path(urllib.parse.unquote(parsed.path))
        return Path(uri)
    if len(parsed.scheme) == 1 and uri[1:3] in (":\\", ":/"):  # a Windows drive letter
        return Path(uri)
    raise ValueError(f"checkpoint URI {uri!r}: scheme {parsed.scheme}:// is not supported; "
                     f"use a local or shared-filesystem path or a file:// URI")


def fsync_dir(path) -> None:
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path) -> tuple[str, int]:
    """Returns (hex sha256, size in bytes) of a file, read in large chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_CHUNK_BYTES)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return digest.hexdigest(), size


class HashingFileWriter(io.RawIOBase):
    """A sequential, write-only file that computes its sha256 while it is written.

    A large buffer (``parallel_bytes`` or more) is hashed on a helper thread *while* the same
    buffer is written to the file (``sha256.update`` and the write both release the GIL, so they
    run on two cores); ``write`` returns when both are done, so the buffer is never used after
    the caller got it back, and the digests follow the file's byte order. Smaller buffers are
    hashed in line. ``finish()`` fsyncs and returns the manifest entry ``{"size", "sha256"}``.
    (The first version hashed behind the writer by reading the file back from the page cache:
    3 GB more copied through the kernel, and single 3 GB saves swung from 2 to 10 s.)"""

    def __init__(self, path, parallel_bytes: int = 1 << 20):
        self.path = Path(path)
        self.size = 0
        self._parallel = parallel_bytes
        self._f = open(self.path, "wb", buffering=0)
        self._digest = hashlib.sha256()
        self._hasher = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sha256-beside-writer")

    def writable(self):
        return True

    def write(self, b):
        view = memoryview(b).cast("B")
        n = view.nbytes
        hashing = self._hasher.submit(self._digest.update, view) if n >= self._parallel else None
        try:
            if hashing is None:
                self._digest.update(view)
            rest = view
            while rest.nbytes:
                rest = rest[self._f.write(rest):]
        finally:
            if hashing is not None:
                hashing.result()  # the buffer is the caller's again only after this
        self.size += n
        return n

    def finish(self, fsync: bool = True) -> dict:
        """Ends the file: fsync, close. Returns ``{"size": bytes, "sha256": hex}``."""
        try:
            if fsync:
                os.fsync(self._f.fileno())
            return {"size": self.size, "sha256": self._digest.hexdigest()}
        finally:
            self.close()

    def close(self):
        if not self.closed:
            self._hasher.shutdown(wait=True)
            self._f.close()
        super().close()


def write_file_atomic(path, payload: bytes) -> None:
    """Writes bytes to ``path`` through a temporary file in the same folder: fsync, rename,
    fsync of the folder. Readers see the old file or the new one, never a partial one."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def write_bases(directory, bases: list[dict]) -> None:
    """Names the base checkpoints (``{"name", "manifest_sha256"}``) a staged checkpoint depends
    on; ``CheckpointStore.commit`` checks them and records them in its manifest."""
    write_file_atomic(Path(directory) / BASES_NAME, json.dumps(list(bases)).encode())


def hash_tree(root) -> dict:
    """Returns {relative path: {"size", "sha256"}} of every regular file under `root` except its
    own MANIFEST.json, each fsynced first (what a part manifest lists must be on disk before the
    part is reported: runtime/criu_parts.py). Raises CheckpointError for a symlink or special file."""
    return {rel: _hash_in_place(full) for rel, full in _walk_files(Path(root))}


def file_names(root) -> list[str]:
    """Returns the relative paths of every regular file under `root` except its own MANIFEST.json,
    sorted. Raises CheckpointError for a symlink or special file."""
    return [rel for rel, _ in _walk_files(Path(root))]


def _files_digest(files: dict) -> str:
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


def write_manifest(directory, files: dict, **fields) -> dict:
    """Writes ``directory/MANIFEST.json`` atomically. ``files`` maps a relative path to
    ``{"size": int, "sha256": hex}``. Returns the manifest written."""
    manifest = {"format": MANIFEST_FORMAT, **fields,
                "bytes": sum(entry["size"] for entry in files.values()),
                "files": files, "files_sha256": _files_digest(files)}
    write_file_atomic(Path(directory) / MANIFEST_NAME,
                      json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def manifest_sha256(directory) -> str:
    """Returns the sha256 (hex) of a checkpoint folder's MANIFEST.json bytes: the digest the node
    agent reports with a checkpoint, the control plane records, and a restore is pinned to
    (read_manifest(expect_sha256=...)). The manifest lists every file's size and sha256, so this one
    digest covers the whole checkpoint. Raises CheckpointMissing when there is no manifest."""
    path = Path(directory) / MANIFEST_NAME
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointMissing(path, "is missing (checkpoint incomplete?)") from None


class ManifestMismatch(CheckpointCorrupt):
    """A checkpoint's MANIFEST.json is not the one the control plane recorded: never restored."""


def read_manifest(directory, *, expect_sha256: str | None = None) -> dict:
    """Returns the parsed manifest of a checkpoint folder.

    With `expect_sha256`, the manifest's bytes must have that sha256 (the digest the control plane
    recorded): the bytes are read once, hashed and then parsed, so what is checked is what is used.
    Raises CheckpointMissing when the folder or its manifest is absent, ManifestMismatch for another
    manifest, CheckpointCorrupt when the manifest is not valid JSON or its file list does not match
    its own digest."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise CheckpointMissing(directory, "is missing (no such checkpoint folder)")
    if not path.is_file():
        raise CheckpointMissing(path, "is missing (checkpoint incomplete?)")
    payload = path.read_bytes()
    if expect_sha256 is not None:
        digest = hashlib.sha256(payload).hexdigest()
        if digest != expect_sha256:
            raise ManifestMismatch(path, f"its sha256 is {digest[:16]}…, the control plane recorded "
                                         f"{expect_sha256[:16]}…; refusing to restore it")
    try:
        manifest = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(path, f"not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorrupt(path, "has no file list")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointCorrupt(path, f"unknown manifest format {manifest.get('format')!r}")
    if _files_digest(manifest["files"]) != manifest.get("files_sha256"):
        raise CheckpointCorrupt(path, "file list does not match its digest")
    return manifest


def verify_dir(directory, manifest=None, *, skip_folders=frozenset()) -> dict:
    """Checks every file a checkpoint folder's manifest lists: present, same size, same sha256,
    except those under the top-level folders `skip_folders` (another host's part of a checkpoint
    spanning hosts, which that host checks: runtime/criu_parts.py).
    Returns the manifest; raises CheckpointMissing / CheckpointCorrupt naming the file."""
    directory = Path(directory)
    if manifest is None:
        manifest = read_manifest(directory)
    for rel, entry in sorted(manifest["files"].items()):
        if not _under(rel, skip_folders):
            verify_file(directory / rel, entry)
    for base in manifest.get("bases") or []:
        verify_base(directory, base)
    return manifest


def _under(rel: str, folders) -> bool:
    """True when the manifest path `rel` lies in one of the top-level `folders`."""
    return rel.split("/", 1)[0] in folders


def verify_base(directory, base) -> dict:
    """Checks one base a checkpoint's manifest pins: a committed sibling folder whose manifest
    has the pinned sha256 and whose files all verify, with no base of its own. Returns its
    manifest; raises CheckpointMissing / ManifestMismatch / CheckpointCorrupt saying whose base."""
    directory = Path(directory)
    name = base.get("name") if isinstance(base, dict) else None
    digest = base.get("manifest_sha256") if isinstance(base, dict) else None
    if not isinstance(name, str) or not CHECKPOINT_DIR_PATTERN.match(name) or not isinstance(digest, str):
        raise CheckpointCorrupt(directory / MANIFEST_NAME, f"bad base entry {base!r}")
    base_dir = directory.parent / name
    try:
        manifest = read_manifest(base_dir, expect_sha256=digest)
        if manifest.get("bases"):
            raise CheckpointCorrupt(base_dir / MANIFEST_NAME, "a base has bases of its own")
        for rel, entry in sorted(manifest["files"].items()):
            verify_file(base_dir / rel, entry)
    except CheckpointMissing as exc:
        raise CheckpointMissing(exc.path, f"{exc.reason}: it belongs to base checkpoint {name} of "
                                          f"{directory.name}, which cannot be restored without it") from None
    except CheckpointCorrupt as exc:
        raise type(exc)(exc.path, f"{exc.reason} (base checkpoint {name} of {directory.name}, "
                                  f"which cannot be restored without it)") from None
    return manifest


def verify_file(path, entry) -> None:
    path = Path(path)
    if not path.is_file():
        raise CheckpointMissing(path)
    size = path.stat().st_size
    if size != entry["size"]:
        raise CheckpointCorrupt(path, f"{size} bytes, manifest says {entry['size']}")
    digest, _ = sha256_file(path)
    if digest != entry["sha256"]:
        raise CheckpointCorrupt(path, f"sha256 {digest[:16]}…, manifest says "
                                      f"{entry['sha256'][:16]}…")


def _copy_file_hashing(src: Path, dst: Path) -> dict:
    """Copies src to dst (fsynced), hashing the bytes as they pass. Returns the manifest entry."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while True:
            n = fin.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            fout.write(view[:n])
            size += n
        os.fsync(fout.fileno())
    shutil.copymode(src, dst)
    return {"size": size, "sha256": digest.hexdigest()}


def _hash_in_place(path: Path) -> dict:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    digest, size = sha256_file(path)
    return {"size": size, "sha256": digest}


def _hashes_from_engine_manifests(root: Path) -> dict:
    """Returns {relative path: entry} from the manifests an engine wrote inside a staging
    folder (e.g. the framework engine's ``rank-<r>/MANIFEST.json``), whose sha256 were computed
    from the bytes as they were written. Reusing them saves reading the checkpoint a second
    time; restores still check every file, so a file damaged after it was written is caught."""
    known = {}
    for manifest_path in root.rglob(MANIFEST_NAME):
        if manifest_path.parent == root:
            continue
        try:
            manifest = read_manifest(manifest_path.parent)
        except CheckpointError:
            continue  # not ours or damaged: those files are hashed the slow way
        prefix = manifest_path.parent.relative_to(root).as_posix()
        for rel, entry in manifest["files"].items():
            if isinstance(entry, dict) and isinstance(entry.get("size"), int) \
                    and isinstance(entry.get("sha256"), str):
                known[f"{prefix}/{rel}"] = entry
        with open(manifest_path, "rb+") as f:
            os.fsync(f.fileno())
    return known


def _newest_change(path: Path) -> tuple[float | None, int]:
    """Returns (the newest mtime of `path` and of everything beneath it, their bytes); (None, 0)
    when `path` is gone."""
    try:
        top = path.lstat()
    except OSError:
        return None, 0
    newest, size = top.st_mtime, 0
    if not path.is_dir() or path.is_symlink():
        return newest, top.st_size
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                stat = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            newest = max(newest, stat.st_mtime)
            size += stat.st_size if name in files else 0
    return newest, size


def _walk_files(root: Path):
    """Yields (relative posix path, absolute path) for every regular file under root, sorted.
    Refuses symlinks and special files: a checkpoint must be self-contained."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel == MANIFEST_NAME:
                continue
            if full.is_symlink() or not full.is_file():
                raise CheckpointError(f"cannot store {full}: not a regular file "
                                      f"(symlinks and special files are refused)")
            yield rel, full
        for name in dirnames:
            if (Path(dirpath) / name).is_symlink():
                raise CheckpointError(f"cannot store {Path(dirpath) / name}: a symlinked folder")


# --------------------------------------------------------------------------- the store

def _checkpoint_key(name: str) -> tuple[int, int] | None:
    """Returns (step, commit ns) of a committed checkpoint's folder name, or None for another name."""
    match = CHECKPOINT_DIR_PATTERN.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _skip_no_part(meta: dict) -> frozenset[str]:
    """CheckpointStore.skip_parts_of of a store that checks every file (one host's)."""
    return frozenset()


class CheckpointStore:
    """Committed checkpoints under one root folder, newest last, at most ``keep`` of them."""

    def __init__(self, uri, *, keep: int = DEFAULT_KEEP, accepted_file=None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = path_from_uri(uri).absolute()
        self.keep = keep
        # A file naming the checkpoint the control plane accepted last (ACCEPTED_FILE); retention
        # keeps it and what is newer (see the module docstring). None, or no such file yet: the
        # newest `keep` only.
        self.accepted_file = Path(accepted_file) if accepted_file else None
        self.root.mkdir(parents=True, exist_ok=True)
        # Checkpoints this process verified, with the (inode, size, mtime) of every file then: a
        # resume checks the newest checkpoint and then the one it restores, the same one; its
        # base alone is hundreds of MB to hash again.
        self._verified: dict[str, tuple] = {}
        # The top-level folders of a checkpoint whose files this process does not check, as a
        # function of its manifest meta: the parts of a CRIU checkpoint spanning hosts that this host
        # does not restore (set by the launcher of node k of N: runtime/criu_parts.unread_parts).
        # Each host checks only the parts it restores from, so a job on N hosts reads its checkpoint
        # once in all, not N times; a function of the meta, since which parts a host restores
        # depends on how many hosts dumped the checkpoint, which may not be how many restore it.
        self.skip_parts_of: Callable[[dict], frozenset[str]] = _skip_no_part
        if not os.access(self.root, os.W_OK):
            raise CheckpointError(f"checkpoint store {self.root} is not writable")

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    def staging_dir(self) -> Path:
        """Returns a fresh empty folder inside the store. An engine that writes its checkpoint
        there lets ``commit`` rename it into place instead of copying it."""
        path = self.root / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
        path.mkdir()
        return path

    @contextlib.contextmanager
    def keep_alive(self, staging, *, every_s: float = KEEP_ALIVE_S):
        """Touches `staging` every `every_s` while the block runs, so that no sweep takes it for
        abandoned while its checkpoint waits for a cut or hashes (sweep_abandoned)."""
        done = threading.Event()

        def touch():
            while not done.wait(every_s):
                try:
                    os.utime(staging)
                except OSError:
                    return  # committed (renamed) or removed: nothing left to keep

        thread = threading.Thread(target=touch, daemon=True, name="meridian-staging-alive")
        thread.start()
        try:
            yield staging
        finally:
            done.set()

    def sweep_abandoned(self, *, idle_s: float = ABANDONED_AFTER_S, now: float | None = None) -> list[tuple[str, int]]:
        """Removes the staging and commit folders (and the atomic writes' temporary files) of
        writers that are gone: those whose newest change, the folder's and every file's beneath,
        is older than `idle_s`. Returns [(name, bytes)] of what it removed. Each is renamed away
        first (atomic), so a writer that comes back after all fails cleanly instead of committing
        a checkpoint missing files."""
        now = time.time() if now is None else now
        removed: list[tuple[str, int]] = []
        try:
            entries = list(os.scandir(self.root))
        except OSError as exc:
            log.warning("sweep: cannot list %s: %s", self.root, exc)
            return removed
        for entry in entries:
            if not entry.name.startswith((STAGING_PREFIX, TMP_PREFIX, SWEPT_PREFIX)):
                continue
            path = Path(entry.path)
            newest, size = _newest_change(path)
            if newest is None or (now - newest < idle_s and not entry.name.startswith(SWEPT_PREFIX)):
                continue  # gone meanwhile, or still being written
            away = path if entry.name.startswith(SWEPT_PREFIX) else \
                self.root / f"{SWEPT_PREFIX}{entry.name.lstrip('.')}-{uuid.uuid4().hex[:8]}"
            try:
                if away != path:
                    os.rename(path, away)
            except OSError:
                continue  # committed or removed by its writer just now
            if away.is_dir():
                shutil.rmtree(away, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    away.unlink()
            log.info("sweep: removed %s (%d bytes, idle %.0f s): its writer is gone", entry.name, size, now - newest)
            removed.append((entry.name, size))
        if removed:
            fsync_dir(self.root)
        return removed

    def commit(self, source, step: int, engine: str, meta: dict | None = None) -> CheckpointRef:
        """Stores a checkpoint atomically and returns its reference; then drops all but the
        newest ``keep``.

        ``source`` is a folder (any depth; the store takes it over by rename when it is one of
        its own staging folders, otherwise copies it) or a list of files (stored flat, by
        name). ``meta`` must be JSON-serialisable."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not engine or not isinstance(engine, str):
            raise ValueError(f"engine must be a non-empty string, got {engine!r}")
        meta = dict(meta or {})
        json.dumps(meta)  # refuse non-JSON meta before writing anything
        name = f"ckpt-{step:012d}-{time.time_ns()}"
        final = self.root / name
        tmp = self.root / f"{TMP_PREFIX}{name}"
        files: dict = {}
        try:
            if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
                src = Path(source).absolute()
                if src.parent == self.root and src.name.startswith(STAGING_PREFIX):
                    os.rename(src, tmp)
                    known = _hashes_from_engine_manifests(tmp)
                    for rel, full in _walk_files(tmp):
                        entry = known.get(rel)
                        if entry is not None and entry["size"] == full.stat().st_size:
                            files[rel] = {"size": entry["size"], "sha256": entry["sha256"]}
                        else:
                            files[rel] = _hash_in_place(full)
                else:
                    tmp.mkdir()
                    for rel, full in _walk_files(src):
                        dst = tmp / rel
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        files[rel] = _copy_file_hashing(full, dst)
            else:
                paths = [Path(source)] if isinstance(source, (str, os.PathLike)) else \
                    [Path(p) for p in source]
                tmp.mkdir()
                for p in paths:
                    if not p.is_file():
                        raise CheckpointMissing(p, "is missing (cannot commit it)")
                    if p.name in files or p.name == MANIFEST_NAME:
                        raise CheckpointError(f"cannot commit {p}: duplicate or reserved name")
                    files[p.name] = _copy_file_hashing(p, tmp / p.name)
            bases = self._staged_bases(tmp, files)
            if not files:
                raise CheckpointError(f"refusing to commit an empty checkpoint from {source}")
            for dirpath, _, _ in os.walk(tmp):
                fsync_dir(dirpath)
            extra = {"bases": bases} if bases else {}
            manifest = write_manifest(tmp, files, step=step, engine=engine, meta=meta,
                                      created_unix=time.time(), **extra)
            os.rename(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        ref = self._ref_for(final, manifest)
        log.info("committed checkpoint %s (step %d, engine %s, %d bytes)",
                 final, step, engine, ref.bytes)
        self._apply_retention()
        return ref

    def _staged_bases(self, tmp: Path, files: dict) -> list[dict]:
        """Reads and removes BASES.json of a staged checkpoint; checks that each base is a
        committed checkpoint of this store, without bases, whose manifest has that sha256."""
        path = tmp / BASES_NAME
        if not path.is_file():
            return []
        files.pop(BASES_NAME, None)
        try:
            bases = json.loads(path.read_bytes())
        except ValueError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
        path.unlink()
        if not isinstance(bases, list):
            raise CheckpointError(f"{path}: not a list of bases")
        for base in bases:
            name = base.get("name") if isinstance(base, dict) else None
            if not isinstance(name, str) or not CHECKPOINT_DIR_PATTERN.match(name) \
                    or not (self.root / name).is_dir():
                raise CheckpointError(f"cannot commit: base {base!r} is not a checkpoint of {self.root}")
            manifest = read_manifest(self.root / name, expect_sha256=base.get("manifest_sha256"))
            if manifest.get("bases"):
                raise CheckpointError(f"cannot commit: base {name} has bases of its own")
        return [{"name": b["name"], "manifest_sha256": b["manifest_sha256"]} for b in bases]

    def base_candidate(self, engine: str) -> tuple[Path, str] | None:
        """Returns (folder, manifest sha256) of the checkpoint a new `engine` checkpoint can be
        deduplicated against: the newest one's base, or the newest one when it has none."""
        for directory in reversed(self._committed_dirs()):
            try:
                manifest = read_manifest(directory)
            except CheckpointError:
                continue
            if manifest.get("engine") != engine:
                continue
            bases = manifest.get("bases") or []
            if bases:
                base_dir = self.root / bases[0]["name"]
                return base_dir, bases[0]["manifest_sha256"]
            return directory, manifest_sha256(directory)
        return None

    def _files_signature(self, directory: Path, manifest: dict) -> tuple | None:
        skipped = self._skipped(manifest)
        names = [(directory, rel) for rel in manifest["files"] if not _under(rel, skipped)]
        names.append((directory, MANIFEST_NAME))
        for base in manifest.get("bases") or []:
            base_dir = directory.parent / str(base.get("name"))
            try:
                names += [(base_dir, rel) for rel in read_manifest(base_dir)["files"]] + [(base_dir, MANIFEST_NAME)]
            except CheckpointError:
                return None
        signature = []
        for folder, rel in sorted(names):
            try:
                stat = (folder / rel).stat()
            except OSError:
                return None
            signature.append((str(folder), rel, stat.st_ino, stat.st_size, stat.st_mtime_ns))
        return tuple(signature)

    def _skipped(self, manifest: dict) -> frozenset[str]:
        """The top-level folders of the checkpoint of `manifest` whose files are not checked here."""
        meta = manifest.get("meta")
        return self.skip_parts_of(meta if isinstance(meta, dict) else {})

    def _verify_dir(self, directory: Path, manifest: dict) -> dict:
        """verify_dir, once per process for files that did not change since."""
        key = str(directory)
        signature = self._files_signature(directory, manifest)
        if signature is not None and self._verified.get(key) == signature:
            return manifest
        self._verified.pop(key, None)
        verify_dir(directory, manifest, skip_folders=self._skipped(manifest))
        if signature is not None:
            self._verified[key] = signature
        return manifest

    def _committed_dirs(self) -> list[Path]:
        found = []
        for entry in self.root.iterdir():
            key = _checkpoint_key(entry.name)
            if key is not None and entry.is_dir():
                found.append((key, entry))
        return [path for _, path in sorted(found)]

    def accepted(self) -> tuple[int, int] | None:
        """Returns (step, commit ns) of the checkpoint ``accepted_file`` names, or None (no pin, or
        not a checkpoint name)."""
        if self.accepted_file is None:
            return None
        try:
            return _checkpoint_key(self.accepted_file.read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError):
            return None

    def _apply_retention(self) -> None:
        dirs = self._committed_dirs()
        kept = set(dirs[-self.keep:])
        pin = self.accepted()
        if pin is not None:
            # The accepted checkpoint, and those after it the control plane may have accepted
            # since (its answer not yet here), stay: whichever it restores from must exist.
            onwards = [d for d in dirs if (_checkpoint_key(d.name) or (-1, -1)) >= pin]
            kept |= set(onwards[-MAX_UNCONFIRMED:])
            if onwards and _checkpoint_key(onwards[0].name) == pin:
                kept.add(onwards[0])  # the accepted one itself, however many came after it
        needed = set()
        for folder in kept:
            try:
                needed |= {base["name"] for base in read_manifest(folder).get("bases") or []}
            except (CheckpointError, KeyError, TypeError):
                continue
        for old in dirs:
            if old in kept or old.name in needed:
                continue  # kept, or a kept checkpoint's pages live there
            log.info("retention: removing checkpoint %s (keeping the newest %d%s)", old, self.keep,
                     " and the accepted one onwards" if pin else "")
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(self.root)

    def _ref_for(self, directory: Path, manifest: dict) -> CheckpointRef:
        bases = manifest.get("bases") or []
        return CheckpointRef(uri=directory.as_uri(), step=int(manifest["step"]),
                             engine=str(manifest["engine"]), bytes=int(manifest["bytes"]),
                             sha256=manifest["files_sha256"],
                             base=(self.root / bases[0]["name"]).as_uri() if bases else None)

    def list(self) -> list[CheckpointRef]:
        """Returns the committed checkpoints whose manifest reads, oldest first (files are not
        hashed here; ``verify`` does that)."""
        refs = []
        for directory in self._committed_dirs():
            try:
                refs.append(self._ref_for(directory, read_manifest(directory)))
            except CheckpointError as exc:
                log.warning("checkpoint %s is unusable: %s", directory, exc)
        return refs

    def verify(self, ref: CheckpointRef, *, expect_manifest_sha256: str | None = None) -> dict:
        """Checks every file of a checkpoint against its manifest (and, with `expect_manifest_sha256`,
        the manifest against that digest); returns the manifest.
        Raises CheckpointMissing / CheckpointCorrupt / ManifestMismatch naming the offending file."""
        directory = ref.path
        manifest = read_manifest(directory, expect_sha256=expect_manifest_sha256)
        if manifest["files_sha256"] != ref.sha256:
            raise CheckpointCorrupt(directory / MANIFEST_NAME,
                                    "manifest differs from the one this reference was made from")
        return self._verify_dir(directory, manifest)

    def latest_good(self) -> CheckpointRef | None:
        """Returns the newest checkpoint whose files all verify, or None if there is none.
        Each skipped checkpoint is logged with the reason (missing file, bad sha256...)."""
        for directory in reversed(self._committed_dirs()):
            try:
                manifest = self._verify_dir(directory, read_manifest(directory))
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s; trying the previous one", directory, exc)
                continue
            return self._ref_for(directory, manifest)
        return None

    def pinned(self, manifest_sha256: str) -> CheckpointRef:
        """Returns the committed checkpoint whose MANIFEST.json has sha256 `manifest_sha256` (the
        one the control plane recorded), after checking every file it lists. Raises ManifestMismatch
        when no checkpoint of the store has that manifest (none is restored instead: a restore
        loads only what the control plane recorded), CheckpointCorrupt / CheckpointMissing when its
        files do not match it."""
        for directory in reversed(self._committed_dirs()):
            try:
                manifest = read_manifest(directory, expect_sha256=manifest_sha256)
            except CheckpointError:
                continue
            return self._ref_for(directory, self._verify_dir(directory, manifest))
        raise ManifestMismatch(self.root / MANIFEST_NAME,
                               f"no checkpoint in {self.root} has the manifest the control plane recorded "
                               f"(sha256 {manifest_sha256[:16]}…); refusing to restore any other")

    def restore(self, ref: CheckpointRef, dest=None) -> Path:
        """Verifies a checkpoint and returns a folder holding its files.

        Without ``dest`` that is the checkpoint's own folder (read it, do not modify it).
        With ``dest`` (e.g. another node's working directory) the files are copied there,
        hashed as they are copied, and the copy is checked against the manifest."""
        manifest = self.verify(ref) if dest is None else read_manifest(ref.path)
        if dest is None:
            return ref.path
        if manifest.get("bases"):
            raise CheckpointError(f"checkpoint {ref.path.name} depends on base checkpoint(s) "
                                  f"{', '.join(b['name'] for b in manifest['bases'])} of {self.root}; "
                                  "restore it from the store itself, not from a copy")
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for rel, entry in sorted(manifest["files"].items()):
            src = ref.path / rel
            if not src.is_file():
                raise CheckpointMissing(src)
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            copied = _copy_file_hashing(src, target)
            if copied != {"size": entry["size"], "sha256": entry["sha256"]}:
                raise CheckpointCorrupt(src, f"copy has {copied['size']} bytes / sha256 "
                                             f"{copied['sha256'][:16]}…, manifest says "
                                             f"{entry['size']} / {entry['sha256'][:16]}…")
        shutil.copyfile(ref.path / MANIFEST_NAME, dest / MANIFEST_NAME)
        return dest
