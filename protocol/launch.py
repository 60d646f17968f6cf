"""Launcher <-> agent: what meridian-run tells the node agent, and the agent's commands to it.

In the job directory (node-local, read by the agent, which may outlive or predate the launcher):
    events.jsonl   one LaunchEvent per line, appended: Started, Restored, StateApplied, CheckpointTaken,
                   Resized, Stopped, Finished, Failed, CommandFailed (`parse_events` reads them)
    progress.json  Progress, rewritten atomically about every 0.5 s (also the answer to "progress")

On the control socket (runtime/control.py), one request and one answer per connection:
    ProgressRequest -> Progress           CheckpointRequest, StopRequest -> CheckpointAnswer
    ResizeRequest   -> ResizeAnswer       any of them -> ControlFailure (ok false, why in words)
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union

from protocol.cut import MAX_BYTES, MAX_DEVICES, MAX_PATH, MAX_RANKS, MAX_SECONDS, DeviceMap, check_device_indices
from protocol.message import Message, ProtocolError, bounded
from protocol.states import JobNetwork, LaunchState

MAX_ERROR = 20000  # characters: an error carries a log tail
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_LEFT_OUT = 20  # lines of a checkpoint's left_out on the wire; its manifest keeps them all
MAX_LEFT_OUT_LINE = 500  # characters

CheckpointAction = Literal["checkpoint", "stop"]


# -- events.jsonl ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LaunchEvent(Message):
    """One line of events.jsonl. `engine` is None only before an engine was chosen."""

    event: str
    time_unix: float
    engine: str | None = bounded(default=None, max_length=64)


@dataclass(frozen=True, kw_only=True)
class Started(LaunchEvent):
    event: Literal["started"] = "started"
    world_size: int = bounded(minimum=1, maximum=MAX_RANKS)
    devices: int = bounded(minimum=1, maximum=MAX_DEVICES)
    reason: str = bounded(max_length=2000)  # why this engine
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)
    sandbox: str | None = bounded(default=None, max_length=2000)  # how the ranks are confined, or why not


@dataclass(frozen=True, kw_only=True)
class Restored(LaunchEvent):
    event: Literal["restored"] = "restored"
    step: int = bounded(minimum=0)
    checkpoint: str = bounded(max_length=MAX_PATH)  # its URI
    spool: str = bounded(max_length=MAX_PATH)
    seconds: float = bounded(minimum=0)
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)
    sandbox: str | None = bounded(default=None, max_length=2000)  # how the ranks are confined, or why not
    # of `seconds`: the driver moving the restored ranks' CUDA state back onto their GPUs (the CRIU
    # engine on a GPU job: runtime/criu_cuda.py); None where no rank had any
    device_in: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)


@dataclass(frozen=True, kw_only=True)
class StateApplied(LaunchEvent):
    """After a framework engine's Restored: every rank of this host put its state back (from their
    protocol.cut.StateLoaded): the slowest rank's read of its checkpoint file into host memory with
    its sha256 (store -> host) and load into the script's objects (host -> device on a GPU), and the
    bytes all of them moved to devices."""

    event: Literal["applied"] = "applied"
    step: int = bounded(minimum=0)
    load_s: float = bounded(minimum=0, maximum=MAX_SECONDS)
    apply_s: float = bounded(minimum=0, maximum=MAX_SECONDS)
    device_bytes: int = bounded(minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, kw_only=True)
class CheckpointSeconds(Message):
    """Where a checkpoint's time went: reaching the cut, the engine's dump, the store's commit
    (staging -> store). With the framework engine the ranks write their state while the cut is
    taken: `save` is the slowest rank's write (device -> host -> staging file), part of `cut`."""

    cut: float = bounded(minimum=0, maximum=MAX_SECONDS)
    dump: float = bounded(minimum=0, maximum=MAX_SECONDS)
    commit: float = bounded(minimum=0, maximum=MAX_SECONDS)
    total: float = bounded(minimum=0, maximum=MAX_SECONDS)
    save: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)
    # The CRIU engine on a GPU job: the driver moving the ranks' CUDA state into their host memory
    # before the dump (part of `dump`), and back onto their GPUs after it (a checkpoint the job goes
    # on from: after `dump`, before the ranks go on). None where no rank held CUDA state.
    device_out: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)
    device_in: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)


