"""The mutable working copy a tick plans on: who holds which device, and free counts per level.

Free capacity is kept aggregated per (node, type), (rack, type), (cluster, type) and
(region, type), so finding room for a gang is a few numpy operations over nodes, never a
Python loop over devices. Every change goes through `allocate` / `release`, which keep the
aggregates exact and write a journal so a tentative step (a defragmentation that turns out
impossible) can be rolled back.
"""
from __future__ import annotations

import heapq

import numpy as np

from scheduler.placement_cost import min_nodes
from scheduler.snapshot import (
    NO_JOB,
    NODE_READY,
    SPREAD_NAMES,
    SPREAD_REGION,
    Snapshot,
)

LEVEL_NODE, LEVEL_RACK, LEVEL_CLUSTER, LEVEL_REGION = 0, 1, 2, 3
LEVELS = (LEVEL_NODE, LEVEL_RACK, LEVEL_CLUSTER, LEVEL_REGION)
LEVEL_NAMES = SPREAD_NAMES  # "node", "rack", "cluster", "region"
POOL_RELEASING = "releasing"  # free devices whose last holder is still stopping
POOL_RESERVE = "reserve"  # free devices kept for Premium arrivals


class Placement:
    """Devices found for a job: the chosen devices and the tightest level they share."""

    __slots__ = ("devices", "level")

    def __init__(self, devices: np.ndarray, level: int):
        self.devices = devices  # int64 accelerator indices, ascending
        self.level = level  # LEVEL_NODE .. LEVEL_REGION

    def __len__(self) -> int:
        return int(self.devices.shape[0])


