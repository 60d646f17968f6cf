"""The CUDA driver checkpoint API: move a process's GPU memory to host memory and back.

Replica splicing on GPUs: a rank waiting for its device token can have its device memory
swapped out to the host, so ranks sharing one GPU can each use most of its memory. The driver
(>= 570, CUDA 12.8 driver API) offers, per process:

    cuCheckpointProcessLock(pid, args)        stop new CUDA work, wait for in-flight work
    cuCheckpointProcessCheckpoint(pid, args)  copy device memory to host, release the device
    cuCheckpointProcessRestore(pid, args)     reacquire the device, copy memory back (same
                                              addresses, same GPU)
    cuCheckpointProcessUnlock(pid, args)      let the process submit CUDA work again
    cuCheckpointProcessGetState(pid, &state)  RUNNING, LOCKED, CHECKPOINTED or FAILED

Called through ctypes on libcuda.so.1 (no CUDA toolkit needed). Where there is no NVIDIA driver
(this project's CI and its development machines) or the driver is too old, every entry point
raises CudaCheckpointUnavailable with the reason; nothing is emulated.
"""
import ctypes
import ctypes.util

MIN_DRIVER_VERSION = 12080  # cuDriverGetVersion of driver 570 (CUDA 12.8)
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class CudaCheckpointUnavailable(RuntimeError):
    """The CUDA checkpoint API cannot be used on this machine; the message says why."""


class CudaCheckpointError(RuntimeError):
    """A cuCheckpointProcess* call returned an error code."""


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class _Args(ctypes.Structure):  # checkpoint / restore / unlock argument blocks: reserved only
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


def load_driver():
    """Returns the libcuda handle after checking the driver version and the API's presence."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise CudaCheckpointUnavailable(
            f"no NVIDIA driver here (cannot load {name}: {exc}); the CUDA checkpoint API needs "
            f"an NVIDIA GPU with driver >= 570") from None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        raise CudaCheckpointUnavailable("cuDriverGetVersion failed: the NVIDIA driver is unusable")
    if version.value < MIN_DRIVER_VERSION:
        raise CudaCheckpointUnavailable(
            f"driver API version {version.value} is too old: the CUDA checkpoint API needs "
            f"driver >= 570 ({MIN_DRIVER_VERSION})")
    for symbol in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                   "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                   "cuCheckpointProcessGetState"):
        if not hasattr(lib, symbol):
            raise CudaCheckpointUnavailable(f"libcuda has no {symbol}: driver too old")
    if lib.cuInit(0) != 0:
        raise CudaCheckpointUnavailable("cuInit failed: no usable CUDA device")
    return lib


class CudaProcessCheckpoint:
    """Swaps one process's device memory out to the host (`swap_out`) and back (`swap_in`)."""

    def __init__(self, pid, *, lock_timeout_ms=60_000):
        self.pid = int(pid)
        self.lock_timeout_ms = lock_timeout_ms
        self._lib = load_driver()

    def _call(self, name, *args):
        code = getattr(self._lib, name)(*args)
        if code != 0:
            raise CudaCheckpointError(f"{name}(pid {self.pid}) returned CUresult {code}")

    def state(self):
        value = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", ctypes.c_int(self.pid), ctypes.byref(value))
        return STATES.get(value.value, f"unknown({value.value})")

    def swap_out(self):
        """Locks the process (waits for in-flight work), then moves its memory to the host."""
        lock = _LockArgs(timeoutMs=self.lock_timeout_ms)
        self._call("cuCheckpointProcessLock", ctypes.c_int(self.pid), ctypes.byref(lock))
        self._call("cuCheckpointProcessCheckpoint", ctypes.c_int(self.pid), ctypes.byref(_Args()))

    def swap_in(self):
        """Moves the memory back to the same device addresses and lets the process run."""
        self._call("cuCheckpointProcessRestore", ctypes.c_int(self.pid), ctypes.byref(_Args()))
        self._call("cuCheckpointProcessUnlock", ctypes.c_int(self.pid), ctypes.byref(_Args()))
