"""Replica splicing: W rank processes on d devices, taking turns through a per-device token.

A job's world size W never changes; resizing changes how many devices its W rank processes
are mapped to (d divides W). On CPU a device is a set of cores (sched_setaffinity); on a GPU it
is a CUDA device (see runtime/cuda_checkpoint.py for swapping a waiting rank's memory out).

Ranks mapped to one device take turns at collective boundaries: a rank holds its device's
token (an exclusive flock on ``<spool>/devices/dev<k>.lock``) while it computes, releases it
when it enters a collective (it would only wait for the others there) and takes it back when
the collective returns. Results do not depend on the layout because the virtual group reduces
in rank order and every rank runs with one intra-op thread (rank.py fixes it).
"""
import fcntl
import os
import pathlib
from collections.abc import Iterable, Sequence

from protocol.layout import layout_check, rank_devices
from runtime import spool as spool_files


def host_devices(*, world_size: int, devices: int, ranks: range) -> range:
    """Returns the job-wide numbers of the devices that run the block of ranks `ranks` when W ranks
    lie on `devices` devices (W/d contiguous ranks each): a host's devices, for its block.

    Raises protocol.layout.LayoutError (a ValueError) when devices does not divide world_size, and
    ValueError when the block does not start and end at a device's edge (its devices would also
    run another host's ranks: a share must be whole devices)."""
    layout_check(world_size, devices)
    per_device = world_size // devices
    if ranks.start % per_device or len(ranks) % per_device or len(ranks) < 1:
        raise ValueError(f"ranks {ranks.start}..{ranks.stop - 1} are not whole devices: W = {world_size} ranks on "
                         f"{devices} devices run {per_device} per device, so a host's block must start at a "
                         f"multiple of {per_device} and hold a multiple of {per_device} ranks")
    return range(ranks.start // per_device, ranks.stop // per_device)


def device_map(*, world_size: int, devices: int, cores: Iterable[int] | None = None,
               device_cores: Sequence[Sequence[int]] | None = None,
               ranks: range | None = None) -> dict[str, dict]:
    """Returns the rank -> device and device -> cores map for W ranks on `devices` devices.

    Ranks are split into contiguous blocks (W=4 on 2 devices: ranks 0,1 on device 0). With
    `device_cores` (the cores behind each of the job's node-local devices, in order: what the
    node's agent gave the job, runtime/sandbox.py `device_cores`) each device gets exactly its own,
    so two jobs on one node never share a core they were not both given. Without it (a launcher
    started by hand), `cores` (default: this process's affinity) are split evenly when there are
    at least as many cores as devices, else devices share cores round-robin. Raises
    protocol.layout.LayoutError (a ValueError) when devices does not divide world_size, and
    ValueError when `device_cores` does not list one core set per device.

    A job over several hosts (one launcher each): the map of a host lists only its devices and its
    block of ranks `ranks` (runtime/multihost.host_block; None: all W, one host), under their
    job-wide numbers. The block lies on the devices `host_devices` gives (W/d ranks on each, so
    hosts holding unequal device counts run blocks of unequal length), and `device_cores` /
    `cores` are that host's: one core set per device of the block, in order. So each host's ranks
    are pinned to the cores behind exactly the devices the control plane gave that host, never to
    another host's numbering.
    """
    mine = host_devices(world_size=world_size, devices=devices,
                        ranks=ranks if ranks is not None else range(world_size))
    first, count = mine.start, len(mine)
    if device_cores is not None:
        if len(device_cores) != count or not all(device_cores):
            raise ValueError(f"{len(device_cores)} core set(s) {list(device_cores)} for {count} device(s)"
                             + (f" on this host (of {devices} in all)" if count < devices else ""))
        device_core_map = {first + k: sorted(int(c) for c in device_cores[k]) for k in range(count)}
    else:
        core_list = sorted(cores if cores is not None else os.sched_getaffinity(0))
        if count <= len(core_list):
            per_device = len(core_list) // count
            device_core_map = {first + k: core_list[k * per_device:(k + 1) * per_device] for k in range(count)}
        else:
            device_core_map = {first + k: [core_list[k % len(core_list)]] for k in range(count)}
    return {
        "devices": {str(k): v for k, v in device_core_map.items()},
        "ranks": {str(r): k for r, k in enumerate(rank_devices(world_size, devices)) if k in device_core_map},
    }


def device_ordinal(mapping, rank: int) -> int:
    """Returns the position of `rank`'s device among the devices of a host's map (a DeviceMap: the
    host's devices under their job-wide numbers, in the order of its device indices). On a GPU node
    that is the rank's CUDA device index, CUDA_VISIBLE_DEVICES listing the job's GPUs in that order."""
    numbers = sorted(int(number) for number in mapping.devices)
    return numbers.index(int(mapping.ranks[str(rank)]))


def innermost_pid(task_dir):
    """Returns the id of the process or thread at `task_dir` (/proc/<pid>, /proc/<pid>/task/<tid>)
    in its innermost PID namespace.

    /proc may be the host's procfs while a rank runs in its own PID namespace (CRIU engine): its
    task list then shows host tids, but sched_setaffinity in the rank wants namespace-local ones;
    and the launcher names a rank's processes as CRIU keeps them (runtime/criu_cuda.py). The last
    NSpid field is the id in the innermost namespace.
    """
    with open(os.path.join(task_dir, "status")) as handle:
        for line in handle:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return int(os.path.basename(task_dir))


def pin_process_threads(cores):
    """Sets the CPU affinity of every thread of this process (os.sched_setaffinity on a pid
    only moves that one thread, and torch and gloo run threads of their own)."""
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(innermost_pid(f"/proc/self/task/{name}"), cores)
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass


class DeviceSlot:
    """This rank's place on a device: its pinning and its turn-taking token."""

    def __init__(self, *, spool, rank):
        self.spool = pathlib.Path(spool)
        self.rank = rank
        self.device = None
        self.cores = None
        self._lock_fd = None
        self._held = False
        self._shared = False

    def apply(self, mapping):
        """Moves this rank to the device `mapping` gives it (re-pins, switches token).

        Called at start and at a consistent cut, with the token not held."""
        if self._held:
            raise RuntimeError("DeviceSlot.apply called while holding the device token")
        device = int(mapping["ranks"][str(self.rank)])
        cores = [int(c) for c in mapping["devices"][str(device)]]
        pin_process_threads(cores)
        if device != self.device:
            self.close()
            lock_dir = self.spool / "devices"
            lock_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(lock_dir / f"dev{device}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        self.device = device
        self.cores = cores
        self._shared = sum(1 for d in mapping["ranks"].values() if int(d) == device) > 1

    def acquire(self):
        if self._lock_fd is not None and not self._held:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self._held = True

    def release(self):
        if self._held:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            self._held = False

    def close(self):
        """Releases the token and closes the lock file (CRIU then has no lock to dump)."""
        self.release()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
            self.device = None

    # vpg.CollectiveHooks interface: give the device away while waiting in a collective.
    def shares_device(self):
        return self._shared and self._lock_fd is not None

    def before_collective(self):
        self.release()

    def after_collective(self):
        self.acquire()


def read_device_map(spool):
    return spool_files.read_json(pathlib.Path(spool) / "devices.json")
