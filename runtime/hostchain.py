"""The rank-order all-reduce of a job spanning hosts: within a host through shared memory, between
hosts as a chain in host order.

A job on H hosts runs contiguous blocks of P = W/H ranks per host (runtime/multihost.py
node_ranks), so the rank order 0, 1, ..., W-1 is host 0's ranks, then host 1's, and so on. Each
host gets a shared area of its own (runtime/localreduce.py, with its P ranks as members), and a
piece of the tensor is reduced like this:

1. every rank writes its piece into its row of its host's area (one futex barrier);
2. the piece is cut into P chunks, one per *lane*: local rank j of every host handles chunk j.
   On host 0, lane j combines chunk j of its host's rows left to right into a partial and sends
   it to lane j of host 1; host h receives the partial from host h-1, combines its own rows into
   it, left to right, and sends it on; host H-1 thus ends with ((v0 op v1) op ...) op v[W-1] for
   every element of the chunk: exactly the sequence of operations of the one-host area and of the
   flat gloo path (runtime/rankorder.py), so the same bits. AVG divides there, once;
3. host H-1's lane j sends the finished chunk back to lane j of every other host;
4. each lane writes its finished chunk into its host's result row; after a second barrier every
   rank copies the piece out.

The cut's flags (runtime/cut.py) travel in the same messages: each message starts with one
64-byte line of int64 sums, to which each host adds its ranks' flags (summed from its area), so a
step that carries flags issues no collective of its own. TCP carries 2(H-1) copies of the tensor
in all (the flat reduce-scatter + all-gather: 2(W-1)), in 2(H-1)P messages of N/P, all
point-to-point on the job's gloo group (its full mesh of pairs; tags of their own, so no gloo
collective is disturbed). HostChain.allreduce returns when the piece is done; the virtual group
runs it on a thread of its own, in issue order (runtime/vpg.py), so DDP's backward pass goes on.

Used only when every host holds the same number P >= 2 of ranks in one contiguous block, H >= 2,
and every host's area can be mapped (hosts are told apart by host_key); otherwise the group takes
the flat gloo path (runtime/vpg.py). One rank per host gains nothing from an area: flat path.
"""
import hashlib
import os

import torch

from runtime import localreduce, rankorder
from runtime.localreduce import LocalArea

ENABLE_VARIABLE = "MERIDIAN_VPG_HOST_CHAIN"  # "0": ranks on several hosts take the flat gloo path
TAG_PARTIAL = 0x4D52  # gloo slots of the chain's point-to-point messages (collectives use others)
TAG_FINAL = 0x4D53
FLAG_BYTES = 64  # each message's first line: the flags' running sums (int64), then the chunk
MAX_FLAGS = localreduce.MAX_FLAGS


def host_key():
    """Returns a 63-bit number that is the same for ranks that can share a /dev/shm area and
    differs between hosts: boot id, host name and the shared-memory directory's identity. Only a
    hint: the area itself is checked by its token (LocalArea.open)."""
    directory = localreduce.shm_directory()
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        status = os.stat(directory)
    except OSError:
        return int.from_bytes(os.urandom(7), "little")  # a host of its own: no area to share
    text = f"{boot}|{os.uname().nodename}|{directory}|{status.st_dev}|{status.st_ino}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def host_blocks(keys):
    """Returns each host's ranks as contiguous ranges in host order, given each rank's host key,
    or None when the chain cannot run: one host only, a host whose ranks are not one contiguous
    block, hosts holding different numbers of ranks, or one rank per host."""
    blocks, seen = [], set()
    start = 0
    for rank in range(1, len(keys) + 1):
        if rank == len(keys) or keys[rank] != keys[start]:
            if keys[start] in seen:
                return None  # this host's ranks are in two blocks: host order is not rank order
            seen.add(keys[start])
            blocks.append(range(start, rank))
            start = rank
    if len(blocks) < 2 or len({len(b) for b in blocks}) != 1 or len(blocks[0]) < 2:
        return None
    return blocks


def _wait(work, hooks):
    """Waits for a gloo Work with the device token given away (a rank sharing its device)."""
    if work.is_completed():
        work.wait()  # raises its failure, if any
        return
    hooks.before_collective()
    try:
        work.wait()
    finally:
        hooks.after_collective()


