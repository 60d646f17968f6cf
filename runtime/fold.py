"""The fold plan: which ranks share a device, which of them speaks for it, and in what order
devices combine (issue 17 §2). Pure: standard library only, no torch, no clock.

NCCL does not support one CUDA device appearing as several ranks of one communicator ("may lead
to hangs"), so a spliced job on GPUs (d < W) is *folded*: the ranks that share a device reduce
among themselves first (through their host's shared-memory area, runtime/localreduce.py), and
only the device's *member*, its lowest rank, takes part in the exchange between devices, over an
inner communicator that has exactly one member per device (runtime/hostchain.py, per device).

The order of operations stays the rank order of runtime/rankorder.py: device k's member continues
the running left-to-right sum it receives from device k-1 with its own ranks' values, in rank
order, and passes it on to device k+1; the last device's member finishes (AVG divides there,
once) and sends the result back. So every element is combined as ((v0 op v1) op v2) ... op
v[W-1] whatever the layout: 4 devices x 1 rank, 2 x 2 and 1 x 4 give the same bits, and the same
bits as the unfolded transports. That argument needs the devices, taken in device order, to
visit the ranks in rank order, hence the refusals below.

`fold_plan` refuses (FoldError, a ValueError, with a message that says why):
- a device whose ranks are not one contiguous block (ranks 0 and 2 on one device, 1 on another):
  the device would have to add its values at two places of the sum. protocol.layout never makes
  such a layout; a hand-made device map could.
- devices holding different numbers of ranks: protocol.layout gives every device W/d ranks, and
  the per-device areas are opened by one collective that every rank enters alike (a device of one
  rank needs no area, and would skip it while the others waited).
- one device named by ranks on two hosts (device numbers must be job-wide, as splice.device_map
  makes them), or a rank whose device is unknown.
"""
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["FoldError", "FoldPlan", "fold_plan"]


class FoldError(ValueError):
    """A rank -> device layout the fold cannot reduce in rank order; the message says why."""


@dataclass(frozen=True)
class FoldPlan:
    """How one inner group's W ranks fold onto their devices.

    blocks: each device's ranks as a contiguous range, in device order, which is rank order
    (blocks[0].start == 0, each block starts where the previous one ends)."""

    blocks: tuple[range, ...]

    @property
    def world_size(self) -> int:
        return self.blocks[-1].stop

    @property
    def devices(self) -> int:
        return len(self.blocks)

    @property
    def members(self) -> tuple[int, ...]:
        """Each device's member (its lowest rank), in the order the devices combine."""
        return tuple(block.start for block in self.blocks)

    def position(self, rank: int) -> int:
        """Returns the index (0..d-1) of rank's device in the combining order; IndexError for a
        rank outside 0..W-1."""
        for index, block in enumerate(self.blocks):
            if rank in block:
                return index
        raise IndexError(f"rank {rank} is not among the {self.world_size} ranks 0..{self.world_size - 1}")

    def is_member(self, rank: int) -> bool:
        """True for the one rank of its device that joins the exchange between devices."""
        return self.blocks[self.position(rank)].start == rank

    def combine_order(self) -> tuple[int, ...]:
        """The ranks in the order their values enter the sum: device by device, each device's
        ranks in rank order. Equal to 0..W-1 for every plan fold_plan returns (its contract)."""
        return tuple(rank for block in self.blocks for rank in block)


def fold_plan(devices: Sequence[Hashable], hosts: Sequence[Hashable] | None = None) -> FoldPlan:
    """Returns the fold of W ranks given each rank's device (any hashable key, job-wide: equal
    keys mean the same device) and, optionally, each rank's host. Raises FoldError for the
    layouts named in the module docstring; W = 0 is refused too."""
    world_size = len(devices)
    if world_size == 0:
        raise FoldError("no ranks to fold")
    if hosts is not None and len(hosts) != world_size:
        raise FoldError(f"{len(hosts)} host(s) given for {world_size} ranks")
    missing = [rank for rank, device in enumerate(devices) if device is None]
    if missing:
        raise FoldError(f"rank(s) {missing} have no device: a folded job needs every rank's device")
    blocks: list[range] = []
    where: dict[Hashable, range] = {}
    start = 0
    for rank in range(1, world_size + 1):
        if rank < world_size and devices[rank] == devices[start]:
            continue
        device = devices[start]
        if device in where:
            earlier = where[device]
            raise FoldError(
                f"device {device!r} holds ranks {list(earlier)} and {list(range(start, rank))}, with "
                f"rank {earlier.stop} (device {devices[earlier.stop]!r}) between them: the fold adds each "
                "device's ranks as one run of the rank-order sum, so a device must hold one contiguous "
                "block of ranks (protocol.layout places them so)")
        block = range(start, rank)
        where[device] = block
        blocks.append(block)
        start = rank
    sizes = sorted({len(block) for block in blocks})
    if len(sizes) > 1:
        counts = {devices[block.start]: len(block) for block in blocks}
        raise FoldError(
            f"devices hold different numbers of ranks ({counts}): every device runs W/d ranks "
            "(protocol.layout), and the devices' shared areas are opened by one collective that every "
            "rank enters alike")
    if hosts is not None:
        for block in blocks:
            on = {hosts[rank] for rank in block}
            if len(on) > 1:
                raise FoldError(
                    f"device {devices[block.start]!r} is named by ranks on {len(on)} hosts "
                    f"(ranks {list(block)}): device numbers must be job-wide, one device on one host")
    return FoldPlan(blocks=tuple(blocks))
