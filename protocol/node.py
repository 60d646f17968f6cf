"""Control plane <-> node agent: every message of the agent API (/api/agent/), defined once.

  POST register/   Registration            -> RegistrationAnswer
  POST heartbeat/  Heartbeat               -> HeartbeatAnswer (with the node's DesiredState)
  POST lease/      Lease                   -> LeaseAnswer (liveness only; served outside Django:
                                              fleet/lease_api.py)
  GET  desired/    (no body)               -> DesiredState

Built and decoded on both sides: the agent (agent/main.py, agent/hollow.py, agent/client.py)
builds Registration and Heartbeat and decodes the answers; the control plane's HTTP edge
(jobs/agent_apis.py) decodes the requests through these types (a malformed field is a 400 naming
it) and jobs/workflows.py reads their attributes and builds DesiredState.

Bounds are physics and sanity, not policy: ids are >= 1, device counts fit a node, strings and
lists are short enough that no agent can make the control plane store or loop over much.
A field an older agent does not send has a default; a message without "v" is version 1.
Messages are keyword-only (a required field may follow a bounded one, which type checkers read
as a default).
"""
from __future__ import annotations

import posixpath
import re
import urllib.parse
from dataclasses import dataclass

from protocol.cut import MAX_SECONDS
from protocol.launch import MAX_BYTES, MAX_LEFT_OUT, CheckpointSeconds
from protocol.message import Message, bounded
from protocol.states import CopyState, CutAction, DesiredAction, JobNetwork, JobState, ResumeRefused

MAX_DEVICES_PER_NODE = 64  # devices one node may register (and report telemetry for)
MAX_DEVICE_INDEX = 2**15 - 1
MAX_DEVICES = 4096  # a device count (of a job on a node, of a cut)
MAX_WORLD_SIZE = 100_000  # logical ranks of one job (as jobs.services allows at submission)
MAX_JOBS_PER_NODE = 1024  # entries of one heartbeat or one desired state
MAX_STEP = 2**63 - 1  # a training step (the database's PositiveBigIntegerField)
MAX_ID = 2**63 - 1
MAX_GENERATION = 2**31 - 1
MAX_NAME = 253  # a hostname, a region, a cluster, a job name
MAX_WORD = 64  # a version string, a device type, an engine, a state word
MAX_URI = 2000  # a checkpoint URI (the database's Checkpoint.uri)
MAX_PATH = 4096
MAX_ERROR = 4096  # a failure text (the control plane keeps 4000 characters)
MAX_ARGS = 1000  # a job's args (as jobs.services allows at submission)
MAX_ENV = 500
MAX_ARG = 100_000
# Physics, not policy: the largest accelerator sold has 288 GB; 4 TB leaves room for a decade and
# keeps every sum over a planet-scale fleet (1e5 nodes x 64 devices x 4096) far from overflow.
MAX_DEVICE_MEMORY_GB = 4096
MAX_STEPS_PER_S = 1e7  # a training step takes at least a microsecond or so: 1e7 is beyond any job
SHA256_HEX = r"[0-9a-f]{64}"
CUT_KIND = r"optimizer-step|collective-boundary|any-moment"
# A committed checkpoint's folder in a store (runtime.store.CHECKPOINT_DIR_PATTERN): ckpt-<step>-<ns>.
CHECKPOINT_NAME = re.compile(r"ckpt-\d{12}-\d+")


# --- registration ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeviceDescription(Message):
    """One device of a registering node, in index order."""

    type: str = bounded(max_length=MAX_WORD)  # an accelerator type ("H100-80GB", "CPU")
    memory_gb: float | None = bounded(default=None, minimum=0, maximum=MAX_DEVICE_MEMORY_GB)  # None: the type's
    uuid: str | None = bounded(default=None, max_length=128)


@dataclass(frozen=True, kw_only=True)
class Registration(Message):
    """POST register/: this node and its devices. A new node sends `Authorization: Enroll
    <enrollment token>`; an enrolled node registers again with `Authorization: Node <its token>`
    (an enrollment token never takes over an enrolled node)."""

    hostname: str = bounded(max_length=MAX_NAME)
    devices: tuple[DeviceDescription, ...] = bounded(max_length=MAX_DEVICES_PER_NODE)
    region: str = bounded(default="local", max_length=MAX_NAME)
    cluster: str = bounded(default="default", max_length=MAX_NAME)
    rack: str = bounded(default="", max_length=MAX_NAME)
    agent_version: str = bounded(default="", max_length=256)