@dataclass(frozen=True, kw_only=True)
class CheckpointTaken(LaunchEvent):
    event: Literal["checkpoint"] = "checkpoint"
    step: int = bounded(minimum=0)
    checkpoint: str = bounded(max_length=MAX_PATH)
    bytes: int = bounded(minimum=0)
    action: CheckpointAction
    seconds: CheckpointSeconds
    # optimizer-step / collective-boundary / any-moment (runtime/cut.py): where the ranks were cut
    cut_kind: str | None = bounded(default=None, max_length=64)
    # `bytes` is what the store holds for this checkpoint itself; a CRIU checkpoint whose pages
    # are deduplicated also needs its base (runtime/criu_pages.py), named here
    base: str | None = bounded(default=None, max_length=MAX_PATH)
    # What this checkpoint leaves out of the job's state, one line each with why (left_out_lines):
    # a sandboxed job's stale unix socket files in its private /tmp (runtime/private_dirs.py)
    left_out: tuple[str, ...] = bounded(default=(), max_length=MAX_LEFT_OUT + 1)
    # The framework engine: bytes of the ranks' state that lived on a device other than the CPU (a
    # GPU's), copied to the host by their writes; None where not counted (the CRIU engine)
    device_bytes: int | None = bounded(default=None, minimum=0, maximum=MAX_BYTES)


def left_out_lines(lines: Sequence[str]) -> tuple[str, ...]:
    """Returns `lines` (what a checkpoint left out) bounded for an event or a report: at most
    MAX_LEFT_OUT lines of at most MAX_LEFT_OUT_LINE characters, and a last line that says how many
    more the checkpoint's manifest lists."""
    kept = tuple(line if len(line) <= MAX_LEFT_OUT_LINE else line[:MAX_LEFT_OUT_LINE - 1] + "…"
                 for line in list(lines)[:MAX_LEFT_OUT])
    more = len(lines) - len(kept)
    return kept + ((f"… and {more} more (the checkpoint's manifest lists them all)",) if more > 0 else ())


@dataclass(frozen=True, kw_only=True)
class Resized(LaunchEvent):
    event: Literal["resize"] = "resize"
    step: int = bounded(minimum=0)
    devices: int = bounded(minimum=1, maximum=MAX_DEVICES)
    device_map: DeviceMap
    seconds: float = bounded(minimum=0)
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)


@dataclass(frozen=True, kw_only=True)
class Stopped(LaunchEvent):
    event: Literal["stopped"] = "stopped"
    step: int = bounded(minimum=0)
    checkpoint: str = bounded(max_length=MAX_PATH)


@dataclass(frozen=True, kw_only=True)
class Finished(LaunchEvent):
    event: Literal["finished"] = "finished"
    step: int | None = bounded(default=None, minimum=0)  # None: rank 0 never reported a step
    # Something the job's owner should know about a success (e.g. it took no optimizer step).
    note: str | None = bounded(default=None, max_length=2000)


@dataclass(frozen=True, kw_only=True)
class Failed(LaunchEvent):
    """The launcher ends with exit code 1 or 2; `error` says why in words."""

    event: Literal["failed"] = "failed"
    error: str = bounded(max_length=MAX_ERROR)
    # True: the job cannot go on because a host of it failed under it (a launcher fenced itself
    # when its agent fell silent, a host of the job went silent, the leader is unreachable), not
    # because of its code; the control plane restarts it from its last checkpoint.
    host_failure: bool = False


@dataclass(frozen=True, kw_only=True)
class CommandFailed(LaunchEvent):
    """A control command failed; the job goes on unless a Failed event follows."""

    event: Literal["checkpoint_failed", "stop_failed", "resize_failed"]
    error: str = bounded(max_length=MAX_ERROR)


EVENT_TYPES: dict[str, type[LaunchEvent]] = {
    "started": Started, "restored": Restored, "applied": StateApplied, "checkpoint": CheckpointTaken,
    "resize": Resized,
    "stopped": Stopped, "finished": Finished, "failed": Failed,
    "checkpoint_failed": CommandFailed, "stop_failed": CommandFailed, "resize_failed": CommandFailed,
}
TERMINAL_EVENTS = ("finished", "stopped", "failed")


def event_from_dict(obj: Any) -> LaunchEvent:
    """Returns the typed event `obj` encodes; raises ProtocolError (an unknown kind names "event")."""
    kind = obj.get("event") if isinstance(obj, dict) else None
    event_type = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if event_type is None:
        if not isinstance(obj, dict):
            raise ProtocolError("", "an event must be a JSON object")
        raise ProtocolError("event", f"unknown event {kind!r}; known: {', '.join(EVENT_TYPES)}")
    return event_type.from_dict(obj)


