"""Code bundles and job outputs: services and selectors (the HTTP edge is jobs/bundle_apis.py).

Where the bytes live, next to the checkpoints in the artifact store (MERIDIAN_CHECKPOINT_STORE):
    <store>/bundles/<ab>/<sha256>.tar.gz     one code bundle, stored once whoever sends it
    <store>/outputs/job-<id>/                a job's workspace files (runtime/workspace.py):
        objects/<ab>/<sha256>, latest.json (newest checkpoint), final.json (the job's end)

An upload is streamed to a temporary file while it is hashed, refused above
MERIDIAN_BUNDLE_MAX_BYTES (413) or when the digest is not the one named (400), checked as a
bundle (protocol.bundle.check: a malicious archive is a 400 naming the member), then renamed
into place. The same bytes twice are stored once; each uploader is recorded, and only an
uploader may submit a job with the bundle.

Nothing is kept for ever: `artifacts_collect` (Celery beat, every MERIDIAN_ARTIFACTS_GC_SECONDS,
and `manage.py artifacts_gc`) deletes bundles no job references after MERIDIAN_BUNDLE_GRACE_DAYS,
the saved outputs of jobs that ended more than MERIDIAN_OUTPUTS_RETENTION_DAYS ago, and the
checkpoint stores (<store>/job-<id>/) no agent removed (job_stores_collect).
"""
from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import IO

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import ProtectedError

from jobs.models import Bundle, Job
from protocol import bundle as bundle_format
from protocol.bundle import OUTPUTS_FINAL, OUTPUTS_LATEST, BundleError, is_sha256, object_relpath

CHUNK = 1 << 20


class BundleTooLarge(Exception):
    """An upload above MERIDIAN_BUNDLE_MAX_BYTES (the API answers 413)."""

    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"the bundle is larger than the limit of {limit} bytes "
                         f"({bundle_format.human_bytes(limit)}); leave data and outputs out of it "
                         f"(.meridianignore) and read large inputs from shared storage")


def store_root() -> Path:
    return Path(str(settings.MERIDIAN_CHECKPOINT_STORE))


def bundle_path(sha256: str) -> Path:
    if not is_sha256(sha256):
        raise ValidationError({"sha256": f"{sha256!r} is not a sha256 digest (64 lowercase hex digits)"})
    return store_root() / "bundles" / sha256[:2] / f"{sha256}.tar.gz"


def job_outputs_path(job_id: int) -> Path:
    return store_root() / "outputs" / f"job-{int(job_id)}"


def job_outputs_uri(job_id: int) -> str:
    return str(job_outputs_path(job_id))


# --- upload ---------------------------------------------------------------------------------------


def bundle_get_for_user(*, user, sha256: str) -> Bundle | None:
    """Returns the bundle when `user` uploaded it (else None: a digest alone grants nothing)."""
    if not is_sha256(sha256):
        return None
    return Bundle.objects.filter(sha256=sha256, uploaders=user).first()


def bundle_store(*, stream: IO[bytes], sha256: str, user, declared_length: int | None = None) -> tuple[Bundle, bool]:
    """Stores the bundle read from `stream`, which must hash to `sha256`; returns (bundle,
    created: whether these bytes were new). Idempotent: bytes already stored are read and
    hashed (the uploader must prove they have them) but not written twice.

    Raises BundleTooLarge above MERIDIAN_BUNDLE_MAX_BYTES (before reading when the length is
    declared), ValidationError({"sha256"}) for a digest mismatch, ValidationError({"bundle"})
    for an archive protocol.bundle refuses (the message names the member)."""
    limit = int(settings.MERIDIAN_BUNDLE_MAX_BYTES)
    final = bundle_path(sha256)
    if declared_length is not None and declared_length > limit:
        raise BundleTooLarge(limit)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".upload-{uuid.uuid4().hex}"
    digest = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as out:
            while chunk := stream.read(CHUNK):
                size += len(chunk)
                if size > limit:
                    raise BundleTooLarge(limit)
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise ValidationError({"sha256": [
                f"the body's sha256 is {digest.hexdigest()}, not {sha256} as the URL says; the upload was "
                f"damaged or the digest is wrong (it is the sha256 of the .tar.gz file)"]})
        try:
            summary = bundle_format.check(tmp, max_entries=settings.MERIDIAN_BUNDLE_MAX_ENTRIES,
                                          max_bytes=settings.MERIDIAN_BUNDLE_MAX_UNPACKED_BYTES)
        except BundleError as exc:
            raise ValidationError({"bundle": [f"refused: {exc}"]}) from None
        created = not final.exists()
        if created:
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    with transaction.atomic():
        try:
            with transaction.atomic():
                bundle, _ = Bundle.objects.get_or_create(sha256=sha256, defaults={
                    "size_bytes": size, "unpacked_bytes": summary.unpacked_bytes, "entries": summary.entries})
        except IntegrityError:  # two first uploads at once: the other one created the row
            bundle = Bundle.objects.get(sha256=sha256)
        bundle.uploaders.add(user)
    return bundle, created


