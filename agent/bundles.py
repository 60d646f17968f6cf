"""The agent's side of code bundles and workspaces (no Django).

Before a launch the agent
  1. fetches the job's bundle (GET /api/agent/bundles/<sha256>/ with its node token) into a
     node-local cache, <work dir>/bundles/<sha256>.tar.gz, verifying the sha256 of the bytes
     before it keeps them (a damaged or replaced download is refused and fetched again later);
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
import uuid
from collections.abc import Callable

from protocol.bundle import BundleError, is_sha256, unpack

log = logging.getLogger("agent.bundles")
CHUNK = 1 << 20
WORKSPACE_ROOT_ENV = "MERIDIAN_WORKSPACE_ROOT"


class BundleFetchError(RuntimeError):
    """The bundle could not be fetched or verified; the launch waits for the next reconcile."""


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
                    raise BundleFetchError(f"GET bundle {sha256[:12]}…: HTTP {response.status_code} "
                                           f"{response.text[:300]}")
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


def workspace_for_launch(reconciler, entry, *, resume: bool,
                         fetch: Callable[[str], pathlib.Path] | None) -> pathlib.Path | None:
    """NodeReconciler.launch's step 1-2: returns the prepared workspace, or None (logged) when the
    bundle cannot be had yet (the launch is retried on the next reconcile)."""
    archive = None
    if entry.bundle:
        if fetch is None:
            log.error("job %s: has bundle %s but this agent cannot fetch bundles; not launching",
                      entry.job_id, entry.bundle[:12])
            return None
        try:
            archive = fetch(entry.bundle)
        except BundleFetchError as exc:
            log.error("job %s: %s; not launching (retried on the next reconcile)", entry.job_id, exc)
            return None
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
