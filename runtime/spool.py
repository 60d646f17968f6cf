"""The spool: the small files through which the launcher and its rank processes talk.

Why files and not sockets: a rank process that CRIU dumps must hold no socket, and a restored
rank must find its launcher again on another node. The spool lives at a path that is the same on
every node of a fleet (``/run/meridian/<job-id>`` by convention, overridable with
MERIDIAN_SPOOL), so a restored process finds it where it left it. Each rank also keeps its
working directory and its stdout/stderr log there (CRIU needs open files at the same path and
size on restore; the launcher carries the logs inside every checkpoint).

Layout (all JSON written atomically: temporary file, fsync, rename):
    request.json           launcher -> ranks: the pending cut request {id, action, at_step, ...}
    devices.json           launcher -> ranks: rank -> device map and device -> cores
    rank<r>/out.log        the rank's stdout (err.log: its stderr)
    rank<r>/cut-<id>.json  rank -> launcher: "I stopped at step s for request id" (+ status)
    resume-<id>.json       launcher -> ranks: rebuild the inner group here and go on
    progress.json          rank 0 -> launcher: step, steps/s, updated every ~0.5 s
"""
import json
import os
import pathlib
import tempfile

DEFAULT_SPOOL_ROOT = "/run/meridian"


def spool_dir_for(job_id, root=None):
    """Returns the spool path of job_id: MERIDIAN_SPOOL_ROOT (or /run/meridian) / job_id."""
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"job id {job_id!r} must be a non-empty name without '/'")
    root = root or os.environ.get("MERIDIAN_SPOOL_ROOT") or DEFAULT_SPOOL_ROOT
    return pathlib.Path(root) / job_id


def write_json_atomic(path, payload):
    """Writes payload as JSON to path so a reader sees the old or the new file, never half."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        # Readable by the other side: a sandboxed rank (the job's uid) reads what the launcher
        # (root) writes here; the spool folder itself keeps other jobs out.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json(path, default=None):
    """Returns the parsed JSON at path, or default when the file does not exist."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return default


def rank_dir(spool, rank):
    return pathlib.Path(spool) / f"rank{rank}"


def cut_report_path(spool, rank, request_id):
    return rank_dir(spool, rank) / f"cut-{request_id}.json"


def loaded_path(spool, rank):
    """Where a framework-resumed rank says how its state came back (protocol.cut.StateLoaded)."""
    return rank_dir(spool, rank) / "loaded.json"


def resume_path(spool, request_id):
    return pathlib.Path(spool) / f"resume-{request_id}.json"