class HostChain:
    """One inner group's chain across hosts (see the module docstring). Made by open()."""

    def __init__(self, area, pg, *, rank, blocks):
        self.area = area
        self.pg = pg
        self.hosts = len(blocks)
        self.world_size = sum(len(block) for block in blocks)
        per_host = len(blocks[0])
        self.host = rank // per_host
        lane = [block.start + rank % per_host for block in blocks]  # this lane's rank on each host
        self.previous = lane[self.host - 1] if self.host > 0 else None
        self.next = lane[self.host + 1] if self.host < self.hosts - 1 else None
        self.last = lane[-1]
        self.earlier = lane[:-1]  # where the last host sends the finished chunks

    @classmethod
    def open(cls, pg, store, *, rank, world_size, timeout_s):
        """Returns the chain when the job spans hosts as described in the module docstring and
        every host's area could be mapped, else None (use gloo). Collective: every rank calls it
        right after building the group (after a one-host area could not be mapped)."""
        if (os.environ.get(ENABLE_VARIABLE, "1") == "0"
                or os.environ.get(localreduce.ENABLE_VARIABLE, "1") == "0" or world_size < 4):
            return None
        keys = torch.zeros(world_size, dtype=torch.int64)
        pg._allgather_base(keys, torch.tensor([host_key()], dtype=torch.int64)).wait()
        blocks = host_blocks(keys.tolist())
        if blocks is None:
            return None
        members = next(block for block in blocks if rank in block)
        area = LocalArea.open(pg, store, rank=rank, world_size=world_size, timeout_s=timeout_s,
                              members=members)
        if area is None:
            return None
        return cls(area, pg, rank=rank, blocks=blocks)

    def allreduce(self, flat, op, hooks, flags=None):
        """All-reduces a contiguous 1-D tensor in place, piece by piece (every rank calls it with
        the same sizes in the same order); `flags` (at most MAX_FLAGS ints, or None) ride in the
        chain's messages: returns their sums over all ranks of all hosts."""
        step = self.area.piece_elements(flat)
        summed = None
        for start in range(0, max(flat.numel(), 1), step):
            piece = flat[start:start + step]
            totals = self._reduce_piece(piece, op, hooks, flags)
            if flags is not None:
                summed, flags = totals, None
        return summed

    def _message(self, dtype, elements):
        """A buffer for one chain message: the flags' line, then `elements` values (a view)."""
        message = torch.empty(FLAG_BYTES + elements * torch.empty(0, dtype=dtype).element_size(),
                              dtype=torch.uint8)
        return message, message[:FLAG_BYTES].view(torch.int64), message[FLAG_BYTES:].view(dtype)

    def _reduce_piece(self, piece, op, hooks, flags):
        area, count, dtype = self.area, piece.numel(), piece.dtype
        begin, end = area.chunk(count)
        # Receives are posted first, so gloo can take the bytes in while this host gathers.
        incoming = finished = None
        if self.previous is not None:
            incoming = self._message(dtype, end - begin)
            incoming_work = self.pg.recv([incoming[0]], self.previous, TAG_PARTIAL)
        if self.next is not None:
            finished = self._message(dtype, end - begin)
            finished_work = self.pg.recv([finished[0]], self.last, TAG_FINAL)
        host_flags = area.put(piece, flags, hooks)
        rows = area.inputs(dtype, count, begin, end)
        if incoming is None:  # host 0: the chain starts here
            message, carried, partial = self._message(dtype, end - begin)
            carried.zero_()
            rankorder.combine_into(partial.copy_(rows[0]), rows[1:], op)
        else:
            _wait(incoming_work, hooks)
            message, carried, partial = incoming
            rankorder.combine_into(partial, rows, op)
        if host_flags is not None:
            carried[:len(host_flags)] += torch.tensor(host_flags, dtype=torch.int64)
        if self.next is not None:
            sent = [self.pg.send([message], self.next, TAG_PARTIAL)]
            _wait(finished_work, hooks)
            message, carried, partial = finished
        else:  # the last host: every rank's value is in
            rankorder.average(partial, self.world_size, op)
            sent = [self.pg.send([message], rank, TAG_FINAL) for rank in self.earlier]
        area.result(dtype, count)[begin:end].copy_(partial)
        for work in sent:
            _wait(work, hooks)
        totals = carried[:len(flags)].tolist() if flags is not None else None
        area.take(piece, hooks)
        return totals

    def close(self):
        self.area.close()
        self.area = self.pg = None
