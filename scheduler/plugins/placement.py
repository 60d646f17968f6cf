"""Gang placement: all of a job's devices at once, as tightly packed as the fleet allows.

For each allowed count d, largest first (more devices = faster), look for d free devices of
the job's type on one node, else one rack / NVLink domain, else one cluster, else one region,
never across regions and never looser than the job's `max_spread` (or, for a tier in
PolicySettings.packed_tiers, than the tightest level where W fits: `Tick.spread`). Every region is searched
(global scheduling). The first d that fits wins; the job gets all d devices or none. For that
d, the fewest nodes win (scheduler.placement_cost: a gang over more nodes than its size needs
runs at 0.9), and a packed-tier (Premium) job is placed spread out only when no packed
place can be had even by preemption or defragmentation.

`replace` is the partial form the drain step uses: a job keeps the devices it holds on its
healthy nodes and gets only the ones it loses (a draining or lost node, a failed device)
anew, under the same rules.
"""
from __future__ import annotations

import numpy as np

from scheduler.placement_cost import SPREAD_EFFICIENCY, is_spread, min_nodes
from scheduler.snapshot import SPREAD_NAMES
from scheduler.state import LEVELS, Placement

NAME = "place.gang_topology"
REASON_PLACED = "placed"  # a Start: all devices found at once
REASON_NO_ROOM = "no room"  # not enough free devices of its type together
REASON_NO_DEVICES_OF_TYPE = "no devices of type"  # the fleet has no usable device of its type


def describe_level(level: int) -> str:
    return f"one {SPREAD_NAMES[level]}"


class GangPlacement:
    """Finds the largest allowed count that fits, packed node > rack > cluster > region."""

    NAME = NAME

    def place(self, tick, j: int, counts, region=None, blocked_nodes=None):
        """Returns a Placement for job j with len in `counts`, or None. Changes nothing.

        A placement over more nodes than d needs (scheduler.placement_cost) is replaced by one
        on the fewest nodes if one exists; a Premium (packed-tier) job takes no spread
        placement (it would miss its 95% from the first second) until preempting and
        defragmenting could not make a packed one either (`Tick.spread_ok`): then it runs
        spread out rather than wait."""
        jobs = tick.snapshot.jobs
        k, spread = int(jobs.type_id[j]), tick.spread(j)
        state = tick.state
        packed = int(jobs.tier[j]) in tick.snapshot.settings.packed_tiers and j not in tick.spread_ok
        largest = state.max_node_free[k]
        for d in counts:
            placement = state.find(k, d, spread, region=region, blocked_nodes=blocked_nodes)
            if placement is None:
                continue
            if placement.level == 0 or not is_spread(d, state.n_nodes_of(placement.devices), largest):
                return placement
            fewer = state.find_fewest_nodes(k, d, spread, region=region, blocked_nodes=blocked_nodes)
            if fewer is not None:
                return fewer
            if not packed:
                return placement
        return None

    def replace(self, tick, j: int, keep: np.ndarray):
        """Returns a Placement of job j's devices `keep` plus as many free devices as it holds
        besides them (those on a draining or lost node, or failed), or None. Changes nothing.

        The new devices are of the job's type and lie in the one entity that holds `keep` at the
        job's spread level (`Tick.spread`; looser only where the kept devices already span more,
        never looser than its max_spread), so the job stays in its region; the kept nodes are
        filled first, then the tightest place. As in `place`, the fewest nodes win, and a Premium
        (packed-tier) job takes no result that is spread out (more nodes than its size needs):
        None, and the caller searches for the whole job instead. None too when `keep` is empty
        or is all the job holds."""
        state, jobs = tick.state, tick.snapshot.jobs
        held = state.job_devices(j)
        missing = int(held.size) - int(keep.size)
        if keep.size == 0 or missing <= 0:
            return None
        k = int(jobs.type_id[j])
        kept_nodes = np.unique(state.node[keep])
        # the tightest level at which the kept devices share one entity (one region at the latest)
        shared = next((lv for lv in LEVELS if np.unique(state.node_entity[lv][kept_nodes]).size == 1), None)
        if shared is None or max(shared, tick.spread(j)) > int(jobs.max_spread[j]):
            return None  # the kept devices alone already span more than the job may
        level = max(shared, tick.spread(j))
        entity = int(state.node_entity[level][kept_nodes[0]])
        region = int(state.node_region[kept_nodes[0]])
        outside = state.node_entity[level] != entity
        added = state.find(k, missing, level, region=region, blocked_nodes=outside, prefer_nodes=kept_nodes)
        if added is None:
            return None
        devices = np.sort(np.concatenate((keep, added.devices)))
        largest = state.max_node_free[k]
        if is_spread(devices.size, state.n_nodes_of(devices), largest):
            fewer = state.find_fewest_nodes(k, missing, level, region=region, blocked_nodes=outside)
            if fewer is not None and state.n_nodes_of(fewer.devices) < state.n_nodes_of(added.devices):
                devices = np.sort(np.concatenate((keep, fewer.devices)))
            packed = int(jobs.tier[j]) in tick.snapshot.settings.packed_tiers and j not in tick.spread_ok
            if packed and is_spread(devices.size, state.n_nodes_of(devices), largest):
                return None
        nodes = np.unique(state.node[devices])
        tightest = next(lv for lv in LEVELS if np.unique(state.node_entity[lv][nodes]).size == 1)
        return Placement(devices, tightest)

    def start_reason(self, tick, j: int, placement) -> str:
        d = len(placement)
        type_name = tick.snapshot.type_names[int(tick.snapshot.jobs.type_id[j])]
        region = tick.snapshot.region_names[int(tick.state.node_region[tick.state.node[placement.devices[0]]])]
        return f"{d} {type_name} free on {describe_level(placement.level)} in {region}"

    def no_room_reason(self, tick, j: int, counts) -> str:
        jobs = tick.snapshot.jobs
        k, spread = int(jobs.type_id[j]), tick.spread(j)
        type_name = tick.snapshot.type_names[k]
        if tick.type_capacity[k] == 0:
            return f"no usable {type_name} in the fleet"
        d = min(counts)
        most = tick.state.max_free(spread, k)
        if most >= d:  # room, but only spread out: a packed-tier job takes the fewest nodes or waits
            fewest = min_nodes(d, tick.state.max_node_free[k])
            return (f"needs {d} {type_name} on {fewest} node{'s' if fewest > 1 else ''} in "
                    f"{describe_level(spread)}; {most} are free there, but only spread over more nodes "
                    f"(which would run at {SPREAD_EFFICIENCY:.0%} speed)")
        return f"needs {d} {type_name} in {describe_level(spread)}; at most {most} free together"