@dataclass(frozen=True, kw_only=True)
class RegistrationAnswer(Message):
    """201 to Registration: the node's id and its own token (a new one when it enrolled; the same
    one when it registered again with it)."""

    node_id: int = bounded(minimum=1, maximum=MAX_ID)
    token: str = bounded(max_length=512)
    hostname: str = bounded(default="", max_length=MAX_NAME)
    heartbeat_seconds: float | None = bounded(default=None, minimum=0, maximum=86_400)


# --- heartbeat ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeviceReading(Message):
    """One device's latest telemetry."""

    index: int = bounded(minimum=0, maximum=MAX_DEVICE_INDEX)  # node-local Accelerator.index
    utilization: float | None = bounded(default=None, minimum=0.0, maximum=1.0)
    memory_used_gb: float | None = bounded(default=None, minimum=0.0, maximum=MAX_DEVICE_MEMORY_GB)


@dataclass(frozen=True, kw_only=True)
class Telemetry(Message):
    """The node's readings since its previous heartbeat (aggregated on the node)."""

    utilization: float | None = bounded(default=None, minimum=0.0, maximum=1.0)  # mean over devices
    memory_used_gb: float | None = bounded(default=None, minimum=0.0,
                                           maximum=MAX_DEVICES_PER_NODE * MAX_DEVICE_MEMORY_GB)
    devices: tuple[DeviceReading, ...] = bounded(default=(), max_length=MAX_DEVICES_PER_NODE)


@dataclass(frozen=True, kw_only=True)
class CheckpointReport(Message):
    """The newest checkpoint a copy committed to its store: a folder of the copy's own store
    (DesiredJob.store; see checkpoint_uri_problem) and the sha256 of its MANIFEST.json, which the
    control plane records and every later restore checks before it loads anything. (The control
    plane refuses a checkpoint without it; the field is optional only so that an older agent's
    heartbeat still decodes.)"""

    uri: str = bounded(max_length=MAX_URI)
    step: int | None = bounded(default=None, minimum=0, maximum=MAX_STEP)
    bytes: int = bounded(default=0, minimum=0, maximum=2**62)
    engine: str | None = bounded(default=None, max_length=16)  # "criu" | "framework"
    sha256: str | None = bounded(default=None, max_length=64, pattern=SHA256_HEX)  # of MANIFEST.json
    # What the checkpoint left out of the job's state, with why (protocol.launch.left_out_lines);
    # the control plane writes them into the job's "checkpointed" event
    left_out: tuple[str, ...] = bounded(default=(), max_length=MAX_LEFT_OUT + 1)
    # Where its time went, stage by stage, and how much of it came from devices (protocol.launch's
    # CheckpointSeconds and CheckpointTaken.device_bytes); the "checkpointed" event says them
    seconds: CheckpointSeconds | None = None
    device_bytes: int | None = bounded(default=None, minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, kw_only=True)
class CutReport(Message):
    """The newest consistent cut the copy's launcher took (a stop, checkpoint or resize)."""

    action: CutAction
    step: int = bounded(minimum=0, maximum=MAX_STEP)
    devices: int | None = bounded(default=None, minimum=0, maximum=MAX_DEVICES)  # a resize's new count
    # where the ranks were cut (runtime/cut.py); None: an older agent, or a resize
    kind: str | None = bounded(default=None, pattern=CUT_KIND)


@dataclass(frozen=True, kw_only=True)
class RestoreReport(Message):
    """How a copy was restored from a checkpoint (its launcher's Restored event and, for the
    framework engine, StateApplied): the job's "restored" event says it with its stages. `seconds`:
    the launcher's restore (CRIU: the whole processes, of which `device_in` the driver moving the
    ranks' CUDA state back onto their GPUs); the framework engine's ranks then read their files
    (`load_s`, store -> host) and load them into the script's objects (`apply_s`, `device_bytes` of
    them onto devices)."""

    step: int = bounded(minimum=0, maximum=MAX_STEP)
    engine: str | None = bounded(default=None, max_length=MAX_WORD)
    seconds: float = bounded(minimum=0, maximum=MAX_SECONDS)
    device_in: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)
    load_s: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)
    apply_s: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)
    device_bytes: int | None = bounded(default=None, minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, kw_only=True)
