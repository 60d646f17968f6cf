"""What a placement costs a job: the one rule the scheduler core and the simulator share.

A job of W ranks on d devices spread over n nodes runs at

    speed = d / W                       (each device runs W/d ranks)
          x SPLICE_EFFICIENCY           if d < W (ranks sharing a device take turns)
          x SPREAD_EFFICIENCY           if n > min_nodes(d) (its collectives cross more node
                                        boundaries than the fleet's node size forces)

of running alone on W devices, where min_nodes(d) = ceil(d / largest node's devices). The
simulator's cost model (scheduler/sim/costs.py) takes its defaults from here, and the core's
placement (scheduler/plugins/placement.py) prefers, for the same d, the placement with the
fewest nodes, and for a Premium job accepts nothing slower than its W-device speed: a
spread-out Premium gang misses its 95% from its first second.
Both efficiencies are assumptions (see costs.py's docstring for where they come from).

Making room costs the job that gets the room too: devices a victim gives up (preempted, or
shrunk) stay busy until its checkpoint is written, `checkpoint_seconds(gb)` (CRIU's
measured 0.36 GB/s plus a fixed 0.05 s for the consistent cut, costs.py). The simulator
charges exactly that before the devices are free; the core's Premium preemption picks the
room that is ready soonest by the same rule, since every second a Premium job waits on its
devices counts against its 95%.
"""
from __future__ import annotations

SPLICE_EFFICIENCY = 0.95
SPREAD_EFFICIENCY = 0.9
CHECKPOINT_GB_PER_S = 0.36
CHECKPOINT_FIXED_S = 0.05


def min_nodes(devices: int, largest_node: int) -> int:
    """Returns the fewest nodes `devices` devices can be on, given the largest node's size."""
    if devices <= 0:
        return 0
    return -(-int(devices) // max(int(largest_node), 1))


def is_spread(devices: int, n_nodes: int, largest_node: int) -> bool:
    """Returns True when a placement of `devices` on `n_nodes` nodes pays the spread cost."""
    return devices > 1 and n_nodes > min_nodes(devices, largest_node)


def speed(devices: int, world_size: int, n_nodes: int, largest_node: int,
          splice_efficiency: float = SPLICE_EFFICIENCY, spread_efficiency: float = SPREAD_EFFICIENCY) -> float:
    """Returns the speed of W=world_size ranks on `devices` devices over `n_nodes` nodes, as a
    fraction of running alone, packed, on W devices (the module docstring's rule)."""
    out = devices / world_size
    if devices < world_size:
        out *= splice_efficiency
    if is_spread(devices, n_nodes, largest_node):
        out *= spread_efficiency
    return out


def checkpoint_seconds(checkpoint_gb, gb_per_s: float = CHECKPOINT_GB_PER_S,
                       fixed_s: float = CHECKPOINT_FIXED_S):
    """Returns how long a job with a checkpoint of `checkpoint_gb` GB (a number or an array)
    takes to write it, i.e. how long the devices it gives up stay busy."""
    return fixed_s + checkpoint_gb / gb_per_s


def counts_at_speed(world_size: int, counts, floor: float,
                    splice_efficiency: float = SPLICE_EFFICIENCY) -> tuple[int, ...]:
    """Returns those of `counts` (largest first, as given) on which W=world_size ranks run at
    least `floor` of their ideal speed when packed; (world_size,) if none does (W always
    runs at full speed). Used for the tiers in PolicySettings.floor_speed_tiers."""
    kept = tuple(int(d) for d in counts if speed(int(d), world_size, 1, 1, splice_efficiency) >= floor - 1e-12)
    return kept or (int(world_size),)
