"""The CUDA driver checkpoint API: move a process's GPU memory to host memory and back.

Replica splicing on GPUs: a rank waiting for its device token can have its device memory
swapped out to the host, so ranks sharing one GPU can each use most of its memory. The driver
(>= 570, CUDA 12.8 driver API) offers, per process:

    cuCheckpointProcessLock(pid, args)        stop new CUDA work, wait for in-flight work
    cuCheckpointProcessCheckpoint(pid, args)  copy device memory to host, release the device
    cuCheckpointProcessRestore(pid, args)     reacquire the device, copy memory back (same
                                              addresses; the same GPU, or with a GPU map from
                                              driver 580 (API 13000) another of the same model)
    cuCheckpointProcessUnlock(pid, args)      let the process submit CUDA work again
    cuCheckpointProcessGetState(pid, &state)  RUNNING, LOCKED, CHECKPOINTED or FAILED

Called through ctypes on libcuda.so.1 (no CUDA toolkit needed). Where there is no NVIDIA driver
(this project's CI and its development machines) or the driver is too old, every entry point
raises CudaCheckpointUnavailable with the reason; nothing is emulated.

Two users: splicing's swap (above), and the CRIU engine, which checkpoints a parked rank's CUDA
state into its host memory before CRIU dumps it and restores it after (runtime/criu_cuda.py).
"""
import ctypes
import ctypes.util

MIN_DRIVER_VERSION = 12080  # cuDriverGetVersion of driver 570 (CUDA 12.8)
REMAP_DRIVER_VERSION = 13000  # driver 580 (CUDA 13.0): cuCheckpointProcessRestore takes a GPU map
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class CudaCheckpointUnavailable(RuntimeError):
    """The CUDA checkpoint API cannot be used on this machine; the message says why."""


class CudaCheckpointError(RuntimeError):
    """A cuCheckpointProcess* call returned an error code."""


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class _Args(ctypes.Structure):  # checkpoint / unlock argument blocks: reserved only
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _Uuid(ctypes.Structure):  # CUuuid (raw bytes: a c_char array would stop at the first zero byte)
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _GpuPair(ctypes.Structure):  # CUcheckpointGpuPair
    _fields_ = [("oldUuid", _Uuid), ("newUuid", _Uuid)]


class _RestoreArgs(ctypes.Structure):  # CUcheckpointRestoreArgs (64 bytes, as the checkpoint and unlock blocks)
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
                ("reserved1", ctypes.c_uint64)]


def uuid_bytes(uuid: str) -> bytes:
    """Returns the 16 bytes of a GPU UUID as NVIDIA writes it ("GPU-" and 32 hex digits in 8-4-4-4-12
    groups); raises ValueError for anything else (a MIG instance's "MIG-..." included)."""
    text = uuid.strip()
    if not text.startswith("GPU-"):
        raise ValueError(f"{uuid!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    digits = text[4:].replace("-", "")
    if len(digits) != 32:
        raise ValueError(f"{uuid!r} is not a GPU UUID (32 hex digits after GPU-)")
    return bytes.fromhex(digits)


def restore_args(pairs: list[tuple[str, str]]) -> _RestoreArgs:
    """Returns the restore argument block for GPU map `pairs` ((old UUID, new UUID) each; none: the
    process comes back on the GPUs it had). Keeps the array alive on the block (`_pairs`)."""
    args = _RestoreArgs()
    if pairs:
        array = (_GpuPair * len(pairs))()
        for slot, (old, new) in zip(array, pairs):
            slot.oldUuid.bytes[:] = list(uuid_bytes(old))
            slot.newUuid.bytes[:] = list(uuid_bytes(new))
        args.gpuPairs = ctypes.cast(array, ctypes.POINTER(_GpuPair))
        args.gpuPairsCount = len(pairs)
        args._pairs = array  # owned by the block while the call runs
    return args


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
    lib.driver_api_version = version.value  # what the GPU map and other features depend on
    return lib


def error_name(lib, code: int) -> str:
    """Returns the name of CUresult `code` ("CUDA_ERROR_NOT_SUPPORTED"), or its number."""
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(ctypes.c_int(code), ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode()} ({code})"
    return f"CUresult {code}"


class CudaProcessCheckpoint:
    """Swaps one process's device memory out to the host (`swap_out`) and back (`swap_in`)."""

    def __init__(self, pid, *, lock_timeout_ms=60_000, lib=None):
        self.pid = int(pid)
        self.lock_timeout_ms = lock_timeout_ms
        self._lib = lib if lib is not None else load_driver()

    def _call(self, name, *args):
        code = getattr(self._lib, name)(*args)
        if code != 0:
            raise CudaCheckpointError(f"{name}(pid {self.pid}) returned {error_name(self._lib, code)}")

    def state(self):
        value = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", ctypes.c_int(self.pid), ctypes.byref(value))
        return STATES.get(value.value, f"unknown({value.value})")

    def swap_out(self):
        """Locks the process (waits for in-flight work), then moves its memory to the host."""
        lock = _LockArgs(timeoutMs=self.lock_timeout_ms)
        self._call("cuCheckpointProcessLock", ctypes.c_int(self.pid), ctypes.byref(lock))
        self._call("cuCheckpointProcessCheckpoint", ctypes.c_int(self.pid), ctypes.byref(_Args()))

    def settle(self):
        """Lets the process run again on the GPUs it had, whatever step a swap_out reached (locked,
        or checkpointed); does nothing to a running one. For a swap_out that failed half-way."""
        state = self.state()
        if state == "checkpointed":
            self.swap_in()
        elif state == "locked":
            self._call("cuCheckpointProcessUnlock", ctypes.c_int(self.pid), ctypes.byref(_Args()))

    def swap_in(self, pairs: list[tuple[str, str]] | None = None):
        """Moves the memory back to the same device addresses and lets the process run: onto the
        GPUs it had, or through `pairs` (old UUID, new UUID) onto others (driver >= 580)."""
        self._call("cuCheckpointProcessRestore", ctypes.c_int(self.pid), ctypes.byref(restore_args(pairs or [])))
        self._call("cuCheckpointProcessUnlock", ctypes.c_int(self.pid), ctypes.byref(_Args()))
