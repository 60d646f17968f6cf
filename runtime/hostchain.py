"""The rank-order all-reduce of a job spanning hosts: within a host through shared memory, between
hosts as a chain in host order.

A job on H hosts runs one contiguous block of ranks per host (runtime/multihost.py host_block),
in host order, so the rank order 0, 1, ..., W-1 is host 0's ranks, then host 1's, and so on. When
every block holds P = W/H ranks (equal shares), each host gets a shared area of its own
(runtime/localreduce.py, with its P ranks as members), and a piece of the tensor is reduced like
this:

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
Hosts holding unequal shares (2 + 1 devices: blocks of 4 and 2 ranks) take the flat path too, with
the same bits; unequal lanes (a chunk per local rank of the largest block) are not built.

The same chain folds a job's ranks per *device* (runtime/fold.py; `open_per_device`): the
stations are the devices instead of the hosts, in device order (rank order), each with its
device's ranks' area (a device of one rank needs none: its piece is its row), and each station
has one lane, its member (lowest rank), which takes the whole piece: steps 2-4 run on the members
only, over a group of the members alone (gloo on CPU; NCCL on GPUs, runtime/cudagroup.py, which
does not support one device as two ranks of a communicator). The other ranks of a device write
their row and read the result; the member publishes the flags' sums in the area for them. The
sequence of operations is still ((v0 op v1) op ...) op v[W-1], so a folded job has the bits of an
unfolded one. Why one lane: ranks sharing a device share its compute (a GPU, or the cores behind a
CPU device), so splitting the combining between them would gain nothing, and NCCL then needs one
communicator member per device. The cost: the members' chain carries whole pieces in d - 1 hops
and back, one piece at a time (a long chain of devices would want the pieces pipelined).
"""
import hashlib
import os

import torch
import torch.distributed as dist

