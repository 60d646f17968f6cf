"""CUDA state in the CRIU engine's checkpoints: NVIDIA's sequence around a dump, through the driver API.

UNPROVEN ON GPU: written on machines without one (CI and development); what runs there is the
bookkeeping below with no process holding a GPU (nothing is then called), and the pure parts
(`node_gpus`, `gpus_of_files`, `restore_pairs`). bench/gpu_checks.py's CRIU row is the prepared
proof (a single-process GPU job stopped, restored into a new process and PID namespace on the same
GPU, bit-exact against an uninterrupted run).

CRIU cannot dump device memory, nor the files of a process's GPU. The driver (>= 570) can move a
process's whole CUDA state into that process's own host memory and release the GPU
(runtime/cuda_checkpoint.py): after that CRIU dumps it as any process, the device state inside
its pages, and after a restore the driver moves it back. So, on the launcher (root, the ranks
parked at the cut, their NCCL communicators already torn down by the virtual group: NCCL state
cannot be checkpointed):

    dump      every process of every rank's tree that holds a GPU (a /dev/nvidia* file open):
              cuCheckpointProcessLock + cuCheckpointProcessCheckpoint, WHILE IT RUNS (the
              driver's own thread in the process does the work: before the ranks are stopped
              for CRIU); then CRIU dumps; then, for a checkpoint the job goes on from (or a dump
              that failed), Restore + Unlock of the same processes, on the GPUs they had.
              Each rank's image folder gets CUDA_FILE: which of its processes (by their pid in
              the rank's own PID namespace, which CRIU restores) held which GPUs (UUIDs).
    restore   after CRIU restored the ranks, checked them and let them run, before the resume
              file lets them go on: Restore + Unlock of each such process; onto the GPU its rank
              is given now, through a GPU map (old UUID -> new UUID, driver >= 580), where that
              differs from the one it held.

What is refused, with the reason, the job going on (a cut) or not restored (a resume): no usable
driver API (no driver, or older than 570); a MIG instance (the driver cannot checkpoint one); a
rank with more than one process holding a GPU (one process per rank is what this engine restores
and checks; DataLoader workers that use CUDA need driver 590's multi-process support, not used);
a restore onto another GPU by a driver older than 580, or of a process that held several GPUs (a
spliced or unspliced rank computes on one: the map of the others is unknown). Whatever the driver
itself refuses (UVM memory, CUDA IPC before 610, NVLS) comes back as its CUresult's name.

GPU identity: /proc/driver/nvidia/gpus/<PCI bus id>/information gives each GPU's device minor (the
N of /dev/nvidiaN) and UUID. The agent numbers a node's GPUs as NVML does, in PCI bus order, and
the ranks see them in that order too (CUDA_DEVICE_ORDER=PCI_BUS_ID: runtime/sandbox.py), so the
index of a GPU is its position in `node_gpus()`.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime import criu, splice
from runtime.cuda_checkpoint import (
    REMAP_DRIVER_VERSION,
    CudaCheckpointError,
    CudaCheckpointUnavailable,
    CudaProcessCheckpoint,
    load_driver,
)

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
CUDA_FILE = "cuda.json"  # in a rank's image folder: its processes that held GPUs
_GPU_FILE = re.compile(r"^/dev/nvidia(\d+)$")
MIG_FILES = "/dev/nvidia-caps"  # a MIG instance is reached through its capability files


class CudaRefusal(RuntimeError):
    """The CUDA state of a rank cannot be checkpointed or restored here; the message says why."""


@dataclass(frozen=True)
class Gpu:
    """One GPU of this node: its index (PCI bus order, as NVML and the agent number them), the N
    of /dev/nvidiaN, its UUID and PCI bus id."""

    index: int
    minor: int
    uuid: str
    bus_id: str


def node_gpus(root: str | None = None) -> list[Gpu]:
    """Returns this node's GPUs in PCI bus order (empty without an NVIDIA driver), from the driver's
    listing `root` (NVIDIA_GPUS)."""
    root = root or NVIDIA_GPUS
    found = []
    try:
        buses = sorted(os.listdir(root), key=str.lower)
    except OSError:
        return []
    for bus in buses:
        try:
            with open(os.path.join(root, bus, "information")) as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
            minor = int(fields["Device Minor"].strip())
            uuid = fields["GPU UUID"].strip()
        except (OSError, KeyError, ValueError):
            continue  # a GPU the driver lists without those lines cannot be named: not ours to use
        found.append((bus, minor, uuid))
    return [Gpu(index=i, minor=minor, uuid=uuid, bus_id=bus) for i, (bus, minor, uuid) in enumerate(found)]


def open_device_files(pid: int | str) -> list[str]:
    """Returns the NVIDIA device files (/dev/nvidia*) process `pid` has open ("self": this one)."""
    fd_dir = f"/proc/{pid}/fd"
    found: list[str] = []
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue  # closed meanwhile (the listing's own fd among them)
        if target.startswith("/dev/nvidia"):
            found.append(target)
    return found


def gpus_of_files(files: list[str], gpus: list[Gpu]) -> list[str]:
    """Returns the UUIDs of the GPUs whose /dev/nvidiaN is among `files`, in index order; raises
    CudaRefusal for a MIG instance's files or a GPU file this node's driver does not list."""
    if any(name.startswith(MIG_FILES) for name in files):
        raise CudaRefusal("it uses a MIG instance, which the CUDA driver cannot checkpoint")
    by_minor = {gpu.minor: gpu for gpu in gpus}
    held = []
    for name in sorted(set(files)):
        match = _GPU_FILE.match(name)
        if match is None:
            continue  # nvidiactl, nvidia-uvm: the driver's, not a GPU's
        gpu = by_minor.get(int(match.group(1)))
        if gpu is None:
            raise CudaRefusal(f"it holds {name}, a GPU the driver does not list in {NVIDIA_GPUS}")
        held.append(gpu)
    return [gpu.uuid for gpu in sorted(held, key=lambda g: g.index)]


def restore_pairs(held: list[str], now: str | None, *, driver_version: int) -> list[tuple[str, str]]:
    """Returns the GPU map of a process that held GPUs `held` (UUIDs) and whose rank is given GPU
    `now` (None: not known, a launcher started by hand: it comes back on the GPUs it held): none
    where nothing moves, else the one pair old -> new. Raises CudaRefusal what the driver or this
    engine cannot do."""
    if now is None or not held or held == [now]:
        return []
    if len(held) > 1:
        raise CudaRefusal(f"it held {len(held)} GPUs ({', '.join(held)}) and its rank is given {now} now; "
                          "this engine maps a process that computed on one GPU only")
    if driver_version < REMAP_DRIVER_VERSION:
        raise CudaRefusal(f"it was dumped on {held[0]} and its rank is given {now} now, and this driver "
                          f"(API {driver_version}) restores CUDA state only onto the GPU it left: a driver "
                          f">= 580 ({REMAP_DRIVER_VERSION}) maps it onto another of the same model")
    return [(held[0], now)]


# -- dump ---------------------------------------------------------------------------------------------
@dataclass
class CudaCut:
    """The CUDA state of a host's ranks moved into their host memory for one dump: which processes
    (host pid -> GPUs held), per rank, and how long the move took (`out_s`) and the move back
    (`in_s`, None until `release`)."""

    held: dict[int, dict[int, list[str]]] = field(default_factory=dict)  # rank -> {host pid: [UUID]}
    namespace_pids: dict[int, int] = field(default_factory=dict)
    out_s: float = 0.0
    in_s: float | None = None
    _lib: object = None

    @property
    def empty(self) -> bool:
        return not self.held

    @property
    def driver_version(self) -> int:
        """The driver API version of the loaded driver (0 before it is loaded: an empty cut)."""
        return getattr(self._lib, "driver_api_version", 0)

    def record(self, rank: int, image_dir: os.PathLike | str) -> None:
        """Writes CUDA_FILE into rank `rank`'s image folder (nothing for a rank without CUDA state)."""
        processes = self.held.get(rank)
        if not processes:
            return
        document = {"driver_api_version": self.driver_version,
                    "processes": [{"pid": self.namespace_pids[pid], "gpus": gpus} for pid, gpus in processes.items()]}
        with open(os.path.join(image_dir, CUDA_FILE), "w") as handle:
            json.dump(document, handle)

    def release(self) -> list[str]:
        """Moves every checkpointed process's state back onto the GPUs it had and unlocks it (a
        checkpoint the job goes on from, a dump that failed); returns the driver's errors. A process
        gone (a stop's, which criu killed once dumped) is skipped."""
        problems = []
        began = time.monotonic()
        for processes in self.held.values():
            for pid in processes:
                if not os.path.exists(f"/proc/{pid}"):
                    continue
                try:
                    CudaProcessCheckpoint(pid, lib=self._lib).settle()
                except CudaCheckpointError as exc:
                    problems.append(str(exc))
        self.in_s = time.monotonic() - began
        return problems


