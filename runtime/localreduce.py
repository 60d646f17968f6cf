"""Local reduction: the rank-order all-reduce through shared memory, for ranks on one host.

When every rank of a job runs on the same host (one node of a splice, a small job, a job packed
onto one machine), the gradients need not go through gloo's loopback TCP at all. Each rank copies
its tensor into its own input row of a shared area (a /dev/shm file every rank maps); the owner of
each chunk combines that chunk of every input row in rank order 0, 1, ..., W-1 into the result
row; every rank copies the result row out. Each element is combined in exactly the order of the
gloo path (`vpg._RankOrderAllreduce`), so the bits are the same whichever path a step takes, and
a job may move between them (to several hosts, back to one) at any cut.

Ranks wait for each other twice per piece (all input rows written; all chunks combined) at a
barrier in the area itself: each rank publishes how many barriers it has passed in a 32-bit word
of its own (one writer per word: no atomic read-modify-write needed) and wakes that word's
futex; a rank that must wait sleeps on the futex of a peer that has not arrived yet. One
syscall to arrive, one sleep per late peer: the gloo one-int all-reduce it replaced was a chain
of 2(W-1) loopback round trips and cost more than the copies. The reduction runs in the calling
thread and returns when done (with one host's memory bandwidth it is short; the device token is
given away while sleeping). A dead peer never arrives: the launcher ends the job when a rank
dies, and a wait gives up after the group's timeout. Store order: x86-64 keeps stores in program
order, so the data a rank wrote is visible before its arrival word (aarch64 would need a fence
first; this runtime is only built for x86-64 and falls back to gloo elsewhere).

The area holds one piece at a time (W + 1 rows of SEGMENT_BYTES); a longer tensor goes through in
pieces. Rank 0 creates the file and reserves its memory (posix_fallocate: a full /dev/shm refuses
here rather than crashing a rank later with SIGBUS); the others map it only if it exists and
carries rank 0's token (so a rank on another host, or in another /dev/shm, never creates its own);
every rank reports over gloo and the area is used only if all of them could map it. The file is
unlinked as soon as everyone has mapped it, and `close()` unmaps it (CRIU then has no shared
mapping to dump, and the restored job may be on other hosts).
"""
import ctypes
import os
import platform
import secrets
import time

import torch

SEGMENT_BYTES = int(os.environ.get("MERIDIAN_VPG_SEGMENT_BYTES", 4 << 20))
SHM_DIR = "/dev/shm"
ENABLE_VARIABLE = "MERIDIAN_VPG_LOCAL"  # "0": always reduce over gloo (an escape hatch; tests)
STORE_KEY = "meridian-local-area"
_TOKEN_BYTES = 32
_WORD_STRIDE = 64  # one cache line per rank: its arrival word, then the flags it carries
MAX_FLAGS = 7  # int64 flags that fit in the rest of the line
_PAGE = 4096

_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAIT_SLICE_S = 0.5  # a sleeping rank looks at the clock this often


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _futex(address, operation, value, timeout=None):
    return _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address),
                         ctypes.c_int(operation), ctypes.c_uint32(value),
                         ctypes.byref(timeout) if timeout is not None else None,
                         ctypes.c_void_p(None), ctypes.c_int(0))