def event_line(event: LaunchEvent) -> str:
    """Returns the line (with its newline) that appends `event` to events.jsonl."""
    return json.dumps(event.to_dict()) + "\n"


def parse_events(text: str) -> list[LaunchEvent]:
    """Returns the events of an events.jsonl text, oldest first.

    Skips a line that is not JSON (the launcher may be writing the last one: a torn line) and
    one that is not an event this side knows (a newer launcher's kind, or a malformed record),
    so a reader never fails on the log of a job it observes."""
    events = []
    for line in text.splitlines():
        try:
            events.append(event_from_dict(json.loads(line)))
        except (ValueError, ProtocolError):  # ProtocolError is a ValueError; both named for the reader
            continue
    return events


# The per-job addresses of jobs spanning hosts with an isolated network (runtime/netns.py). Each
# job has a block of JOB_NETWORK_HOSTS addresses, block (job id mod JOB_NETWORK_BLOCKS): derived,
# not allocated, so no control-plane state and no wire field carries it. Two live jobs whose ids
# are equal modulo JOB_NETWORK_BLOCKS share a block; that matters only on a node that routes both
# (a node holding a part of each), and there the second launcher's claim of the address fails
# (runtime/netns.py claim_address) and its launch is refused by name, never misrouted.
JOB_NETWORK_RANGE = ipaddress.IPv4Network("100.64.0.0/10")  # RFC 6598 shared address space
JOB_NETWORK_HOSTS = 64  # addresses per job: an isolated network spans at most 64 hosts
JOB_NETWORK_BLOCKS = JOB_NETWORK_RANGE.num_addresses // JOB_NETWORK_HOSTS  # 65536


# -- sandbox.json: the agent -> launcher description of a job's sandbox (runtime/sandbox.py) ---------
MAX_UID = 2**31 - 2


@dataclass(frozen=True, kw_only=True)
class SandboxSpec(Message):
    """<job dir>/sandbox.json (root's, mode 600), given as `meridian-run --sandbox FILE`: how the
    launcher confines the job's ranks. `uid` None: unconfined (the ranks run as the launcher's
    user), `unconfined_reason` says why; the environment is the job's only either way.

    `network` (version 2): "isolated", the launcher enters a network namespace of the job's own
    before anything else (runtime/netns.py; spanning hosts, one with `job_addresses`); "host", the
    node's network. Version 2 because a
    launcher that predates the field must not ignore it: it refuses the spec ("v: protocol version 2
    is newer than this side's 1", exit 2: tried) and the launch fails, where ignoring it would have
    run an isolated job on the node's network. A version 1 spec (an agent that predates it) reads
    as "host": that agent isolated nothing."""

    VERSION: ClassVar[int] = 2

    uid: int | None = bounded(default=None, minimum=1, maximum=MAX_UID)
    gid: int | None = bounded(default=None, minimum=1, maximum=MAX_UID)
    unconfined_reason: str | None = bounded(default=None, max_length=2000)
    cgroup_version: Literal["v1", "v2"] | None = None
    cgroup_dirs: tuple[str, ...] = bounded(default=(), max_length=8)  # the job's cgroup folders
    memory_bytes: int | None = bounded(default=None, minimum=1, maximum=2**62)
    device_kind: Literal["cpu", "gpu"] = "cpu"
    node_devices: int | None = bounded(default=None, minimum=1, maximum=MAX_DEVICES)  # devices of the node
    node_cores: tuple[int, ...] = bounded(default=(), max_length=65536)  # the cores behind them
    env: dict[str, str] | None = bounded(default=None, max_length=500)  # the job's own environment
    home: str | None = bounded(default=None, max_length=MAX_PATH)  # HOME of the ranks (their workspace)
    network: JobNetwork = JobNetwork.HOST
    # A job spanning hosts with an isolated network (runtime/netns.py JobNetworkPart): the address
    # of each host's part of the job, host (node rank) order, from job_part_addresses. Empty on one
    # host and on the host network. A launcher that predates the field refuses an isolated network
    # on several hosts (it never ran one), so no version bump is needed.
    job_addresses: tuple[str, ...] = bounded(default=(), max_length=JOB_NETWORK_HOSTS)

    def __post_init__(self) -> None:
        check_job_addresses(self.job_addresses)
        if self.job_addresses and self.network != JobNetwork.ISOLATED:
            raise ProtocolError("job_addresses", "job addresses are given only with network \"isolated\"")

    def describe(self, *, nodes: int = 1) -> str:
        """One line for the job's events: how it is confined, or UNCONFINED and why, and its network
        (on several hosts, `nodes`)."""
        if self.uid is None:
            confinement = f"UNCONFINED (ranks run as the launcher's user): {self.unconfined_reason or 'sandbox off'}"
        else:
            memory = f"{self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else "no memory limit"
            confinement = (f"uid {self.uid}, gid {self.gid}, cgroup {self.cgroup_version} "
                           f"{self.cgroup_dirs[0] if self.cgroup_dirs else '-'}, {memory}")
        return f"{confinement}, {self.describe_network(nodes=nodes)}"

    def describe_network(self, *, nodes: int = 1) -> str:
        """Returns "network: isolated (...)" or "network: host (why)", the words of the job's events."""
        if self.network == JobNetwork.ISOLATED:
            if nodes > 1:
                return (f"network: isolated ({NETWORK_SPANS_HOSTS}: "
                        f"{', '.join(self.job_addresses) or 'no addresses given'})")
            return "network: isolated (a namespace of the job's own, loopback only)"
        if self.uid is None:
            return "network: host (unconfined)"
        return "network: host (the job asked for the node's network)"