class JobReport(Message):
    """What the agent observes of one copy of a job on its node."""

    job_id: int = bounded(minimum=1, maximum=MAX_ID)
    state: CopyState
    generation: int | None = bounded(default=None, minimum=0, maximum=MAX_GENERATION)  # None: not said
    step: int | None = bounded(default=None, minimum=0, maximum=MAX_STEP)
    steps_per_s: float | None = bounded(default=None, minimum=0.0, maximum=MAX_STEPS_PER_S)
    devices: int | None = bounded(default=None, minimum=0, maximum=MAX_DEVICES)
    engine: str | None = bounded(default=None, max_length=MAX_WORD)
    checkpoint: CheckpointReport | None = None
    cut: CutReport | None = None
    restored_step: int | None = bounded(default=None, minimum=0, maximum=MAX_STEP)
    error: str | None = bounded(default=None, max_length=MAX_ERROR)  # why it failed
    exit_code: int | None = bounded(default=None, minimum=-255, maximum=255)
    # How the copy's ranks are confined ("uid 1000007, cgroup v1 ...") or "UNCONFINED ...: why"
    sandbox: str | None = bounded(default=None, max_length=MAX_ERROR)
    # Why the copy's checkpoint engine was chosen ("auto: CRIU cannot dump ranks ... here"), once known
    engine_reason: str | None = bounded(default=None, max_length=MAX_ERROR)
    # Why a copy that is starting waits before its launch ("fetching code (bundle ...)")
    waiting: str | None = bounded(default=None, max_length=MAX_ERROR)
    # What the launcher said about a finished copy (its finished event's note), e.g. no steps taken
    note: str | None = bounded(default=None, max_length=MAX_ERROR)
    # Why the copy's launcher started the script again from scratch after the framework engine
    # refused its resume (the job's if_resume_refused is "restart"); None: it did not. Said on every
    # report of the copy (level-triggered): the control plane writes the job's event once.
    restarted: str | None = bounded(default=None, max_length=MAX_ERROR)
    # How the copy was restored, once known (level-triggered too: the "restored" event is written
    # once per generation); None: started fresh, or a framework copy whose ranks have not loaded yet.
    restore: RestoreReport | None = None
    # A failed copy that failed because a host of the job failed under it, not its code (the
    # launcher's failed event says so: protocol.launch.Failed.host_failure).
    host_failure: bool = False


# Report fields that change on every beat of a running copy (its progress): agents send them with
# the periodic full heartbeat only (agent/liveness.py), and the control plane's heartbeat folder
# tells a report it already decided from one it did not by all the rest (jobs/heartbeat_fold.py).
PROGRESS_FIELDS = ("step", "steps_per_s")


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """POST heartbeat/: the node's telemetry and a report on every copy it holds."""

    telemetry: Telemetry | None = None
    jobs: tuple[JobReport, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)
    # The `desired_version` of the desired state this agent holds (from an earlier answer): the
    # answer then omits `desired` while it is unchanged. None (older agents): always sent.
    desired_version: str | None = bounded(default=None, max_length=MAX_WORD)


# --- desired state --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class JobSpan(Message):
    """A job that spans hosts: this node's share of it (the desired entry's `span`; absent on a
    job that runs on one host, so an entry without it is what every agent always ran).

    Node `node_rank` of `nodes` runs the logical ranks [first_rank, first_rank + ranks), one
    contiguous block: W/job_devices ranks per device this host holds, so hosts holding unequal
    device counts run unequal blocks (one meridian-run per host, node 0 leading, given the block
    as --first-rank/--host-ranks: runtime/multihost.host_block); the job has `job_devices`
    devices in all. `leader` is the hostname of node 0 (for
    humans and logs: no address or port travels here). `rendezvous` is the folder of the shared
    store where the leader publishes its run-time address (runtime/rendezvous.py), one per
    placement generation."""

    nodes: int = bounded(minimum=2, maximum=MAX_DEVICES)
    node_rank: int = bounded(minimum=0, maximum=MAX_DEVICES - 1)
    first_rank: int = bounded(minimum=0, maximum=MAX_WORLD_SIZE - 1)
    ranks: int = bounded(minimum=1, maximum=MAX_WORLD_SIZE)
    job_devices: int = bounded(minimum=1, maximum=MAX_DEVICES)
    leader: str = bounded(default="", max_length=MAX_NAME)
    rendezvous: str = bounded(max_length=MAX_URI)