def bundle_store_upload(*, uploaded_file, user) -> Bundle:
    """Stores a bundle a person uploaded through a form (a Django UploadedFile): hashed first,
    then stored as bundle_store does. Raises what bundle_store raises."""
    limit = int(settings.MERIDIAN_BUNDLE_MAX_BYTES)
    if uploaded_file.size is not None and uploaded_file.size > limit:
        raise BundleTooLarge(limit)
    digest = hashlib.sha256()
    for chunk in uploaded_file.chunks(CHUNK):
        digest.update(chunk)
    uploaded_file.seek(0)
    bundle, _ = bundle_store(stream=uploaded_file, sha256=digest.hexdigest(), user=user,
                             declared_length=uploaded_file.size)
    return bundle


def bundle_resolve_for_submit(*, spec: dict, user) -> dict:
    """Returns `spec` with its "bundle" digest replaced by the Bundle row (None or absent: no
    bundle). Raises ValidationError({"bundle"}) for a digest the user has not uploaded, and
    ({"entrypoint"}) for an entrypoint that is not a relative path inside the bundle."""
    ref = spec.get("bundle")
    if ref is None or ref == "" or isinstance(ref, Bundle):
        return {**spec, "bundle": ref or None}
    if not is_sha256(ref):
        raise ValidationError({"bundle": [f"{str(ref)[:80]!r} is not a bundle digest (the sha256 of the .tar.gz "
                                          f"you uploaded: 64 lowercase hex digits)"]})
    bundle = bundle_get_for_user(user=user, sha256=ref)
    if bundle is None:
        raise ValidationError({"bundle": [f"no bundle {ref[:12]}… uploaded by you; upload it first "
                                          f"(PUT /api/bundles/{ref}/, or `meridian submit` does it)"]})
    entrypoint = spec.get("entrypoint")
    if isinstance(entrypoint, str):
        parts = PurePosixPath(entrypoint.strip()).parts
        if entrypoint.strip().startswith("/") or ".." in parts:
            raise ValidationError({"entrypoint": [
                f"with a bundle the entrypoint is a path inside it, relative to its root (e.g. train.py), "
                f"not {entrypoint!r}"]})
    return {**spec, "bundle": bundle}


# --- the agent's fetch -----------------------------------------------------------------------------


def bundle_path_for_node(*, node, sha256: str) -> Path | None:
    """Returns the bundle's file when a job using it has replicas on `node`'s devices (a node
    may fetch only the code of jobs placed on it), else None."""
    from jobs.models import Replica
    if not is_sha256(sha256):
        return None
    placed = Replica.objects.filter(device__node_id=node.pk, job__bundle__sha256=sha256).exists()
    path = bundle_path(sha256)
    return path if placed and path.is_file() else None


# --- outputs --------------------------------------------------------------------------------------


def job_outputs_manifest(*, job: Job) -> dict | None:
    """Returns the workspace manifest a download of `job`'s outputs serves: the job's end
    (final.json) or, before that, its newest checkpoint's (latest.json); None when neither exists."""
    import json
    folder = job_outputs_path(job.pk)
    for name in (OUTPUTS_FINAL, OUTPUTS_LATEST):
        try:
            manifest = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
            manifest["source"] = name
            return manifest
    return None


def _safe_rel(rel: object) -> str | None:
    """A manifest comes from a node: a path that is not plainly inside is skipped, never followed."""
    if not isinstance(rel, str) or not rel or len(rel) > bundle_format.MAX_MEMBER_NAME:
        return None
    try:
        return bundle_format.check_member_name(rel)
    except BundleError:
        return None