NETWORK_SPANS_HOSTS = ("a namespace of the job's own on each host with loopback and one address, routed only "
                       "to the job's parts on its other hosts")

def job_part_addresses(*, job_id: int, nodes: int) -> tuple[str, ...]:
    """Returns the address of each host's part (node rank order) of job `job_id` spanning `nodes`
    hosts with an isolated network. Raises ValueError for a job id below 1 or `nodes` outside
    2..JOB_NETWORK_HOSTS (a wider job cannot have an isolated network: its launch is refused)."""
    if job_id < 1:
        raise ValueError(f"job id {job_id} must be at least 1")
    if not 2 <= nodes <= JOB_NETWORK_HOSTS:
        raise ValueError(f"an isolated network spans 2..{JOB_NETWORK_HOSTS} hosts, not {nodes}: a job over more "
                         "hosts needs the host network (network: host, where the operator allows it)")
    first = int(JOB_NETWORK_RANGE.network_address) + (job_id % JOB_NETWORK_BLOCKS) * JOB_NETWORK_HOSTS
    return tuple(str(ipaddress.IPv4Address(first + k)) for k in range(nodes))


def check_job_addresses(addresses: Sequence[str]) -> None:
    """Raises ProtocolError unless `addresses` are distinct IPv4 addresses of JOB_NETWORK_RANGE in
    one job's block (what job_part_addresses gives): a launcher routes them on its node as root,
    so an address outside the range (a node's, a service's) is never routed to a job."""
    parsed = []
    for index, text in enumerate(addresses):
        try:
            address = ipaddress.IPv4Address(text)
        except ValueError:
            raise ProtocolError(f"job_addresses.{index}", f"{text!r} is not an IPv4 address") from None
        if address not in JOB_NETWORK_RANGE:
            raise ProtocolError(f"job_addresses.{index}", f"{text} is outside the job range {JOB_NETWORK_RANGE}")
        parsed.append(int(address) - int(JOB_NETWORK_RANGE.network_address))
    if len(set(parsed)) != len(parsed):
        raise ProtocolError("job_addresses", "the addresses must be distinct")
    if parsed and len({offset // JOB_NETWORK_HOSTS for offset in parsed}) != 1:
        raise ProtocolError("job_addresses", f"the addresses must lie in one job's block of {JOB_NETWORK_HOSTS}")


# -- progress.json, the answer to "progress" --------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LastCheckpoint(Message):
    step: int = bounded(minimum=0)
    uri: str = bounded(max_length=MAX_PATH)
    engine: str = bounded(max_length=64)
    bytes: int = bounded(minimum=0)


@dataclass(frozen=True, kw_only=True)
class Progress(Message):
    """How a job is doing: its state, step and rate, engine, devices and rank processes."""

    ok: bool = True
    job_id: str = bounded(max_length=255)
    state: LaunchState
    engine: str | None = bounded(default=None, max_length=64)
    engine_reason: str | None = bounded(default=None, max_length=2000)
    step: int = bounded(minimum=0)
    steps_per_s: float | None = None
    world_size: int = bounded(minimum=1, maximum=MAX_RANKS)
    devices: int = bounded(minimum=1, maximum=MAX_DEVICES)
    device_map: DeviceMap
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)
    last_checkpoint: LastCheckpoint | None = None
    updated_unix: float
    rank_pids: tuple[int, ...] = bounded(default=(), max_length=MAX_RANKS)
    spool: str = bounded(max_length=MAX_PATH)


# -- the control socket ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ProgressRequest(Message):
    cmd: Literal["progress"] = "progress"


@dataclass(frozen=True, kw_only=True)
class CheckpointRequest(Message):
    """Checkpoint at a consistent cut (after step `at_step` at the earliest) and go on."""

    cmd: Literal["checkpoint"] = "checkpoint"
    at_step: int | None = bounded(default=None, minimum=0)
    timeout_s: float | None = bounded(default=None, minimum=0, maximum=MAX_TIMEOUT_S)  # None, 0: 600 s


@dataclass(frozen=True, kw_only=True)
class StopRequest(Message):
    """Checkpoint at a consistent cut, then the launcher exits 75."""

    cmd: Literal["stop"] = "stop"
    at_step: int | None = bounded(default=None, minimum=0)
    timeout_s: float | None = bounded(default=None, minimum=0, maximum=MAX_TIMEOUT_S)


@dataclass(frozen=True, kw_only=True)
class ResizeRequest(Message):
    """Map the W ranks onto `devices` devices at a cut; `device_indices`, when the agent knows them,
    are the node-local indices of those devices (recorded and passed to the ranks)."""

    cmd: Literal["resize"] = "resize"
    devices: int = bounded(minimum=1, maximum=MAX_DEVICES)
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)
    at_step: int | None = bounded(default=None, minimum=0)
    timeout_s: float | None = bounded(default=None, minimum=0, maximum=MAX_TIMEOUT_S)

    def __post_init__(self) -> None:
        check_device_indices(self.device_indices, self.devices)


