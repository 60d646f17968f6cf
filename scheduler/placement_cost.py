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
"""
from __future__ import annotations

SPLICE_EFFICIENCY = 0.95
SPREAD_EFFICIENCY = 0.9


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
