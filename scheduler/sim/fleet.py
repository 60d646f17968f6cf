"""Fleet descriptions for the simulator: nodes with their accelerators, racks (NVLink /
network domains), clusters and regions.

`philly()` is the default fleet for the Philly replay. Philly ran 2-GPU and 8-GPU servers
(Jeon et al., ATC'19); the whole Philly reported about 420-550 servers at a time, but the
82,247-job list in ../shared/traces/philly is a subset (the Pollux/Sia derivation) whose
offered load averages 374 busy GPUs over its 109 days (peaks of >1,300 in a day). A fleet of
480 servers would leave that subset uncontended (~13% busy) and every policy would tie, so
the default keeps Philly's server shapes and sizes the fleet to the subset's load: 60 8-GPU
plus 40 2-GPU servers = 560 GPUs (67% offered load on average), in racks of 10 servers, one
cluster, one region. `philly(servers_8=..., servers_2=...)` builds any other size, e.g. the
full 480-server fleet (`--fleet philly-full`).

`planet(devices)` builds synthetic planet-scale fleets of 8-GPU nodes, 16 nodes a rack,
64 racks a cluster, spread over regions of at most 4 clusters.

Heterogeneous fleets: every node carries one accelerator type (`node_type`, an index into
`type_names`); a job asks for one type (`Trace.type_id`) and runs only on devices of it.
`philly-hetero` is the default Philly fleet with its 8-GPU servers split into 30 V100 and 30
P100 servers and its 2-GPU servers K80 (Philly ran several GPU generations; the split is an
assumption, the trace does not record types). `region_capacity()` says how many devices of
each type one job could ever hold (its devices never span regions).
"""
from __future__ import annotations

import dataclasses

import numpy as np

DEFAULT_ACCELERATOR = "P100-16GB"


class FleetError(ValueError):
    """The fleet description is unusable; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Fleet:
    """Per-node arrays; devices are numbered node by node (node 0's devices first)."""

    name: str
    node_devices: np.ndarray   # int32, accelerators per node
    node_rack: np.ndarray      # int32
    node_cluster: np.ndarray   # int32
    node_region: np.ndarray    # int32
    accelerator: str = DEFAULT_ACCELERATOR  # the type name of a one-type fleet
    node_type: np.ndarray | None = None  # int16, index into type_names; None = all `accelerator`
    type_names: tuple = ()  # accelerator type names; () = (accelerator,)

    def __post_init__(self):
        n = self.node_devices.shape[0]
        if not self.type_names:
            object.__setattr__(self, "type_names", (self.accelerator,))
        if self.node_type is None:
            object.__setattr__(self, "node_type", np.zeros(n, dtype=np.int16))
        if self.node_type.shape[0] != n:
            raise FleetError("node_type must have one entry per node")
        if n and (self.node_type.min() < 0 or self.node_type.max() >= len(self.type_names)):
            raise FleetError(f"node_type must index type_names {self.type_names}")
        if n == 0:
            raise FleetError("a fleet needs at least one node")
        if (self.node_devices < 1).any():
            raise FleetError("every node needs at least one accelerator")
        for name in ("node_rack", "node_cluster", "node_region"):
            if getattr(self, name).shape[0] != n:
                raise FleetError(f"{name} must have one entry per node")

    @property
    def n_nodes(self):
        return int(self.node_devices.shape[0])

    @property
    def n_devices(self):
        return int(self.node_devices.sum())

    @property
    def device_node(self):
        return np.repeat(np.arange(self.n_nodes, dtype=np.int32), self.node_devices)

    @property
    def node_first_device(self):
        return np.concatenate([[0], np.cumsum(self.node_devices)[:-1]]).astype(np.int64)

    def region_capacity(self):
        """Returns, per accelerator type, the most devices of it in one region: the most one
        job of that type could ever hold (int64[types])."""
        regions = int(self.node_region.max()) + 1
        per = np.zeros((len(self.type_names), regions), dtype=np.int64)
        np.add.at(per, (self.node_type, self.node_region), self.node_devices)
        return per.max(axis=1)


def uniform(n_nodes, devices_per_node, nodes_per_rack=None, name=None):
    """Returns n_nodes identical nodes in one cluster and region (small tests)."""
    per_rack = nodes_per_rack or n_nodes
    idx = np.arange(n_nodes, dtype=np.int32)
    return Fleet(
        name=name or f"{n_nodes}x{devices_per_node}",
        node_devices=np.full(n_nodes, devices_per_node, dtype=np.int32),
        node_rack=idx // per_rack,
        node_cluster=np.zeros(n_nodes, dtype=np.int32),
        node_region=np.zeros(n_nodes, dtype=np.int32),
    )


def philly(servers_8=60, servers_2=40, servers_per_rack=10, name=None):
    """Returns a Philly-shaped fleet (see the module docstring for the default size)."""
    devices = np.array([8] * servers_8 + [2] * servers_2, dtype=np.int32)
    n = devices.shape[0]
    idx = np.arange(n, dtype=np.int32)
    return Fleet(
        name=name or f"philly-{servers_8}x8+{servers_2}x2",
        node_devices=devices,
        node_rack=idx // servers_per_rack,
        node_cluster=np.zeros(n, dtype=np.int32),
        node_region=np.zeros(n, dtype=np.int32),
    )


def planet(devices, devices_per_node=8, nodes_per_rack=16, racks_per_cluster=64,
           clusters_per_region=4, name=None):
    """Returns a synthetic planet-scale fleet of about `devices` accelerators."""
    n_nodes = max(1, -(-int(devices) // devices_per_node))
    idx = np.arange(n_nodes, dtype=np.int32)
    rack = idx // nodes_per_rack
    cluster = rack // racks_per_cluster
    return Fleet(
        name=name or f"planet-{n_nodes * devices_per_node}",
        node_devices=np.full(n_nodes, devices_per_node, dtype=np.int32),
        node_rack=rack,
        node_cluster=cluster,
        node_region=cluster // clusters_per_region,
    )


def philly_hetero():
    """Returns the default Philly fleet with three accelerator types (module docstring)."""
    base = philly()
    node_type = np.array([0] * 30 + [1] * 30 + [2] * 40, dtype=np.int16)
    return dataclasses.replace(base, name="philly-hetero-30xV100x8+30xP100x8+40xK80x2", node_type=node_type,
                               type_names=("V100-16GB", "P100-16GB", "K80-12GB"), accelerator="V100-16GB")


def by_name(name):
    """Returns a named fleet: 'philly', 'philly-hetero', 'philly-full' (480 servers) or 'planet-N'."""
    if name == "philly":
        return philly()
    if name == "philly-hetero":
        return philly_hetero()
    if name == "philly-full":
        # 480 servers, inside the 420-550 the trace README quotes; the 2-/8-GPU split is
        # not published, so half and half.
        return philly(servers_8=240, servers_2=240, name="philly-full-240x8+240x2")
    if name.startswith("planet-"):
        try:
            return planet(int(name.split("-", 1)[1]))
        except ValueError:
            pass
    raise FleetError(f"unknown fleet {name!r}: use philly, philly-hetero, philly-full or planet-<devices> "
                     "(e.g. planet-100000)")
