"""Launcher <-> ranks: the files of a job's spool through which a consistent cut is asked and answered.

    devices.json           launcher -> ranks   DeviceMap: rank -> device, device -> cores
    request.json           launcher -> ranks   CutRequest: the pending cut (one at a time)
    rank<r>/cut-<id>.json  rank -> launcher    CutReport: "rank r stopped after step s" (+ status)
    resume-<id>.json       launcher -> ranks   ResumeFile: parked (CRIU) ranks go on, here
    progress.json          rank 0 -> launcher  RankProgress: step and steps/s, every ~0.5 s

Why files: a rank that CRIU dumps must hold no socket (runtime/spool.py says more). The spool is
node-local, but a restored rank reads what a newer launcher wrote, so these are versioned too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from protocol.message import Message, ProtocolError, bounded

MAX_RANKS = 65536
MAX_DEVICES = 4096
MAX_PATH = 4096
MAX_GPU_UUID = 64  # "GPU-" and 36 characters; room for what a driver may add
MAX_SECONDS = 7 * 24 * 3600.0  # one stage of a checkpoint (protocol.launch.CheckpointSeconds too)
MAX_BYTES = 2**62

CutAction = Literal["checkpoint", "stop", "resize"]
CutStatus = Literal["parked", "saved", "resized", "error"]


@dataclass(frozen=True)
class DeviceMap(Message):
    """Where a job's W ranks run (runtime/splice.device_map): keys are decimal strings, as JSON wants."""

    devices: dict[str, tuple[int, ...]] = bounded(max_length=MAX_DEVICES)  # device -> its cores
    ranks: dict[str, int] = bounded(max_length=MAX_RANKS)  # rank -> its device

    def __post_init__(self) -> None:
        for rank, device in self.ranks.items():
            if str(device) not in self.devices:
                raise ProtocolError(f"ranks.{rank}", f"names device {device}, which the map does not list")

    def plain(self) -> dict[str, Any]:
        """Returns the map as splice.DeviceSlot.apply reads it (the wire dict without its version)."""
        return {"devices": {key: list(cores) for key, cores in self.devices.items()}, "ranks": dict(self.ranks)}


def check_device_indices(indices: tuple[int, ...] | None, devices: int, *, field: str = "device_indices") -> None:
    """Raises ProtocolError unless `indices` (node-local device indices, when given) names `devices`
    distinct devices, each once."""
    if indices is None:
        return
    if len(indices) != devices:
        raise ProtocolError(field, f"lists {len(indices)} device(s) but the job is given {devices}")
    if any(index < 0 for index in indices):
        raise ProtocolError(field, f"must be non-negative device indices, not {list(indices)}")
    if len(set(indices)) != len(indices):
        raise ProtocolError(field, f"names a device twice: {list(indices)}")


@dataclass(frozen=True, kw_only=True)
class CutRequest(Message):
    """request.json: every rank cuts after the same step (`at_step` at the earliest) and reports.

    `id` grows across launchers (milliseconds since the epoch), so a restored rank, which remembers
    the last id it handled, never takes a new request for an old one."""

    id: int = bounded(minimum=1)
    action: CutAction
    at_step: int | None = bounded(default=None, minimum=0)
    staging_dir: str | None = bounded(default=None, max_length=MAX_PATH)  # checkpoint, stop: ranks save here
    devices: DeviceMap | None = None  # resize: the new map
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)  # resize, when known

    def __post_init__(self) -> None:
        if self.action == "resize" and self.devices is None:
            raise ProtocolError("devices", "a resize cut needs the new device map")
        if self.action != "resize" and self.staging_dir is None:
            raise ProtocolError("staging_dir", f"a {self.action} cut needs the folder the ranks save into")
        if self.devices is not None and self.device_indices is not None:
            check_device_indices(self.device_indices, len(self.devices.devices))


@dataclass(frozen=True, kw_only=True)
class CutReport(Message):
    """rank<r>/cut-<id>.json: this rank stopped after `step` for the request and is `status`."""

    rank: int = bounded(minimum=0, maximum=MAX_RANKS - 1)
    step: int = bounded(minimum=0)
    status: CutStatus
    error: str | None = bounded(default=None, max_length=20000)  # status "error": why, in words
    open_sockets: tuple[str, ...] = bounded(default=(), max_length=1024)  # CRIU: what a dump would refuse
    device: int | None = bounded(default=None, minimum=0)  # status "resized": where it runs now
    cores: tuple[int, ...] | None = bounded(default=None, max_length=4096)
    # optimizer-step / collective-boundary / any-moment (runtime/cut.py): where the rank was cut
    cut_kind: str | None = bounded(default=None, max_length=64)
    # status "saved" (framework engine): how long the rank's write took (device -> host -> staging
    # file) and how many bytes of its state were on a device other than the CPU
    save_s: float | None = bounded(default=None, minimum=0, maximum=MAX_SECONDS)
    device_bytes: int | None = bounded(default=None, minimum=0, maximum=MAX_BYTES)

    def problem(self) -> str:
        """Returns why this report refuses the cut, in words (for the launcher's error)."""
        if self.error:
            return self.error
        if self.open_sockets:
            return f"open sockets or shared mappings at the cut: {', '.join(self.open_sockets)}"
        return f"status {self.status}"