ControlRequest = Union[ProgressRequest, CheckpointRequest, StopRequest, ResizeRequest]
REQUEST_TYPES: dict[str, type[Message]] = {
    "progress": ProgressRequest, "checkpoint": CheckpointRequest, "stop": StopRequest, "resize": ResizeRequest,
}


def control_request_from_dict(obj: Any) -> ControlRequest:
    """Returns the typed control request `obj` encodes; raises ProtocolError naming the bad field
    (an unknown command names "cmd" and lists the known ones)."""
    if not isinstance(obj, dict):
        raise ProtocolError("", "a control request must be a JSON object")
    cmd = obj.get("cmd")
    request_type = REQUEST_TYPES.get(cmd) if isinstance(cmd, str) else None
    if request_type is None:
        raise ProtocolError("cmd", f"unknown command {cmd!r}; use {', '.join(REQUEST_TYPES)}")
    return request_type.from_dict(obj)  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class ControlFailure(Message):
    """A command was refused or failed; `error` says why in words a person can act on."""

    ok: bool = False
    error: str = bounded(max_length=MAX_ERROR)


@dataclass(frozen=True, kw_only=True)
class CheckpointAnswer(Message):
    """The answer to checkpoint and stop: the checkpoint committed at the cut."""

    ok: bool = True
    step: int = bounded(minimum=0)
    engine: str = bounded(max_length=64)
    checkpoint: str = bounded(max_length=MAX_PATH)
    bytes: int = bounded(minimum=0)
    seconds: CheckpointSeconds


@dataclass(frozen=True, kw_only=True)
class ResizeAnswer(Message):
    ok: bool = True
    step: int = bounded(minimum=0)
    devices: int = bounded(minimum=1, maximum=MAX_DEVICES)
    device_map: DeviceMap
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)
    seconds: float = bounded(minimum=0)


ANSWER_TYPES: dict[str, type[Message]] = {
    "progress": Progress, "checkpoint": CheckpointAnswer, "stop": CheckpointAnswer, "resize": ResizeAnswer,
}


def control_answer_from_dict(cmd: str, obj: Any) -> Message:
    """Returns the typed answer to command `cmd` (a ControlFailure when ok is false)."""
    if isinstance(obj, dict) and obj.get("ok") is False:
        return ControlFailure.from_dict(obj)
    return ANSWER_TYPES[cmd].from_dict(obj)
