"""The agent's side of code bundles and workspaces (no Django).

Before a launch the agent
  1. fetches the job's bundle (GET /api/agent/bundles/<sha256>/ with its node token) into a
     node-local cache, <work dir>/bundles/<sha256>.tar.gz, verifying the sha256 of the bytes
     before it keeps them (a damaged or replaced download is refused and fetched again later).
     The download runs in the background (BackgroundFetches: a few at once, one per digest),
     never on the reconcile thread, whose lock the heartbeats need: meanwhile the job is
     reported as "fetching code" (JobReport.waiting) and the next reconcile after the download
     launches it; a failed try is reported with its reason and tried again, and a bundle the
     control plane refuses to give (HTTP 4xx) fails the copy with that reason;
  2. prepares the job's workspace, <workspace root>/job-<id>: a fresh start gets the bundle
     unpacked into an empty folder (protocol.bundle.unpack refuses anything unsafe); a resume
     keeps what is there and lets meridian-run restore the checkpoint's workspace files
     (runtime/workspace.py), unpacking the bundle first only when the folder is new on this node
     (so that the entrypoint exists when meridian-run starts);
  3. launches meridian-run with --workspace, --outputs and --workspace-quota-bytes.

The workspace root must be the same path on every node (the default is <work dir>/workspaces;
set --workspace-root, or MERIDIAN_WORKSPACE_ROOT, to one path fleet-wide): a CRIU-restored
process reopens its files at the paths it had. meridian-run restores at the path recorded in
the checkpoint in any case.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from protocol.bundle import BundleError, is_sha256, unpack
from protocol.node import MAX_ERROR, JobReport
from protocol.states import CopyState

log = logging.getLogger("agent.bundles")
CHUNK = 1 << 20
WORKSPACE_ROOT_ENV = "MERIDIAN_WORKSPACE_ROOT"


FETCH_CONCURRENCY = 2  # downloads at once per node: a burst of launches does not starve the heartbeat's link
FETCH_RETRY_AFTER_S = 10.0


class BundleFetchError(RuntimeError):
    """The bundle could not be fetched or verified; the launch waits for the next reconcile."""


class BundleRefused(BundleFetchError):
    """The control plane will not give this node the bundle (HTTP 4xx: not one of its jobs', or
    gone): trying again cannot help, the copy fails with the reason."""


def fetch_bundle(client, sha256: str, cache_dir: pathlib.Path) -> pathlib.Path:
    """Returns the verified local copy of bundle `sha256`, downloading it with `client`'s node
    token when it is not cached. Raises BundleFetchError (HTTP error, digest mismatch)."""
    import requests

    if not is_sha256(sha256):
        raise BundleFetchError(f"{sha256!r} is not a bundle digest")
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"{sha256}.tar.gz"
    if final.is_file():
        return final
    tmp = cache_dir / f".fetch-{uuid.uuid4().hex}"
    digest = hashlib.sha256()
    try:
        try:
            with client.session.get(f"{client.url}/api/agent/bundles/{sha256}/", stream=True, timeout=client.timeout_s,
                                    headers={"Authorization": f"Node {client.token}"}) as response:
                if response.status_code != 200:
                    refused = 400 <= response.status_code < 500 and response.status_code not in (408, 429)
                    raise (BundleRefused if refused else BundleFetchError)(
                        f"GET bundle {sha256[:12]}…: HTTP {response.status_code} {response.text[:300]}")
                with open(tmp, "wb") as out:
                    for chunk in response.iter_content(CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
        except requests.RequestException as exc:
            raise BundleFetchError(f"GET bundle {sha256[:12]}…: {exc}") from None
        if digest.hexdigest() != sha256:
            raise BundleFetchError(f"bundle {sha256[:12]}… arrived with sha256 {digest.hexdigest()[:12]}…; refused")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def workspace_path(root: pathlib.Path, job_id: int) -> pathlib.Path:
    return pathlib.Path(root) / f"job-{int(job_id)}"


def prepare_workspace(*, root: pathlib.Path, job_id: int, bundle_archive: pathlib.Path | None,
                      bundle_sha256: str | None,
                      resume: bool) -> pathlib.Path:
    """Returns the job's workspace folder, ready for meridian-run (see the module docstring).
    Raises BundleError when the bundle is refused (digest or content)."""
    path = workspace_path(root, job_id)
    if resume and path.is_dir():
        return path
    if path.exists() or path.is_symlink():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".unpack-{path.name}-{uuid.uuid4().hex}"
    try:
        if bundle_archive is not None:
            unpack(bundle_archive, staging, expected_sha256=bundle_sha256)
        else:
            staging.mkdir()
        os.rename(staging, path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return path


@dataclass
class _Fetch:
    thread: threading.Thread | None = None
    archive: pathlib.Path | None = None
    error: BundleFetchError | None = None
    failed_at: float = 0.0


class BackgroundFetches:
    """Bundle downloads off the reconcile thread: `fetch(sha256) -> archive` (fetch_bundle with the
    node's client) runs in a thread per digest, at most `concurrency` at once; `get` says where
    each stands. A digest is downloaded by one thread at a time however many jobs want it."""

    def __init__(self, fetch: Callable[[str], pathlib.Path], *, concurrency: int = FETCH_CONCURRENCY,
                 retry_after_s: float = FETCH_RETRY_AFTER_S, clock: Callable[[], float] = time.monotonic):
        self._fetch = fetch
        self._slots = threading.BoundedSemaphore(concurrency)
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._fetches: dict[str, _Fetch] = {}

    def get(self, sha256: str) -> pathlib.Path | None:
        """Returns the verified archive of `sha256` once downloaded, else None (a download is
        running, started now if none was). Raises the last try's BundleFetchError while it is
        recent (retry_after_s; then the next get tries again), and BundleRefused for good."""
        with self._lock:
            fetch = self._fetches.setdefault(sha256, _Fetch())
            if fetch.archive is not None:
                if fetch.archive.is_file():
                    return fetch.archive
                fetch.archive = None  # removed since (a bundle refused at unpacking): fetched again
            if fetch.thread is not None:
                return None
            if fetch.error is not None:
                if isinstance(fetch.error, BundleRefused) or self._clock() - fetch.failed_at < self._retry_after_s:
                    raise fetch.error
                fetch.error = None
            fetch.thread = threading.Thread(target=self._run, args=(sha256, fetch), daemon=True,
                                            name=f"bundle-{sha256[:12]}")
            fetch.thread.start()
            return None

    def _run(self, sha256: str, fetch: _Fetch) -> None:
        with self._slots:
            try:
                archive, error = self._fetch(sha256), None
            except BundleFetchError as exc:
                archive, error = None, exc
            except (OSError, ValueError) as exc:  # the cache folder, say
                archive, error = None, BundleFetchError(f"bundle {sha256[:12]}…: {exc}")
        with self._lock:
            fetch.archive, fetch.error, fetch.failed_at, fetch.thread = archive, error, self._clock(), None
        if error is not None:
            log.warning("bundle %s…: %s", sha256[:12], error)


def waiting_report(entry, error: BundleFetchError | None = None) -> JobReport:
    """The report on `entry`'s copy while it waits for its bundle: starting, "fetching code"."""
    text = f"fetching code (bundle {entry.bundle[:12]}…)"
    if error is not None:
        text = f"{text}: the last try failed: {error}; trying again"
    return JobReport(job_id=entry.job_id, state=CopyState.STARTING, generation=entry.generation,
                     waiting=text[:MAX_ERROR])


def workspace_for_launch(reconciler, entry, *, resume: bool,
                         fetches: BackgroundFetches | None) -> pathlib.Path | None:
    """NodeReconciler.launch's step 1-2: returns the prepared workspace, or None when the bundle is
    not here yet (reconciler.waiting[job id] says why; the launch is tried again at the next
    reconcile) or the workspace cannot be prepared (logged). Raises BundleRefused when the copy
    cannot ever get its bundle."""
    archive = None
    if entry.bundle:
        if fetches is None:
            log.error("job %s: has bundle %s but this agent cannot fetch bundles; not launching",
                      entry.job_id, entry.bundle[:12])
            return None
        try:
            archive = fetches.get(entry.bundle)
        except BundleRefused:
            raise
        except BundleFetchError as exc:
            reconciler.waiting[entry.job_id] = waiting_report(entry, exc)
            return None
        if archive is None:
            reconciler.waiting[entry.job_id] = waiting_report(entry)
            return None
    reconciler.waiting.pop(entry.job_id, None)
    try:
        return prepare_workspace(root=reconciler.workspace_root, job_id=entry.job_id, bundle_archive=archive,
                                 bundle_sha256=entry.bundle, resume=resume)
    except (BundleError, OSError) as exc:
        log.error("job %s: cannot prepare its workspace: %s; not launching", entry.job_id, exc)
        if archive is not None and isinstance(exc, BundleError):
            archive.unlink(missing_ok=True)  # fetched again (and checked again) next time
        return None


def launch_arguments(entry, workspace: pathlib.Path) -> list[str]:
    """meridian-run's workspace flags for `entry`."""
    arguments = ["--workspace", str(workspace)]
    if entry.outputs:
        arguments += ["--outputs", entry.outputs]
    if entry.workspace_quota_bytes:
        arguments += ["--workspace-quota-bytes", str(entry.workspace_quota_bytes)]
    return arguments


def remove_workspace(root: pathlib.Path, job_id: int) -> None:
    """Removes a finished job's node-local workspace (its outputs were saved at its end)."""
    path = workspace_path(root, job_id)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