def checkpoint_ranks(ranks, *, lock_timeout_ms: int = 60_000, gpus_root: str | None = None) -> CudaCut:
    """Moves the CUDA state of every process of `ranks` (RankProcess, parked at the cut, RUNNING)
    that holds a GPU into its host memory; returns the CudaCut (empty, and nothing loaded, when no
    process holds one: a CPU job). Raises CudaRefusal, every process it moved put back first."""
    cut = CudaCut()
    gpus = None
    for process in ranks:
        for pid in criu.restored_tasks(process.pid):
            files = open_device_files(pid)
            if not files:
                continue
            if gpus is None:
                gpus = node_gpus(gpus_root)
            where = f"rank {process.rank} (process {pid})"
            try:
                held = gpus_of_files(files, gpus)
            except CudaRefusal as exc:
                raise CudaRefusal(f"{where}: {exc}") from None
            if cut.held.get(process.rank):
                raise CudaRefusal(f"{where} is the second process of rank {process.rank} holding a GPU; "
                                  "this engine checkpoints one per rank (a DataLoader worker using CUDA?)")
            cut.held.setdefault(process.rank, {})[pid] = held
            cut.namespace_pids[pid] = splice.innermost_pid(f"/proc/{pid}")
    if cut.empty:
        return cut
    try:
        cut._lib = load_driver()
    except CudaCheckpointUnavailable as exc:
        raise CudaRefusal(f"ranks {sorted(cut.held)} hold CUDA state, and {exc}") from None
    began = time.monotonic()
    try:
        for processes in cut.held.values():
            for pid in processes:
                CudaProcessCheckpoint(pid, lock_timeout_ms=lock_timeout_ms, lib=cut._lib).swap_out()
    except CudaCheckpointError as exc:
        # Every process back to running, the one that failed too (it may be left locked: its next
        # CUDA call would wait for ever), and those not reached yet (settle leaves them be).
        problems = cut.release()
        undone = f"; and putting them back failed: {'; '.join(problems)}" if problems else ""
        raise CudaRefusal(f"the CUDA driver could not checkpoint a rank: {exc}{undone}") from None
    cut.out_s = time.monotonic() - began
    return cut