@dataclass(frozen=True, kw_only=True)
class StateLoaded(Message):
    """rank<r>/loaded.json: a framework-resumed rank put its checkpoint back (once per launch).
    `load_s`: the checkpoint file read into host memory and its sha256 checked (store -> host);
    `apply_s`: the state loaded into the script's live objects when its first epoch began (host ->
    device for a GPU job); `device_bytes`: how many of those bytes went to a device other than the CPU."""

    rank: int = bounded(minimum=0, maximum=MAX_RANKS - 1)
    step: int = bounded(minimum=0)
    load_s: float = bounded(minimum=0, maximum=MAX_SECONDS)
    apply_s: float = bounded(minimum=0, maximum=MAX_SECONDS)
    device_bytes: int = bounded(minimum=0, maximum=MAX_BYTES)


@dataclass(frozen=True, kw_only=True)
class ResumeFile(Message):
    """resume-<id>.json: ranks parked at cut <id> rebuild their inner group here and go on."""

    master_addr: str = bounded(max_length=255)
    master_port: int = bounded(minimum=1, maximum=65535)
    key_prefix: str = bounded(max_length=255)  # the rendezvous keys' prefix: nonce/request id
    devices: DeviceMap
    device_indices: tuple[int, ...] | None = bounded(default=None, max_length=MAX_DEVICES)
    # The address of the host the rank now runs on, which its gloo group binds to: a CRIU-restored
    # rank of a job spanning hosts may be on another host than the one it was dumped on. None:
    # the one it has (MERIDIAN_NODE_ADDR).
    node_addr: str | None = bounded(default=None, max_length=255)
    # The job's hosts now and this rank's host among them: a CRIU-restored rank may have been dumped
    # with another number of hosts (runtime/criu_parts.py); it sets LOCAL_RANK, LOCAL_WORLD_SIZE,
    # NODE_RANK and GROUP_RANK from them. None: the layout it has.
    nodes: int | None = bounded(default=None, minimum=1, maximum=MAX_RANKS)
    node_rank: int | None = bounded(default=None, minimum=0, maximum=MAX_RANKS)
    # This host's block of ranks now, [first_rank, first_rank + host_ranks): hosts holding unequal
    # device counts run unequal blocks (runtime/multihost.host_block), so LOCAL_RANK and
    # LOCAL_WORLD_SIZE come from it. None (a launcher before blocks were told): the equal W/N block.
    first_rank: int | None = bounded(default=None, minimum=0, maximum=MAX_RANKS - 1)
    host_ranks: int | None = bounded(default=None, minimum=1, maximum=MAX_RANKS)
    # A GPU job's: the UUIDs of its GPUs on this host, in the order of device_indices. A rank learns
    # its GPU's from it (the fold's key: runtime/cudagroup.device_key), which a CRIU restore may have
    # changed under the CUDA device number the rank keeps. None: not a GPU job under an agent.
    gpu_uuids: tuple[str, ...] | None = bounded(default=None, max_length=MAX_DEVICES)

    def __post_init__(self) -> None:
        check_device_indices(self.device_indices, len(self.devices.devices))
        if self.gpu_uuids is not None and (
                self.device_indices is None or len(self.gpu_uuids) != len(self.device_indices)
                or any(not 0 < len(uuid) <= MAX_GPU_UUID for uuid in self.gpu_uuids)):
            raise ProtocolError("gpu_uuids", f"{len(self.gpu_uuids)} GPU UUIDs (each 1-{MAX_GPU_UUID} "
                                "characters) must name the GPUs of device_indices, one each")
        if (self.nodes is None) != (self.node_rank is None) or (self.node_rank or 0) >= (self.nodes or 1):
            raise ProtocolError("node_rank", f"{self.node_rank} is not a host of {self.nodes}")
        if self.first_rank is None and self.host_ranks is None:
            return
        if self.first_rank is None or self.host_ranks is None or self.nodes is None or (
                self.first_rank + self.host_ranks > MAX_RANKS):
            raise ProtocolError("first_rank", f"a block of {self.host_ranks} ranks from {self.first_rank} "
                                "needs both numbers and the host layout (nodes, node_rank), within the ranks")


@dataclass(frozen=True, kw_only=True)
class RankProgress(Message):
    """The spool's progress.json, written by rank 0: how far the job is."""

    step: int = bounded(minimum=0)
    steps_per_s: float | None = None
    engine: str = bounded(max_length=64)
    world_size: int = bounded(minimum=1, maximum=MAX_RANKS)
    updated_unix: float