@dataclass(frozen=True, kw_only=True)
class DesiredJob(Message):
    """One job the node should run, wait for, or stop (see DesiredAction).

    A "stop" entry carries only job_id, action, generation and the move taking the copy off
    the node (`move`, `move_step`); "run" and "wait" entries carry the job's launch details."""

    job_id: int = bounded(minimum=1, maximum=MAX_ID)
    action: DesiredAction
    generation: int | None = bounded(default=None, minimum=0, maximum=MAX_GENERATION)
    name: str = bounded(default="", max_length=MAX_NAME)
    tier: str = bounded(default="", max_length=MAX_WORD)
    state: JobState | None = None  # the job's state in the control plane
    world_size: int = bounded(default=0, minimum=0, maximum=MAX_WORLD_SIZE)
    devices: int = bounded(default=0, minimum=0, maximum=MAX_DEVICES)  # how many of this node's devices
    # The node-local Accelerator.index of each device its replicas hold, sorted; len == devices.
    device_indices: tuple[int, ...] = bounded(default=(), max_length=MAX_DEVICES)
    entrypoint: str = bounded(default="", max_length=MAX_PATH)
    args: tuple[str, ...] = bounded(default=(), max_length=MAX_ARGS)
    env: dict[str, str] | None = bounded(default=None, max_length=MAX_ENV)
    store: str | None = bounded(default=None, max_length=MAX_URI)  # this generation's store folder
    restore_from: str | None = bounded(default=None, max_length=MAX_URI)  # None: start afresh
    # The sha256 of restore_from's MANIFEST.json as the control plane recorded it: the agent and the
    # runtime refuse to restore a checkpoint whose manifest differs (or when this is None).
    restore_sha256: str | None = bounded(default=None, max_length=64, pattern=SHA256_HEX)
    last_checkpoint_step: int | None = bounded(default=None, minimum=0, maximum=MAX_STEP)
    move: str | None = bounded(default=None, max_length=MAX_WORD)  # a stop's move kind
    move_step: str | None = bounded(default=None, max_length=MAX_WORD)  # ... and the step it is at
    # The job's code bundle (protocol.bundle): its sha256, fetched from GET /api/agent/bundles/<sha256>/ and
    # unpacked into the job's workspace; None: the entrypoint is on the node (relative to its workload root).
    bundle: str | None = bounded(default=None, max_length=64)
    outputs: str | None = bounded(default=None, max_length=MAX_URI)  # where the workspace is saved
    workspace_quota_bytes: int | None = bounded(default=None, minimum=0, maximum=2**63 - 1)
    # Added in the multi-host control loop (issue 14): present only when the job spans hosts; an
    # agent that does not know it would run all W ranks here, so such jobs need upgraded agents.
    span: JobSpan | None = None
    # What the launcher does when the framework engine refuses the resume (issue 19): passed as
    # --if-resume-refused. An entry without it (an older control plane) is "fail", what every agent
    # always did; an older agent ignores it and fails such a job, saying why.
    if_resume_refused: ResumeRefused = ResumeRefused.FAIL
    # The copy's log grant (jobs.logs.log_grant: a keyed digest of job, generation and this node):
    # the agent sends it with the copy's log chunks, so its output is taken even when it first
    # reaches the control plane after the job ended. None on "stop" entries and older control planes.
    log_grant: str | None = bounded(default=None, max_length=64, pattern=SHA256_HEX)
    # The job's network (issue 13): "isolated" (a namespace of its own, loopback only) or "host" (the
    # node's, which the control plane grants only where its operator allows). An entry without it
    # (an older control plane) is isolated; the agent gives the host network anyway to a job that
    # runs unconfined, and says so in the job's events (a job spanning hosts gets a network of its
    # own across them since session 22: runtime/netns.py JobNetworkPart). An older agent ignores it:
    # its jobs keep the node's network, as before (upgrade agents first).
    network: JobNetwork = JobNetwork.ISOLATED


@dataclass(frozen=True, kw_only=True)
class DesiredState(Message):
    """What a node's agent should run now; a local copy of a job not listed is stopped (with a cut)."""

    node_id: int = bounded(minimum=1, maximum=MAX_ID)
    hostname: str = bounded(default="", max_length=MAX_NAME)
    state: str = bounded(default="", max_length=MAX_WORD)  # the node's state ("ready", "draining", "lost")
    # The control plane counts the node lost after this long without a heartbeat: the agent fences
    # itself (kills its jobs without a checkpoint) after as long without an answer.
    lost_after_seconds: float | None = bounded(default=None, minimum=0, maximum=86_400 * 365)
    jobs: tuple[DesiredJob, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)


@dataclass(frozen=True, kw_only=True)
class Rejection(Message):
    """A job report the control plane refused (changing nothing), and what the agent must do."""

    job_id: int = bounded(minimum=1, maximum=MAX_ID)
    error: str = bounded(default="", max_length=MAX_ERROR)
    fence: bool = False  # a stale generation: kill the copy without a checkpoint
    cancel: bool = False  # the job was cancelled: kill the copy and remove its store