# -- restore ------------------------------------------------------------------------------------------
def restore_rank(rank: int, root_pid: int, image_dir: Path, *, gpu_now: str | None) -> float:
    """Moves the CUDA state of restored rank `rank` (its tree under host pid `root_pid`, running)
    back onto GPU `gpu_now` (UUID; None: the GPUs it held) and unlocks it, as its images'
    CUDA_FILE says; returns the seconds it took (0.0 for a rank without one). Raises CudaRefusal."""
    path = Path(image_dir) / CUDA_FILE
    if not path.exists():
        return 0.0
    try:
        document = json.loads(path.read_text())
        processes = [(int(p["pid"]), [str(u) for u in p["gpus"]]) for p in document["processes"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CudaRefusal(f"rank {rank}'s {CUDA_FILE} cannot be read: {exc}") from None
    try:
        lib = load_driver()
    except CudaCheckpointUnavailable as exc:
        raise CudaRefusal(f"rank {rank} was dumped with CUDA state, and {exc}") from None
    by_namespace_pid = {splice.innermost_pid(f"/proc/{pid}"): pid for pid in criu.restored_tasks(root_pid)}
    began = time.monotonic()
    for inner, held in processes:
        pid = by_namespace_pid.get(inner)
        if pid is None:
            raise CudaRefusal(f"rank {rank}'s process {inner} (in its PID namespace), which held CUDA "
                              "state, was not restored")
        try:
            pairs = restore_pairs(held, gpu_now, driver_version=getattr(lib, "driver_api_version", 0))
        except CudaRefusal as exc:
            raise CudaRefusal(f"rank {rank} (process {inner}): {exc}") from None
        try:
            CudaProcessCheckpoint(pid, lib=lib).swap_in(pairs)
        except (CudaCheckpointError, ValueError) as exc:  # ValueError: a UUID the images hold is none
            raise CudaRefusal(f"the CUDA driver could not restore rank {rank}: {exc}") from None
    return time.monotonic() - began