from runtime import fold, localreduce, rankorder
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
    """One inner group's chain of *stations* (see the module docstring). Made by open() (the
    stations are hosts, every rank a lane) or open_per_device() (the stations are devices, each
    with one lane: its member; runtime/fold.py).

    area: this station's shared area, or None for a station of one rank (its row is its piece).
    pg: the group the chain's messages go over; peers: for each station, the address in pg of
    this rank's lane there (None: this rank is not a lane, its station's member carries it).
    message_device: where messages live and partials are combined (a CUDA device for NCCL)."""

    def __init__(self, area, pg, *, station, stations, world_size, peers, message_device="cpu",
                 lane_chunks=True):
        self.area = area
        self.pg = pg
        self.hosts = stations
        self.host = station
        self.world_size = world_size
        self.lane = peers is not None
        self.lane_chunks = lane_chunks  # lanes split the piece (hosts); else one lane takes it all
        self.message_device = torch.device(message_device)
        self.plan = None  # the fold plan, for a chain of devices
        if peers is not None:
            self.previous = peers[station - 1] if station > 0 else None
            self.next = peers[station + 1] if station < stations - 1 else None
            self.last = peers[-1]
            self.earlier = peers[:-1]  # where the last station sends the finished chunks

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
        per_host = len(blocks[0])
        return cls(area, pg, station=rank // per_host, stations=len(blocks), world_size=world_size,
                   peers=[block.start + rank % per_host for block in blocks])

    @classmethod
    def open_per_device(cls, pg, store, *, rank, world_size, timeout_s, device, members_group,
                        message_device="cpu"):
        """Returns the folded chain (runtime/fold.py): one station per device, the device's ranks
        through their area, its member alone in the exchange between devices over a group of the
        members only, made by members_group(store, index, size) (gloo on CPU, NCCL on GPUs).

        Collective on pg: every rank calls it right after building the group, with its device
        (a job-wide key). Returns None when a device's area cannot be mapped (no usable
        /dev/shm; MERIDIAN_VPG_LOCAL=0); raises fold.FoldError for a layout the fold refuses
        (on every rank alike: they all see the same keys)."""
        if os.environ.get(localreduce.ENABLE_VARIABLE, "1") == "0":
            return None
        keys = torch.zeros(2 * world_size, dtype=torch.int64)
        mine = torch.tensor([-1 if device is None else int(device), host_key()], dtype=torch.int64)
        pg._allgather_base(keys, mine).wait()
        pairs = keys.view(world_size, 2).tolist()
        plan = fold.fold_plan([None if d < 0 else d for d, _ in pairs], [h for _, h in pairs])
        station = plan.position(rank)
        block = plan.blocks[station]
        area = None
        if len(block) > 1:
            area = LocalArea.open(pg, store, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                  members=block)
            if area is None:
                return None
        group = None
        if plan.devices > 1 and rank == block.start:
            group = members_group(dist.PrefixStore("fold-members", store), station, plan.devices)
        chain = cls(area, group, station=station, stations=plan.devices, world_size=world_size,
                    peers=list(range(plan.devices)) if rank == block.start else None,
                    message_device=message_device, lane_chunks=False)
        chain.plan = plan
        return chain

    def allreduce(self, flat, op, hooks, flags=None):
        """All-reduces a contiguous 1-D tensor in place, piece by piece (every rank calls it with
        the same sizes in the same order); `flags` (at most MAX_FLAGS ints, or None) ride in the
        chain's messages: returns their sums over all ranks of all stations."""
        step = self.area.piece_elements(flat) if self.area is not None else max(flat.numel(), 1)
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
                              dtype=torch.uint8, device=self.message_device)
        return message, message[:FLAG_BYTES].view(torch.int64), message[FLAG_BYTES:].view(dtype)

    def _reduce_piece(self, piece, op, hooks, flags):
        area, count, dtype = self.area, piece.numel(), piece.dtype
        if area is None:  # a station of one rank: its piece is its only row (and it is a lane)
            station_flags = list(flags) if flags is not None else None
            begin, end = 0, count
        else:
            station_flags = None
            begin, end = area.chunk(count) if self.lane_chunks else (0, count)
        if not self.lane:  # a folded device's other rank: its member carries its row
            area.put(piece, flags, hooks)
            area.take(piece, hooks)
            return area.totals(len(flags)) if flags is not None else None
        # Receives are posted first, so the bytes can come in while this station gathers. The
        # finished chunk's receive is posted only after this station's own send: an NCCL
        # communicator runs a pair's operations in the order issued, and a receive from the last
        # station queued before the send that feeds it would wait forever.
        incoming = None
        if self.previous is not None:
            incoming = self._message(dtype, end - begin)
            incoming_work = self.pg.recv([incoming[0]], self.previous, TAG_PARTIAL)
        if area is not None:
            station_flags = area.put(piece, flags, hooks)
            rows = area.inputs(dtype, count, begin, end)
        else:
            rows = [piece[begin:end]]
        if rows[0].device != self.message_device:  # a CUDA member: the area's rows are on the host
            rows = [row.to(self.message_device) for row in rows]
        if incoming is None:  # station 0: the chain starts here
            message, carried, partial = self._message(dtype, end - begin)
            carried.zero_()
            rankorder.combine_into(partial.copy_(rows[0]), rows[1:], op)
        else:
            _wait(incoming_work, hooks)
            message, carried, partial = incoming
            rankorder.combine_into(partial, rows, op)
        if station_flags is not None:
            carried[:len(station_flags)] += torch.tensor(station_flags, dtype=torch.int64,
                                                         device=carried.device)
        if self.next is not None:
            sent = [self.pg.send([message], self.next, TAG_PARTIAL)]
            finished = self._message(dtype, end - begin)
            finished_work = self.pg.recv([finished[0]], self.last, TAG_FINAL)
            _wait(finished_work, hooks)
            message, carried, partial = finished
        else:  # the last station: every rank's value is in
            rankorder.average(partial, self.world_size, op)
            sent = [self.pg.send([message], peer, TAG_FINAL) for peer in self.earlier]
        totals = carried[:len(flags)].tolist() if flags is not None else None
        if area is None:
            piece.copy_(partial)
        else:
            area.result(dtype, count)[begin:end].copy_(partial)
            if totals is not None and not self.lane_chunks:
                area.publish_totals(totals)
        for work in sent:
            _wait(work, hooks)
        if area is not None:
            area.take(piece, hooks)
        return totals

    def close(self):
        if self.area is not None:
            self.area.close()
        self.area = None
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "abort_communicator"):
            pg.abort_communicator()  # an NCCL members' group (runtime/cudagroup.py)
        del pg