@dataclass(frozen=True, kw_only=True)
class ReportOutcome(Message):
    """What the control plane did with a heartbeat's job reports (jobs.workflows.node_report_record).

    accepted: recorded; rejected: refused (see Rejection); deferred: not decided yet, the agent
    reports it again (a final state that must wait, or a report queued for the control plane's
    heartbeat folder that it has not recorded yet: jobs/heartbeat_fold.py)."""

    accepted: tuple[int, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)
    rejected: tuple[Rejection, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)
    deferred: tuple[int, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)


@dataclass(frozen=True, kw_only=True)
class HeartbeatAnswer(Message):
    """200 to Heartbeat: what became of each report, and the node's desired state.

    `desired` is None only when the heartbeat named the current `desired_version` (the agent keeps
    the desired state it holds); `desired_version` names the content of the desired state (a
    digest of its wire form: equal versions, equal desired states)."""

    desired: DesiredState | None = None
    desired_version: str | None = bounded(default=None, max_length=MAX_WORD)
    accepted: tuple[int, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)
    rejected: tuple[Rejection, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)
    deferred: tuple[int, ...] = bounded(default=(), max_length=MAX_JOBS_PER_NODE)
    heartbeat_seconds: float | None = bounded(default=None, minimum=0, maximum=86_400)
    # The node's desired serial (LeaseAnswer.desired_serial) read before `desired` was built: the
    # agent holds the desired state of this serial. None: a control plane without leases.
    desired_serial: int | None = bounded(default=None, minimum=0, maximum=MAX_ID)


# --- the liveness lease ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Lease(Message):
    """POST lease/: "this node is alive", and nothing else (fleet/lease_api.py). It carries no
    report and changes no desired state: it proves liveness only. `node_id` must be the token's own."""

    node_id: int = bounded(minimum=1, maximum=MAX_ID)


@dataclass(frozen=True, kw_only=True)
class LeaseAnswer(Message):
    """200 to Lease: what the agent needs to decide whether a full heartbeat is due.

    `desired_serial` changes whenever the control plane may have changed this node's desired state
    (jobs/desired_signal.py); an agent whose last full heartbeat began after it saw this serial
    holds the current desired state. `full_heartbeat_seconds`: send a full heartbeat (telemetry,
    progress) at least this often even when nothing changed."""

    node_id: int = bounded(minimum=1, maximum=MAX_ID)
    desired_serial: int = bounded(minimum=0, maximum=MAX_ID)
    lease_seconds: float = bounded(minimum=0, maximum=86_400)
    full_heartbeat_seconds: float = bounded(minimum=0, maximum=86_400)
    lost_after_seconds: float = bounded(minimum=0, maximum=86_400 * 365)


# --- the checkpoint store's layout ----------------------------------------------------------------


def local_path(uri: str) -> str | None:
    """Returns the path a file:// URI (file:///abs/path) or a plain path names, or None for any
    other scheme or a file:// URI naming another host."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return urllib.parse.unquote(parsed.path) if parsed.netloc in ("", "localhost") else None
    return uri if parsed.scheme == "" else None


def checkpoint_uri_problem(uri: str, *, store: str) -> str | None:
    """Returns None when `uri` names a committed checkpoint folder directly inside the store folder
    `store` (<store>/ckpt-<step>-<ns>, as the runtime's store writes them), else what is wrong.

    A copy may report (and a restore may name) only a checkpoint of its own job and generation:
    `store` is that generation's folder (<root>/job-<id>/g<n>). A path with "." or ".." parts,
    another scheme, or a folder elsewhere is refused, so no node can make the control plane
    record, and a later copy restore, a checkpoint it planted outside its own store."""
    path, folder = local_path(uri), local_path(store)
    if path is None or folder is None:
        return "must be a file:// URI or a path (other schemes are not supported)"
    if any(part in (".", "..") for part in path.split("/")):
        return "must not contain '.' or '..' parts"
    if not path.startswith("/"):
        return "must be an absolute path"
    name = posixpath.basename(path.rstrip("/"))
    if posixpath.dirname(posixpath.normpath(path)) != posixpath.normpath(folder) or not CHECKPOINT_NAME.fullmatch(name):
        return f"must be a checkpoint folder (ckpt-<step>-<ns>) directly inside this copy's store {store}"
    return None