def _header_bytes(world_size):
    needed = _TOKEN_BYTES + _WORD_STRIDE * (world_size + 1)
    return -(-needed // _PAGE) * _PAGE


class LocalArea:
    """The job's shared area for one inner group's lifetime (see the module docstring)."""

    def __init__(self, buffer, *, rank, world_size, segment_bytes, timeout_s):
        self._buffer = buffer
        self.rank, self.world_size = rank, world_size
        self.segment_bytes = segment_bytes
        self.timeout_s = timeout_s
        self._header = _header_bytes(world_size)
        base = buffer.data_ptr()
        self._words = [base + _WORD_STRIDE * (r + 1) for r in range(world_size)]
        self._arrivals = [ctypes.c_uint32.from_address(word) for word in self._words]
        self._flags = [(ctypes.c_int64 * MAX_FLAGS).from_address(word + 8) for word in self._words]
        self._passed = 0  # barriers this rank has arrived at

    @classmethod
    def open(cls, pg, store, *, rank, world_size, timeout_s, segment_bytes=None):
        """Maps the job's shared area if every rank can; returns it, or None (use gloo).

        Collective: every rank of the inner group calls it right after building the group."""
        if (os.environ.get(ENABLE_VARIABLE, "1") == "0" or world_size < 2
                or _SYS_FUTEX is None):
            return None
        segment_bytes = segment_bytes or SEGMENT_BYTES
        segment_bytes -= segment_bytes % _WORD_STRIDE
        size = _header_bytes(world_size) + (world_size + 1) * segment_bytes
        buffer, path = None, None
        try:
            if rank == 0:
                token = secrets.token_hex(_TOKEN_BYTES // 2)
                path = os.path.join(SHM_DIR, f"meridian-vpg-{token}")
                try:
                    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.posix_fallocate(descriptor, 0, size)
                        os.pwrite(descriptor, token.encode(), 0)
                    finally:
                        os.close(descriptor)
                except OSError:
                    store.set(STORE_KEY, "none")  # the others must not wait for a token
                    raise
                store.set(STORE_KEY, token)
            else:
                token = store.get(STORE_KEY).decode()
                if token == "none":
                    raise OSError("rank 0 could not create the shared area")
                path = os.path.join(SHM_DIR, f"meridian-vpg-{token}")
                descriptor = os.open(path, os.O_RDONLY)  # never creates: another host has none
                try:
                    if os.pread(descriptor, _TOKEN_BYTES, 0).decode() != token:
                        raise OSError(f"{path} is not this job's area")
                    if os.fstat(descriptor).st_size != size:
                        raise OSError(f"{path} has another size")
                finally:
                    os.close(descriptor)
            buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError, UnicodeDecodeError):
            buffer = None
        mapped = torch.tensor([0 if buffer is None else 1], dtype=torch.int32)
        pg.allreduce([mapped]).wait()  # everyone has tried before rank 0 unlinks the file
        if rank == 0 and path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if int(mapped) != world_size:
            return None
        return cls(buffer, rank=rank, world_size=world_size, segment_bytes=segment_bytes,
                   timeout_s=timeout_s)

    # -- the barrier ------------------------------------------------------------------------
    def barrier(self, hooks):
        """Returns once every rank has arrived here as often as this one (see the docstring);
        hooks.before_collective/after_collective surround a sleep (the device token)."""
        self._passed = (self._passed + 1) & 0xFFFFFFFF
        target = self._passed
        self._arrivals[self.rank].value = target
        _futex(self._words[self.rank], _FUTEX_WAKE, 0x7FFFFFFF)
        slept = False
        deadline = None
        try:
            for peer in range(self.world_size):
                while True:
                    seen = self._arrivals[peer].value
                    if (seen - target) & 0xFFFFFFFF < 0x80000000:  # seen >= target, wrapping
                        break
                    if not slept:
                        hooks.before_collective()
                        slept = True
                        deadline = time.monotonic() + self.timeout_s
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"meridian virtual group: rank {peer} did not reach the local "
                            f"reduction within {self.timeout_s:.0f} s")
                    _futex(self._words[peer], _FUTEX_WAIT, seen,
                           _Timespec(0, int(_WAIT_SLICE_S * 1e9)))
        finally:
            if slept:
                hooks.after_collective()

    # -- the reduction ----------------------------------------------------------------------
    def _row(self, index, dtype, count):
        """Rank `index`'s input row; index W is the result row."""
        start = self._header + index * self.segment_bytes
        return self._buffer[start:start + self.segment_bytes].view(dtype)[:count]

    def allreduce(self, flat, op, reduce_in_rank_order, hooks, flags=None):
        """All-reduces a contiguous 1-D tensor in place, piece by piece. Every rank calls it
        with the same sizes in the same order. `flags` (at most MAX_FLAGS ints, or None) ride
        along with the first piece, at no extra wait: returns their sums over all ranks."""
        step = self.segment_bytes // flat.element_size()
        summed = None
        for start in range(0, max(flat.numel(), 1), step):
            piece = flat[start:start + step]
            count = piece.numel()
            # Rows are reused by the next piece: every rank has copied this piece's result out
            # before it writes its next input (it does so in order), and every owner has read the
            # inputs before anyone passes the second barrier. The same holds for the flags.
            self._row(self.rank, piece.dtype, count).copy_(piece)
            if flags is not None:
                self._flags[self.rank][:len(flags)] = [int(v) for v in flags]
            self.barrier(hooks)
            if flags is not None:
                summed = [sum(self._flags[r][i] for r in range(self.world_size))
                          for i in range(len(flags))]
                flags = None
            base, extra = divmod(count, self.world_size)  # the gloo path's chunks
            mine = self.rank * base + min(self.rank, extra)
            end = mine + base + (1 if self.rank < extra else 0)
            if end > mine:
                rows = [self._row(r, piece.dtype, count)[mine:end]
                        for r in range(self.world_size)]
                combined = reduce_in_rank_order(rows, op)
                self._row(self.world_size, piece.dtype, count)[mine:end].copy_(combined)
            self.barrier(hooks)
            piece.copy_(self._row(self.world_size, piece.dtype, count))
        return summed

    def close(self):
        self._arrivals = self._flags = None
        self._buffer = None


def shared_mappings():
    """Returns this process's mappings of local areas (none may be left when CRIU dumps it)."""
    with open("/proc/self/maps") as maps:
        return [line.split(None, 5)[-1].strip() for line in maps if "meridian-vpg-" in line]