def _first_per_group(group: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    out = np.full(n_groups, -1, np.int64)
    out[group[::-1]] = values[::-1]
    return out


class Topology:
    """What depends only on the fleet's layout (device type, node, rack, cluster, region): the
    entity of each node at each level, devices grouped by node, nodes grouped by entity,
    entities grouped by region. Read-only; shared by every tick over the same fleet."""

    def __init__(self, acc, n_nodes: int):
        self.type_id = _frozen(acc.type_id.astype(np.int64))
        self.node = _frozen(acc.node.astype(np.int64))
        self.n_nodes = n_nodes
        self.node_region = _frozen(_first_per_group(acc.node, acc.region.astype(np.int64), n_nodes))
        node_rack = _first_per_group(acc.node, acc.rack.astype(np.int64), n_nodes)
        node_cluster = _first_per_group(acc.node, acc.cluster.astype(np.int64), n_nodes)
        # entity of each node at each level; nodes without devices get entity 0 (never free)
        self.node_entity = [_frozen(e) for e in (
            np.arange(n_nodes, dtype=np.int64), np.maximum(node_rack, 0),
            np.maximum(node_cluster, 0), np.maximum(self.node_region, 0))]
        self.n_entities = [int(e.max()) + 1 if n_nodes else 0 for e in self.node_entity]
        self.entity_region = []
        for level in LEVELS:
            region = np.zeros(self.n_entities[level], np.int64)
            region[self.node_entity[level]] = np.maximum(self.node_region, 0)
            self.entity_region.append(_frozen(region))

        # devices grouped by node, and nodes grouped by entity, for O(size) lookups
        self.devices_by_node = _frozen(np.argsort(self.node, kind="stable"))
        self.node_device_start = _frozen(np.searchsorted(self.node[self.devices_by_node],
                                                         np.arange(n_nodes + 1)))
        self.nodes_by_entity, self.entity_node_start = [], []
        for level in LEVELS:
            order = np.argsort(self.node_entity[level], kind="stable")
            self.nodes_by_entity.append(_frozen(order))
            self.entity_node_start.append(_frozen(np.searchsorted(self.node_entity[level][order],
                                                                  np.arange(self.n_entities[level] + 1))))
        self.node_device_start_list = self.node_device_start.tolist()
        by_node_type = self.type_id[self.devices_by_node]
        by_node_node = self.node[self.devices_by_node]
        mixed = (by_node_type[1:] != by_node_type[:-1]) & (by_node_node[1:] == by_node_node[:-1])
        single = np.ones(n_nodes, np.bool_)
        single[by_node_node[1:][mixed]] = False
        self.node_single_type = single.tolist()  # one accelerator type on the node
        # entities of each level per region, for region-restricted searches
        self.region_entities = []
        n_regions = self.n_entities[LEVEL_REGION]
        for level in LEVELS:
            order = np.argsort(self.entity_region[level], kind="stable")
            starts = np.searchsorted(self.entity_region[level][order], np.arange(n_regions + 1))
            self.region_entities.append([_frozen(order[starts[r]:starts[r + 1]]) for r in range(n_regions)])
        # scalar lookups in Python lists: faster than numpy item access in per-node loops
        self.entity_list = [e.tolist() for e in self.node_entity]
        self._capacity_key: tuple[np.ndarray, int] | None = None  # (usable mask, type) of the last capacity
        self._capacity: list[np.ndarray] = []

    def capacity(self, usable: np.ndarray, k: int) -> list:
        """Returns capacity[level][entity, type]: usable devices, free or held; the last answer
        is kept (usable changes only when devices fail or nodes drain)."""
        if self._capacity_key is not None and self._capacity_key[1] == k \
                and np.array_equal(self._capacity_key[0], usable):
            return self._capacity
        capacity = []
        use_idx = np.flatnonzero(usable)
        for level in LEVELS:
            ent = self.node_entity[level][self.node[use_idx]]
            counts = np.bincount(ent * k + self.type_id[use_idx], minlength=self.n_entities[level] * k)
            capacity.append(_frozen(counts.reshape(self.n_entities[level], k)))
        self._capacity_key, self._capacity = (usable.copy(), k), capacity
        return capacity


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


_TOPOLOGY_FIELDS = ("type_id", "node", "rack", "cluster", "region")
_last_topology: list = [None, None]  # [key arrays + n_nodes, Topology]: the last fleet seen


def topology_of(snapshot: Snapshot) -> Topology:
    """Returns the Topology of the snapshot's fleet, reusing the previous one when the layout
    arrays are equal (the simulator and the control loop tick over the same fleet again and
    again). A memo, not state: the answer depends only on the arrays' values, which are
    compared in full (copies are kept, so a caller changing its arrays in place is safe)."""
    acc = snapshot.accelerators
    n_nodes = snapshot.node_status.shape[0]
    key, topology = _last_topology
    if key is not None and key[-1] == n_nodes and all(
            np.array_equal(old, getattr(acc, name)) for old, name in zip(key, _TOPOLOGY_FIELDS)):
        return topology
    topology = Topology(acc, n_nodes)
    _last_topology[:] = [tuple(getattr(acc, name).copy() for name in _TOPOLOGY_FIELDS) + (n_nodes,), topology]
    return topology


def forget_topology() -> None:
    """Drops the remembered Topology (benchmarks time the first tick on a fleet with it)."""
    _last_topology[:] = [None, None]


class _PoolKeys:
    """What counting a pool's devices in and out of the free counts needs, computed once per
    tick (a pool's devices do not change within one): the pool's distinct (node, type) pairs,
    each device's pair, and per level above the node the distinct (entity, type) pairs with
    each node pair's index among them."""

    __slots__ = ("nodes", "types", "key_of_device", "levels")

    def __init__(self, devices: np.ndarray, node: np.ndarray, type_id: np.ndarray, k: int, node_entity: list):
        keys, key_of_device = np.unique(node[devices] * k + type_id[devices], return_inverse=True)
        self.nodes, self.types = keys // k, keys % k
        self.key_of_device = key_of_device.reshape(-1)  # index into nodes / types, per pool device
        self.levels: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for level in (LEVEL_RACK, LEVEL_CLUSTER, LEVEL_REGION):
            pairs, key_to_pair = np.unique(node_entity[level][self.nodes] * k + self.types, return_inverse=True)
            self.levels[level] = (pairs // k, pairs % k, key_to_pair.reshape(-1))


class WorkingState:
    """Holder per device plus free counts per topology level and type, updated incrementally."""

    def __init__(self, snapshot: Snapshot):
        acc = snapshot.accelerators
        self.snapshot = snapshot
        self.k = snapshot.n_types
        self.n_jobs = len(snapshot.jobs)
        topology = topology_of(snapshot)
        self.type_id = topology.type_id
        self.node = topology.node
        self.holder = acc.holder.astype(np.int64)
        n_nodes = topology.n_nodes
        node_ok = snapshot.node_status == NODE_READY
        # usable: may be given to a job this tick (healthy, node ready, region not drained)
        self.usable = acc.healthy & node_ok[acc.node] & ~snapshot.region_drained[acc.region]
        self.all_usable = bool(self.usable.all())
        self.free = self.usable & (self.holder == NO_JOB)
        # Free devices still being released (their last holder is checkpointing): kept out of
        # the free counts until a job finds no room without them (`open_releasing`), so jobs
        # land on devices that are free now first.
        # Devices held back the same way: `reserve` (PolicySettings.premium_reserve_devices per
        # region and type, free now, on the nodes with the fewest free devices) is opened
        # only for Premium jobs.
        releasing = self.free & (acc.releasing_until > snapshot.now)
        self.releasing = np.flatnonzero(releasing)  # devices, ascending
        if self.releasing.size:
            self.free &= ~releasing
        settings = snapshot.settings
        # capacity[level][entity, type]: usable devices, free or held (for defragmentation)
        self.capacity = topology.capacity(self.usable, self.k)
        self.reserve = self._pick_reserve(snapshot, topology) \
            if settings.premium_reserve_devices > 0 or settings.premium_reserve_fraction > 0 else np.empty(0, np.int64)
        if self.reserve.size:
            self.free[self.reserve] = False
        self.pools = {POOL_RELEASING: self.releasing, POOL_RESERVE: self.reserve}
        self.open_pools: set = set()
        self._pool_keys: dict[str, _PoolKeys] = {}  # built when a pool is first opened (`_keys_of`)
        self._topology_entity = topology.node_entity

        self.n_nodes = n_nodes
        self.node_region = topology.node_region
        self.node_entity = topology.node_entity
        self.n_entities = topology.n_entities
        self.entity_region = topology.entity_region
        self.devices_by_node = topology.devices_by_node
        self.node_device_start = topology.node_device_start
        self.nodes_by_entity = topology.nodes_by_entity
        self.entity_node_start = topology.entity_node_start
        self._node_device_start_list = topology.node_device_start_list
        self._node_single_type = topology.node_single_type
        self.region_entities = topology.region_entities
        self._entity_list = topology.entity_list

        # free[level][entity, type]
        self.free_count = []
        free_idx = np.flatnonzero(self.free)
        free_node = self.node[free_idx]
        free_type = self.type_id[free_idx]
        for level in LEVELS:
            ent = self.node_entity[level][free_node]
            counts = np.bincount(ent * self.k + free_type, minlength=self.n_entities[level] * self.k)
            self.free_count.append(counts.reshape(self.n_entities[level], self.k).astype(np.int64))

        # best-fit buckets for one-node placement: _buckets[k][c] is a heap of nodes that had
        # c free devices of type k when pushed; stale entries are dropped when seen
        node_free = self.free_count[LEVEL_NODE]
        self.max_node_free = [int(self.capacity[LEVEL_NODE][:, k].max(initial=0)) for k in range(self.k)]
        self._buckets = []
        for k in range(self.k):
            col = node_free[:, k]
            buckets: list[list[int]] = [[] for _ in range(self.max_node_free[k] + 1)]
            nodes = np.flatnonzero(col > 0)
            for c in np.unique(col[nodes]).tolist():
                buckets[c] = np.flatnonzero(col == c).tolist()  # ascending: a valid heap
            self._buckets.append(buckets)

        # per-job device lists: built once from the snapshot, overridden when a job changes
        held = self.holder >= 0
        order = np.flatnonzero(held)[np.argsort(self.holder[held], kind="stable")]
        self._job_order = order
        self._job_start = np.searchsorted(self.holder[order], np.arange(self.n_jobs + 1))
        self._changed: dict[int, np.ndarray] = {}
        self.alloc = np.diff(self._job_start).astype(np.int64)  # devices per job, kept current
        self.journal: list = []
        # bumped by every allocate, release and rollback: equal versions within a tick mean the
        # same holdings (a rollback restores them, but a later change must not reuse its number)
        self.version = 0

    # --- reading -----------------------------------------------------------------------
    def job_devices(self, j: int) -> np.ndarray:
        """Returns the devices job j holds now (ascending)."""
        devs = self._changed.get(j)
        if devs is not None:
            return devs
        return self._job_order[self._job_start[j]:self._job_start[j + 1]]  # ascending already

    def max_free(self, level: int, k: int, region: int | None = None) -> int:
        """Returns the most free devices of type k that one entity of `level` has together."""
        col = self.free_count[level][:, k]
        if region is not None:
            col = col[self.region_entities[level][region]]
        return int(col.max()) if col.size else 0

    def region_free(self, k: int) -> np.ndarray:
        return self.free_count[LEVEL_REGION][:, k]

    # --- finding room ------------------------------------------------------------------
    def find(self, k: int, d: int, max_level: int = SPREAD_REGION, region: int | None = None,
             blocked_nodes: np.ndarray | None = None,
             prefer_nodes: np.ndarray | None = None) -> Placement | None:
        """Returns d free devices of type k at the tightest level possible, or None.

        Tries one node, then one rack, one cluster, one region (never more), up to
        `max_level`. At each level it picks the entity with the fewest free devices that
        still fit (best fit, so big holes stay big), lowest index on ties; within a rack,
        cluster or region it fills the fullest-free nodes first. `region` restricts the
        search; `blocked_nodes` (bool per node) are skipped; `prefer_nodes` (node ids) are
        tried first at the node level and filled first within a rack, cluster or region.
        """
        if d <= 0:
            return Placement(np.empty(0, np.int64), LEVEL_NODE)
        regions = self.free_count[LEVEL_REGION][:, k]
        if blocked_nodes is None:
            if region is None:
                if regions.max(initial=0) < d:
                    return None
            elif regions[region] < d:
                return None
        for level in range(0, max_level + 1):
            placement = self._find_at(level, k, d, region, blocked_nodes, prefer_nodes)
            if placement is not None:
                return placement
        return None

    def _node_free(self, k: int, blocked_nodes) -> np.ndarray:
        col = self.free_count[LEVEL_NODE][:, k]
        if blocked_nodes is not None:
            col = np.where(blocked_nodes, 0, col)
        return col

    def _best_node(self, k: int, d: int) -> int | None:
        """Returns the node with the fewest free devices of type k that are >= d, lowest id."""
        col = self.free_count[LEVEL_NODE][:, k]
        buckets = self._buckets[k]
        for c in range(d, len(buckets)):
            heap = buckets[c]
            while heap and col[heap[0]] != c:
                heapq.heappop(heap)
            if heap:
                return heap[0]
        return None

    def _find_at(self, level, k, d, region, blocked_nodes, prefer_nodes):
        if level == LEVEL_NODE and d > self.max_node_free[k]:
            return None
        if level == LEVEL_NODE and region is None and blocked_nodes is None and prefer_nodes is None:
            node = self._best_node(k, d)
            if node is None:
                return None
            return Placement(self._pick_devices([node], [d], k), LEVEL_NODE)
        if blocked_nodes is None:
            col = self.free_count[level][:, k]
        elif level == LEVEL_NODE:
            col = self._node_free(k, blocked_nodes)
        else:
            node_col = self._node_free(k, blocked_nodes)
            col = np.bincount(self.node_entity[level], weights=node_col,
                              minlength=self.n_entities[level]).astype(np.int64)
        if region is not None:
            scope = self.region_entities[level][region]
            cand = scope[col[scope] >= d]
        else:
            cand = np.flatnonzero(col >= d)
        if cand.size == 0:
            return None
        if prefer_nodes is not None and level == LEVEL_NODE:
            preferred = cand[np.isin(cand, prefer_nodes)]
            if preferred.size:
                cand = preferred
        entity = int(cand[np.argmin(col[cand])])
        if level == LEVEL_NODE:
            return Placement(self._pick_devices([entity], [d], k), LEVEL_NODE)
        start, end = self.entity_node_start[level][entity:entity + 2]
        nodes = self.nodes_by_entity[level][start:end]
        node_free = self._node_free(k, blocked_nodes)[nodes]
        keep = node_free > 0
        nodes, node_free = nodes[keep], node_free[keep]
        if prefer_nodes is not None:
            order = np.lexsort((nodes, -node_free, ~np.isin(nodes, prefer_nodes)))
        else:
            order = np.lexsort((nodes, -node_free))
        nodes, node_free = nodes[order], node_free[order]
        before = np.cumsum(node_free) - node_free
        used = before < d
        nodes, node_free, before = nodes[used], node_free[used], before[used]
        takes = np.minimum(node_free, d - before)
        return Placement(self._pick_devices(nodes.tolist(), takes.tolist(), k), level)

    def n_nodes_of(self, devices: np.ndarray) -> int:
        """Returns how many nodes `devices` span."""
        return int(np.unique(self.node[devices]).size)

    def find_fewest_nodes(self, k: int, d: int, max_level: int, region: int | None = None,
                          blocked_nodes: np.ndarray | None = None) -> Placement | None:
        """Returns d free devices of type k on the fewest nodes the fleet's node size allows
        (scheduler.placement_cost.min_nodes), within one entity of `max_level`, or None.

        `find` fills the best-fitting entity's fullest nodes first, which can take more nodes
        than needed when that entity's free devices are scattered while another entity has
        whole nodes free; this looks at every entity's m fullest nodes (m = min_nodes) and
        takes the entity whose m fullest nodes hold d with the least to spare, lowest index.
        """
        m = min_nodes(d, self.max_node_free[k])
        col = self._node_free(k, blocked_nodes)
        nodes = np.flatnonzero(col > 0)
        if region is not None:
            nodes = nodes[self.node_region[nodes] == region]
        if nodes.size < m:
            return None
        free = col[nodes]
        entity = self.node_entity[max_level][nodes]
        order = np.lexsort((nodes, -free, entity))
        nodes, free, entity = nodes[order], free[order], entity[order]
        first = np.r_[True, entity[1:] != entity[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(entity.size), 0))
        top = (np.arange(entity.size) - start) < m
        sums = np.bincount(entity[top], weights=free[top], minlength=self.n_entities[max_level])
        fits = np.flatnonzero(sums >= d)
        if fits.size == 0:
            return None
        best = int(fits[np.argmin(sums[fits])])
        chosen, chosen_free = nodes[top & (entity == best)], free[top & (entity == best)]
        before = np.cumsum(chosen_free) - chosen_free
        used = before < d
        takes = np.minimum(chosen_free[used], d - before[used])
        level = LEVEL_NODE if m == 1 else max_level
        return Placement(self._pick_devices(chosen[used].tolist(), takes.tolist(), k), level)

    def _pick_devices(self, nodes, takes, k) -> np.ndarray:
        """Returns the first `take` free devices of type k on each node, ascending."""
        picked = []
        starts = self._node_device_start_list
        for node, take in zip(nodes, takes):
            devs = self.devices_by_node[starts[node]:starts[node + 1]]
            if self._node_single_type[node]:
                devs = devs[self.free[devs]]
            else:
                devs = devs[self.free[devs] & (self.type_id[devs] == k)]
            picked.append(devs[:take])
        if len(picked) == 1:
            return picked[0]  # devices_by_node is ascending within a node
        return np.sort(np.concatenate(picked)) if picked else np.empty(0, np.int64)

    # --- devices held back: still being released, or kept for Premium arrivals -------------
    def _pick_reserve(self, snapshot, topology) -> np.ndarray:
        """Returns up to max(premium_reserve_devices, premium_reserve_fraction x usable devices)
        free devices per (region, type), ascending: those on the nodes with the fewest free
        devices (the holes a 1-device job would fill; whole free nodes stay whole for gangs),
        lowest index first."""
        free_idx = np.flatnonzero(self.free)
        if free_idx.size == 0:
            return free_idx
        k = self.k
        settings = snapshot.settings
        usable = self.capacity[LEVEL_REGION].ravel()  # per region * k + type
        limit = np.maximum(settings.premium_reserve_devices,
                           np.floor(usable * settings.premium_reserve_fraction).astype(np.int64))
        key = self.node[free_idx] * k + self.type_id[free_idx]
        node_free = np.bincount(key, minlength=topology.n_nodes * k)[key]
        group = topology.node_region[self.node[free_idx]] * k + self.type_id[free_idx]
        order = np.lexsort((free_idx, node_free, group))
        group = group[order]
        first = np.r_[True, group[1:] != group[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(group.size), 0))
        rank = np.arange(group.size) - start
        return np.sort(free_idx[order][rank < limit[group]])

    def open_pool(self, name: str) -> bool:
        """Counts the held-back devices of pool `name` (POOL_RELEASING, POOL_RESERVE) that are
        still unheld as free; returns False if there are none or the pool is open already.
        Not journaled: what a rollback restores is still right (the devices are unheld).
        Costs O(pool) numpy work plus one heap push per node whose count changes."""
        pool = self.pools[name]
        if name in self.open_pools or pool.size == 0:
            return False
        back = (self.holder[pool] == NO_JOB) & ~self.free[pool]
        self.free[pool[back]] = True
        self._count_pool(self._keys_of(name), back, +1)
        self.open_pools.add(name)
        return True

    def _keys_of(self, name: str) -> "_PoolKeys":
        """Returns pool `name`'s (entity, type) pairs, computed once per tick (most ticks open
        no pool)."""
        keys = self._pool_keys.get(name)
        if keys is None:
            keys = self._pool_keys[name] = _PoolKeys(self.pools[name], self.node, self.type_id, self.k,
                                                     self._topology_entity)
        return keys

    def close_pools(self, names=None) -> None:
        """Takes the held-back devices still free out of the free counts again: those of every
        open pool, or of the pools `names` only."""
        if not self.open_pools:
            return
        for name in sorted(self.open_pools if names is None else self.open_pools & set(names)):
            pool = self.pools[name]
            hide = self.free[pool]
            self.free[pool[hide]] = False
            self._count_pool(self._keys_of(name), hide, -1)
            self.open_pools.discard(name)

    def _count_pool(self, keys: "_PoolKeys", chosen: np.ndarray, sign: int) -> None:
        """Adds sign per device of a pool (`chosen`: bool per pool device) to the free counts of
        its node, rack, cluster and region: what `_count` does, in whole-array steps over the
        pool's (entity, type) pairs computed once, instead of a Python step per node."""
        per_key = np.bincount(keys.key_of_device[chosen], minlength=keys.nodes.size)
        touched = np.flatnonzero(per_key)
        if touched.size == 0:
            return
        delta = sign * per_key[touched]
        nodes, types = keys.nodes[touched], keys.types[touched]
        node_free = self.free_count[LEVEL_NODE]
        node_free[nodes, types] += delta  # (node, type) pairs are distinct: no lost updates
        for level in (LEVEL_RACK, LEVEL_CLUSTER, LEVEL_REGION):
            entities, types_at, key_to_pair = keys.levels[level]
            per_pair = np.bincount(key_to_pair[touched], weights=delta, minlength=entities.size).astype(np.int64)
            self.free_count[level][entities, types_at] += per_pair
        new = node_free[nodes, types]
        buckets = self._buckets
        for node, k, c in zip(nodes.tolist(), types.tolist(), new.tolist()):
            if c > 0:
                heapq.heappush(buckets[k][c], node)

    # --- changing ----------------------------------------------------------------------
    def _count(self, devs: np.ndarray, sign: int) -> None:
        """Adds sign per device to the free counts of its node, rack, cluster and region."""
        if devs.size == 0:
            return
        nodes, types = self.node[devs], self.type_id[devs]
        if devs.size == 1 or ((nodes == nodes[0]).all() and (types == types[0]).all()):
            groups = [(int(nodes[0]), int(types[0]), int(devs.size))]
        else:
            keys, counts = np.unique(nodes * self.k + types, return_counts=True)
            groups = [(key // self.k, key % self.k, c) for key, c in zip(keys.tolist(), counts.tolist())]
        node_free = self.free_count[LEVEL_NODE]
        for node, k, c in groups:
            delta = sign * c
            new = int(node_free[node, k]) + delta
            node_free[node, k] = new
            for level in (LEVEL_RACK, LEVEL_CLUSTER, LEVEL_REGION):
                self.free_count[level][self._entity_list[level][node], k] += delta
            if new > 0:
                heapq.heappush(self._buckets[k][new], node)

    def allocate(self, j: int, devs: np.ndarray) -> None:
        """Gives free devices `devs` to job j (adding to what it holds)."""
        devs = np.asarray(devs, np.int64)
        if devs.size == 0:
            return
        if not self.free[devs].all():
            raise AssertionError(f"allocate: job {j} asked for a device that is not free")
        self.journal.append(("allocate", j, devs, self.job_devices(j)))
        self.version += 1
        self.holder[devs] = j
        self.free[devs] = False
        self._count(devs, -1)
        self._changed[j] = np.sort(np.concatenate((self.job_devices(j), devs)))
        self.alloc[j] += devs.size

    def release(self, j: int, devs: np.ndarray) -> None:
        """Takes devices `devs` from job j; usable ones become free."""
        devs = np.asarray(devs, np.int64)
        if devs.size == 0:
            return
        if not (self.holder[devs] == j).all():
            raise AssertionError(f"release: job {j} does not hold all these devices")
        self.journal.append(("release", j, devs, self.job_devices(j)))
        self.version += 1
        self.holder[devs] = NO_JOB
        back = devs[self.usable[devs]]
        self.free[back] = True
        self._count(back, +1)
        current = self.job_devices(j)
        self._changed[j] = (np.empty(0, np.int64) if devs.size == current.size
                            else current[~np.isin(current, devs)])
        self.alloc[j] -= devs.size

    def mark(self) -> int:
        """Returns a journal position to roll back to."""
        return len(self.journal)

    def rollback(self, mark: int) -> None:
        """Undoes every allocate/release made since `mark`, newest first."""
        if len(self.journal) > mark:
            self.version += 1
        while len(self.journal) > mark:
            op, j, devs, before = self.journal.pop()
            if op == "allocate":
                self.holder[devs] = NO_JOB
                self.free[devs] = True
                self._count(devs, +1)
                self.alloc[j] -= devs.size
            else:
                self.holder[devs] = j
                back = devs[self.usable[devs]]
                self.free[back] = False
                self._count(back, -1)
                self.alloc[j] += devs.size
            self._changed[j] = before