class _Pipe(io.RawIOBase):
    """A write-only buffer tarfile writes into and a generator drains (a streamed response)."""

    def __init__(self):
        self.chunks: list[bytes] = []

    def writable(self):
        return True

    def write(self, b):
        self.chunks.append(bytes(b))
        return len(b)

    def drain(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


def job_outputs_tar(*, job: Job, manifest: dict) -> Iterator[bytes]:
    """Yields a gzip tar of the workspace files `manifest` lists, read from the job's object
    store (each file checked against its size as it is read). Files whose saved copy is missing
    are left out and listed in MERIDIAN-MISSING.txt inside the archive, not silently dropped."""
    folder = job_outputs_path(job.pk)
    pipe = _Pipe()
    missing: list[str] = []
    with tarfile.open(fileobj=pipe, mode="w|gz") as archive:
        for rel, entry in sorted(manifest["files"].items()):
            name = _safe_rel(rel)
            if name is None or not isinstance(entry, dict):
                continue
            info = tarfile.TarInfo(name)
            info.mtime = int(time.time())
            if entry.get("dir"):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                archive.addfile(info)
            elif "link" in entry:
                target = entry.get("link")
                try:
                    bundle_format.check_link_target(name, str(target))
                except BundleError:
                    continue
                info.type, info.linkname = tarfile.SYMTYPE, str(target)
                archive.addfile(info)
            else:
                try:
                    source = folder / object_relpath(str(entry.get("sha256")))
                    size = int(entry.get("size", -1))
                except (BundleError, ValueError):
                    missing.append(name)
                    continue
                if not source.is_file() or source.stat().st_size != size:
                    missing.append(name)
                    continue
                info.size, info.mode = size, 0o755 if int(entry.get("mode", 0o644)) & 0o100 else 0o644
                with open(source, "rb") as handle:
                    archive.addfile(info, handle)
            yield pipe.drain()
        if missing:
            text = ("These files were in the job's workspace but their saved copies are missing:\n"
                    + "\n".join(missing) + "\n").encode()
            info = tarfile.TarInfo("MERIDIAN-MISSING.txt")
            info.size = len(text)
            archive.addfile(info, io.BytesIO(text))
    yield pipe.drain()


# --- garbage collection ---------------------------------------------------------------------------


def _older_than(path: Path, cutoff: float) -> bool:
    """True when nothing in `path` (a file, or a folder and what it holds) changed after `cutoff`."""
    try:
        if path.is_file() or path.is_symlink():
            return path.lstat().st_mtime < cutoff
        return all(p.lstat().st_mtime < cutoff for p in [path, *path.rglob("*")])
    except OSError:
        return False


def bundles_collect(*, now, dry_run: bool = False) -> list[str]:
    """Deletes the code bundles no job references that were uploaded more than
    MERIDIAN_BUNDLE_GRACE_DAYS ago (their rows and files), and stray files under <store>/bundles
    (an interrupted upload, a file without its row) untouched that long; returns what it deleted
    (digests and paths). A grace of 0 keeps every bundle.

    A bundle any job names, whatever the job's state, is kept: its jobs may run again (a
    preempted or resumed job fetches it on its next node). The grace lets a user who uploaded a
    bundle submit with it later; a submission racing the deletion is refused by the database
    (Job.bundle protects the row), never left without its code."""
    grace_days = float(settings.MERIDIAN_BUNDLE_GRACE_DAYS)
    if grace_days <= 0:
        return []
    cutoff = now - timedelta(days=grace_days)
    deleted: list[str] = []
    for bundle in Bundle.objects.filter(jobs__isnull=True, created_at__lt=cutoff).only("id", "sha256"):
        if dry_run:
            deleted.append(bundle.sha256)
            continue
        try:
            with transaction.atomic():
                # Locked, then counted again: a job submitted since the query keeps its bundle (a
                # submission inserting its job now waits for this lock, then finds no row).
                row = Bundle.objects.select_for_update().filter(pk=bundle.pk).first()
                if row is None or Job.objects.filter(bundle_id=row.pk).exists():
                    continue
                row.delete()
                bundle_path(bundle.sha256).unlink(missing_ok=True)
        except ProtectedError:
            continue
        deleted.append(bundle.sha256)
    folder = store_root() / "bundles"
    known = set(Bundle.objects.values_list("sha256", flat=True))
    for path in sorted(folder.glob("*/*")) if folder.is_dir() else []:
        digest = path.name.removesuffix(".tar.gz")
        if (digest in known and path.name == f"{digest}.tar.gz") or not _older_than(path, cutoff.timestamp()):
            continue
        if not dry_run and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
        deleted.append(str(path))
    return deleted


def _job_folders(folder: Path) -> dict[int, Path]:
    """Returns {job id: folder} of the `job-<id>` folders directly in `folder` (not links)."""
    found = {}
    for path in folder.iterdir():
        name = path.name.removeprefix("job-")
        if path.name.startswith("job-") and name.isdigit() and path.is_dir() and not path.is_symlink():
            found[int(name)] = path
    return found


def job_outputs_expired(*, job: Job, now) -> bool:
    """True when `job` ended more than MERIDIAN_OUTPUTS_RETENTION_DAYS before `now` (its saved
    outputs are collected); never for a live job, nor when the retention is 0 (kept for ever)."""
    retention_days = float(settings.MERIDIAN_OUTPUTS_RETENTION_DAYS)
    return (retention_days > 0 and job.state in Job.TERMINAL_STATES and job.finished_at is not None
            and job.finished_at < now - timedelta(days=retention_days))


def job_outputs_collect(*, now, dry_run: bool = False) -> list[int]:
    """Deletes the saved outputs (<store>/outputs/job-<id>/) of jobs that ended more than
    MERIDIAN_OUTPUTS_RETENTION_DAYS ago, and of job ids the database does not know untouched that
    long; returns the job ids whose outputs it deleted. A retention of 0 keeps them all.

    Never a live job's (queued, running, preempted, moving: its outputs are what it resumes
    with) nor one that ended within the retention."""
    import shutil

    retention_days = float(settings.MERIDIAN_OUTPUTS_RETENTION_DAYS)
    folder = store_root() / "outputs"
    if retention_days <= 0 or not folder.is_dir():
        return []
    cutoff = now - timedelta(days=retention_days)
    on_disk = _job_folders(folder)
    jobs = Job.objects.filter(pk__in=list(on_disk)).only("id", "state", "finished_at").in_bulk()
    deleted = []
    for job_id, path in sorted(on_disk.items()):
        job = jobs.get(job_id)
        expired = _older_than(path, cutoff.timestamp()) if job is None else job_outputs_expired(job=job, now=now)
        if not expired:
            continue
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
        deleted.append(job_id)
    return deleted


def ended_store_grace_seconds() -> float:
    """How long a succeeded or cancelled job's checkpoint store is left to its agent: the setting,
    and never less than twice the lost-node threshold (a copy cut off from its agent writes into
    its store until it fences itself, that long after its last heartbeat)."""
    grace = float(settings.MERIDIAN_ENDED_STORE_GRACE_SECONDS)
    return max(grace, 2 * float(settings.MERIDIAN_NODE_LOST_AFTER_SECONDS)) if grace > 0 else 0.0


def job_stores_collect(*, now, dry_run: bool = False) -> list[int]:
    """Deletes the checkpoint stores (<store>/job-<id>/, every generation) that no agent removed;
    returns the job ids whose store it deleted.

    An agent removes a succeeded or cancelled job's store as soon as the job ends (agent/node.py),
    but only an agent that still holds a copy of it: a job cancelled while it waited (preempted,
    or queued after its node was lost), or one whose agent died before the removal ran, leaves its
    store behind (the short chaos soak found one: a store of a few hundred megabytes to gigabytes
    of CRIU images, left for ever). Collected here:
    - a succeeded or cancelled job's, once it ended more than ended_store_grace_seconds() ago and
      nothing in the folder changed for as long (a fenced copy may still be writing);
    - a failed job's (kept so that people can look into it) after MERIDIAN_OUTPUTS_RETENTION_DAYS;
    - a folder of a job id the database does not know, untouched that long.
    Never a live job's (queued, running, preempted, moving: its store is what it resumes from).
    A grace of 0 keeps succeeded and cancelled jobs' stores; a retention of 0, the others."""
    import shutil

    folder = store_root()
    if not folder.is_dir():
        return []
    on_disk = _job_folders(folder)
    if not on_disk:
        return []
    grace = ended_store_grace_seconds()
    retention_days = float(settings.MERIDIAN_OUTPUTS_RETENTION_DAYS)
    jobs = Job.objects.filter(pk__in=list(on_disk)).only("id", "state", "finished_at").in_bulk()
    deleted = []
    for job_id, path in sorted(on_disk.items()):
        job = jobs.get(job_id)
        if job is not None and job.state in (Job.State.SUCCEEDED, Job.State.CANCELLED):
            keep_s = grace
        elif job is None or job.state == Job.State.FAILED:
            keep_s = retention_days * 86400.0
        else:
            continue  # live: its store is what it resumes from
        if keep_s <= 0:
            continue
        cutoff = now - timedelta(seconds=keep_s)
        if job is not None and (job.finished_at is None or job.finished_at >= cutoff):
            continue
        if not _older_than(path, cutoff.timestamp()):
            continue
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
        deleted.append(job_id)
    return deleted


def artifacts_collect(*, now, dry_run: bool = False) -> dict:
    """Runs the three collections (the beat task and `manage.py artifacts_gc`); returns what each
    deleted."""
    return {"bundles": bundles_collect(now=now, dry_run=dry_run),
            "outputs": job_outputs_collect(now=now, dry_run=dry_run),
            "stores": job_stores_collect(now=now, dry_run=dry_run)}
