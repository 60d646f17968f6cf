"""How a job's W logical ranks lie on d devices: the one place the rule "d divides W" is written.

A job's world size W never changes; resizing changes how many devices d its W ranks run on
(replica splicing). Every device must run the same number of ranks, so d must divide W, and
ranks go in contiguous blocks of W/d so that ranks sharing a device are neighbours (W=4 on 2
devices: ranks 0,1 on device 0, ranks 2,3 on device 1).

Standard library only: the scheduler core, the control plane (submit checks), the node agent
and the in-job runtime all import it, and some of them run far from numpy and Django.
"""
import functools

__all__ = [
    "LayoutError", "device_counts_allowed", "layout_fits", "layout_check", "rank_device", "rank_devices",
]


class LayoutError(ValueError):
    """A device count that cannot run a job's W ranks; the message names the counts that can."""


@functools.lru_cache(maxsize=4096)
def device_counts_allowed(world_size: int, *, at_least: int = 1, at_most: int | None = None) -> tuple[int, ...]:
    """Returns the device counts W ranks can run on, ascending: the divisors d of W with
    at_least <= d <= at_most (at_most None: no cap beyond W itself).

    Empty when world_size < 1 or nothing lies in the bounds; at_least below 1 counts as 1.
    """
    highest = world_size if at_most is None else min(at_most, world_size)
    return tuple(d for d in range(max(at_least, 1), highest + 1) if world_size % d == 0)


def layout_fits(world_size: int, devices: int) -> bool:
    """True when `devices` devices can run `world_size` ranks: both are >= 1 and d divides W."""
    return world_size >= 1 and devices >= 1 and world_size % devices == 0


def layout_check(world_size: int, devices: int) -> None:
    """Returns None when `devices` can run `world_size` ranks; raises LayoutError otherwise,
    naming the device counts that would do."""
    if devices < 1 or world_size < 1:
        raise LayoutError(f"need at least one rank and one device (got W={world_size}, d={devices})")
    if world_size % devices != 0:
        raise LayoutError(
            f"{devices} devices do not divide the world size {world_size}, so they cannot evenly run "
            f"its {world_size} ranks: choose d among {list(device_counts_allowed(world_size))}"
        )


def rank_device(rank: int, world_size: int, devices: int) -> int:
    """Returns the index (0..d-1) of the device rank `rank` runs on: its contiguous block, r * d // W.

    Raises LayoutError when d does not divide W, and IndexError when rank is not in 0..W-1.
    """
    layout_check(world_size, devices)
    if not 0 <= rank < world_size:
        raise IndexError(f"rank {rank} is not among the {world_size} ranks 0..{world_size - 1}")
    return rank * devices // world_size


def rank_devices(world_size: int, devices: int) -> tuple[int, ...]:
    """Returns, for each of the W ranks in order, the index of the device it runs on (see rank_device).

    Raises LayoutError when d does not divide W.
    """
    layout_check(world_size, devices)
    return tuple(rank * devices // world_size for rank in range(world_size))
