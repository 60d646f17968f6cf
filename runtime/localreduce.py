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
pieces. A job spanning hosts opens one area per host, its members the host's block of ranks
(runtime/hostchain.py drives them with put / inputs / result / take); below, "rank 0" is then the
block's first rank and W its size. Rank 0 creates the file and reserves its memory
(posix_fallocate: a full /dev/shm refuses here rather than crashing a rank later with SIGBUS); the
others map it only if it exists and carries rank 0's token (so a rank on another host, or in
another /dev/shm, never creates its own); every rank reports over gloo and the area is used only
if all of them could map it. The file is unlinked as soon as everyone has mapped it, and `close()`
unmaps it (CRIU then has no shared mapping to dump, and the restored job may be on other hosts).
"""
import ctypes
import os
import platform
import secrets
import time

import torch

from runtime import rankorder

SEGMENT_BYTES = int(os.environ.get("MERIDIAN_VPG_SEGMENT_BYTES", 4 << 20))
SHM_DIR = "/dev/shm"
SHM_DIR_VARIABLE = "MERIDIAN_VPG_SHM_DIR"  # another directory for the areas (tests: one per "host")
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


def shm_directory():
    """The directory the areas live in: this host's /dev/shm (or $MERIDIAN_VPG_SHM_DIR)."""
    return os.environ.get(SHM_DIR_VARIABLE) or SHM_DIR


def _header_bytes(world_size):
    # The token, one line per rank, and one line of totals (a folded device's member publishes
    # the flags' job-wide sums there for the ranks it speaks for: runtime/hostchain.py).
    needed = _TOKEN_BYTES + _WORD_STRIDE * (world_size + 2)
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
        self._totals = (ctypes.c_int64 * MAX_FLAGS).from_address(base + _WORD_STRIDE * (world_size + 1))
        self._passed = 0  # barriers this rank has arrived at

    @classmethod
    def open(cls, pg, store, *, rank, world_size, timeout_s, segment_bytes=None, members=None):
        """Maps the shared area of `members` (a contiguous range of ranks, default all of them:
        the job is on one host) if every rank of the job can map its own; returns it (indexed by
        the rank's position in members), or None (use gloo).

        Collective: every rank of the inner group calls it right after building the group, each
        with its own members (runtime/hostchain.py: one area per host)."""
        members = members if members is not None else range(world_size)
        if (os.environ.get(ENABLE_VARIABLE, "1") == "0" or len(members) < 2
                or _SYS_FUTEX is None):
            return None
        segment_bytes = segment_bytes or SEGMENT_BYTES
        segment_bytes -= segment_bytes % _WORD_STRIDE
        size = _header_bytes(len(members)) + (len(members) + 1) * segment_bytes
        # One host: the key every earlier version used; one of several hosts: its first rank's.
        store_key = STORE_KEY if len(members) == world_size else f"{STORE_KEY}/{members.start}"
        shm_dir = shm_directory()
        buffer, path = None, None
        try:
            if rank == members.start:
                token = secrets.token_hex(_TOKEN_BYTES // 2)
                path = os.path.join(shm_dir, f"meridian-vpg-{token}")
                try:
                    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.posix_fallocate(descriptor, 0, size)
                        os.pwrite(descriptor, token.encode(), 0)
                    finally:
                        os.close(descriptor)
                except OSError:
                    store.set(store_key, "none")  # the others must not wait for a token
                    raise
                store.set(store_key, token)
            else:
                token = store.get(store_key).decode()
                if token == "none":
                    raise OSError(f"rank {members.start} could not create the shared area")
                path = os.path.join(shm_dir, f"meridian-vpg-{token}")
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
        pg.allreduce([mapped]).wait()  # everyone has tried before the creator unlinks the file
        if rank == members.start and path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if int(mapped) != world_size:
            return None
        return cls(buffer, rank=rank - members.start, world_size=len(members),
                   segment_bytes=segment_bytes, timeout_s=timeout_s)

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

    def piece_elements(self, flat):
        """How many elements of `flat` go through the area at a time (one piece)."""
        return self.segment_bytes // flat.element_size()

    def chunk(self, count):
        """Returns (begin, end): the part of a piece of `count` elements this rank combines (the
        gloo path's chunks, over this area's ranks)."""
        base, extra = divmod(count, self.world_size)
        begin = self.rank * base + min(self.rank, extra)
        return begin, begin + base + (1 if self.rank < extra else 0)

    def put(self, piece, flags, hooks):
        """Writes this rank's piece (and flags) into its row, then waits until every rank of the
        area has; returns the flags' sums over the area's ranks (None without flags)."""
        # Rows are reused by the next piece: every rank has copied this piece's result out
        # before it writes its next input (it does so in order), and every owner has read the
        # inputs before anyone passes the second barrier. The same holds for the flags.
        self._row(self.rank, piece.dtype, piece.numel()).copy_(piece)
        if flags is not None:
            self._flags[self.rank][:len(flags)] = [int(v) for v in flags]
        self.barrier(hooks)
        if flags is None:
            return None
        return [sum(self._flags[r][i] for r in range(self.world_size)) for i in range(len(flags))]

    def inputs(self, dtype, count, begin, end):
        """Every rank's [begin, end) of the piece in the area, in rank order (views)."""
        return [self._row(r, dtype, count)[begin:end] for r in range(self.world_size)]

    def result(self, dtype, count):
        """The result row of a piece of `count` elements (a view: owners write their chunks)."""
        return self._row(self.world_size, dtype, count)

    def publish_totals(self, values):
        """Rank 0 of the area only, between put and take: writes the flags' sums over the whole
        job for the area's other ranks to read after take (one writer; they read it after the
        barrier in take, and the next write comes after the next put's barrier)."""
        self._totals[:len(values)] = [int(v) for v in values]

    def totals(self, count):
        """After take: the `count` sums rank 0 of the area published for this piece."""
        return list(self._totals[:count])

    def take(self, piece, hooks):
        """Waits until every chunk of the piece's result is written, then copies it into piece."""
        self.barrier(hooks)
        piece.copy_(self.result(piece.dtype, piece.numel()))

    def allreduce(self, flat, op, hooks, flags=None):
        """All-reduces a contiguous 1-D tensor in place, piece by piece, each element combined in
        rank order by its chunk's owner. Every rank calls it with the same sizes in the same
        order. `flags` (at most MAX_FLAGS ints, or None) ride along with the first piece, at no
        extra wait: returns their sums over all ranks."""
        step = self.piece_elements(flat)
        summed = None
        for start in range(0, max(flat.numel(), 1), step):
            piece = flat[start:start + step]
            count = piece.numel()
            carried = self.put(piece, flags, hooks)
            if flags is not None:
                summed, flags = carried, None
            begin, end = self.chunk(count)
            if end > begin:
                combined = rankorder.reduce_in_rank_order(self.inputs(piece.dtype, count, begin, end), op)
                self.result(piece.dtype, count)[begin:end].copy_(combined)
            self.take(piece, hooks)
        return summed

    def close(self):
        self._arrivals = self._flags = self._totals = None
        self._buffer = None


def shared_mappings():
    """Returns this process's mappings of local areas (none may be left when CRIU dumps it)."""
    with open("/proc/self/maps") as maps:
        return [line.split(None, 5)[-1].strip() for line in maps if "meridian-vpg-" in line]
