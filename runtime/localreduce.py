"""Local reduction: the rank-order all-reduce through shared memory, for ranks on one host.

When every rank of a job runs on the same host (one node of a splice, a small job, a job packed
onto one machine), the gradients need not go through gloo's loopback TCP at all. Each rank copies
its tensor into its own row of a shared area (a /dev/shm file every rank maps), the owner of each
chunk combines that chunk of every row in rank order 0, 1, ..., W-1 and writes the result back into
a result row, and every rank copies the result row out. Each element is combined in exactly the
order the gloo path (`vpg._RankOrderAllreduce`) uses, so the bits are the same whichever path a
step takes, and a job may move between them (a move to several hosts, a resize) at any cut.

The two points where ranks must wait for each other (all rows written; all chunks combined) are
one-int all-reduces on the inner gloo group: they carry a dead peer's error and the group's timeout
like any collective, and they are asynchronous, so the reduction overlaps backward as gloo's would.

The area holds SLOTS pieces at once (rows of SEGMENT_BYTES each); a longer tensor goes through in
pieces. Rank 0 creates the file and reserves its memory (posix_fallocate: a full /dev/shm refuses
here rather than crashing a rank later with SIGBUS); the others map it only if it exists and
carries rank 0's token (so a rank on another host, or in another /dev/shm, never creates its own);
every rank reports and the area is used only if all of them could map it. The file is unlinked as
soon as everyone has mapped it, and `close()` unmaps it (CRIU then has no shared mapping to dump,
and the restored job may be on other hosts).
"""
import os
import secrets

import torch

SEGMENT_BYTES = int(os.environ.get("MERIDIAN_VPG_SEGMENT_BYTES", 4 << 20))
SLOTS = 4
HEADER_BYTES = 4096
SHM_DIR = "/dev/shm"
ENABLE_VARIABLE = "MERIDIAN_VPG_LOCAL"  # "0": always reduce over gloo (an escape hatch; tests)
_TOKEN_BYTES = 32


def _sync(pg):
    """Starts the cheapest collective that returns only when every rank has started it."""
    return pg.allreduce([torch.zeros(1, dtype=torch.int32)])


class LocalArea:
    """The job's shared area for one inner group's lifetime (see the module docstring)."""

    def __init__(self, buffer, *, rank, world_size, segment_bytes, slots):
        self._buffer = buffer
        self.rank, self.world_size = rank, world_size
        self.segment_bytes, self.slots = segment_bytes, slots
        self._sequence = 0

    @classmethod
    def open(cls, pg, store, *, rank, world_size, segment_bytes=None, slots=SLOTS):
        """Maps the job's shared area if every rank can; returns it, or None (use gloo).

        Collective: every rank of the inner group must call it right after building the group."""
        if os.environ.get(ENABLE_VARIABLE, "1") == "0" or world_size < 2:
            return None
        segment_bytes = segment_bytes or SEGMENT_BYTES
        segment_bytes -= segment_bytes % 64
        size = HEADER_BYTES + slots * (world_size + 1) * segment_bytes
        buffer, path, error = None, None, None
        try:
            if rank == 0:
                token = secrets.token_hex(_TOKEN_BYTES // 2)
                path = os.path.join(SHM_DIR, f"meridian-vpg-{token}")
                descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(descriptor, 0, size)
                    os.pwrite(descriptor, token.encode(), 0)
                finally:
                    os.close(descriptor)
                store.set("meridian-local-area", token)
            else:
                token = store.get("meridian-local-area").decode()
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
        except (OSError, RuntimeError, UnicodeDecodeError) as exc:
            error = exc
            buffer = None
        mapped = torch.tensor([0 if buffer is None else 1], dtype=torch.int32)
        pg.allreduce([mapped]).wait()  # everyone has tried before rank 0 unlinks the file
        if rank == 0 and path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if int(mapped) != world_size:
            del buffer
            return None
        del error
        return cls(buffer, rank=rank, world_size=world_size, segment_bytes=segment_bytes,
                   slots=slots)

    def piece_elements(self, dtype):
        return self.segment_bytes // torch.empty((), dtype=dtype).element_size()

    def reduction(self, piece, op, reduce_in_rank_order):
        """Returns the reduction of one contiguous piece (at most piece_elements long) in the
        next slot. The caller must not start it before the reduction SLOTS earlier has finished
        on this rank: this rank's input row is reused at once (every owner has read it before that
        one could finish), the result row once every rank has started this one (so every rank has
        copied the earlier result out)."""
        slot = self._sequence % self.slots
        self._sequence += 1
        return _LocalReduction(self, slot, piece, op, reduce_in_rank_order)

    def row(self, slot, rank, dtype, count):
        """Rank `rank`'s input row of a slot; rank W's row is the slot's result."""
        start = HEADER_BYTES + (slot * (self.world_size + 1) + rank) * self.segment_bytes
        return self._buffer[start:start + self.segment_bytes].view(dtype)[:count]

    def close(self):
        self._buffer = None


class _LocalReduction:
    """One piece's rank-order all-reduce through the shared area, in the three steps the virtual
    group drives (as for `vpg._RankOrderAllreduce`): scatter(pg) writes this rank's input row and
    starts the first wait; gather(pg), once that is done, combines this rank's chunk of every
    input row into the result row and starts the second; finish(), once that is done, copies the
    result row out."""

    def __init__(self, area, slot, piece, op, reduce_in_rank_order):
        self.area, self.slot, self.piece, self.op = area, slot, piece, op
        self._reduce = reduce_in_rank_order
        # This rank's chunk: the same split into W chunks as the gloo path's.
        base, extra = divmod(piece.numel(), area.world_size)
        self.start = area.rank * base + min(area.rank, extra)
        self.stop = self.start + base + (1 if area.rank < extra else 0)

    def scatter(self, pg):
        self._row(self.area.rank).copy_(self.piece)
        return _sync(pg)

    def gather(self, pg):
        start, stop = self.start, self.stop
        if stop > start:
            rows = [self._row(r)[start:stop] for r in range(self.area.world_size)]
            self._row(self.area.world_size)[start:stop].copy_(self._reduce(rows, self.op))
        return _sync(pg)

    def finish(self):
        self.piece.copy_(self._row(self.area.world_size))

    def _row(self, rank):
        return self.area.row(self.slot, rank, self.piece.dtype, self.piece.numel())


def shared_mappings():
    """Returns this process's mappings of local areas (none may be left when CRIU dumps it)."""
    with open("/proc/self/maps") as maps:
        return [line.split(None, 5)[-1].strip() for line in maps if "meridian-vpg-" in line]

