"""Builders for tests and small callers (kueue `MakeWorkload(...).Priority(10).Obj()` style).

    snap = (make_snapshot()
            .fleet(make_fleet().region("eu", clusters=1, racks=1, nodes=2, devices=8))
            .team(make_team("A").quota("H100-80GB", 16))
            .job(make_job("a").team("A").tier(BASIC).ranks(8).running(8))
            .job(make_job("b").team("A").tier(PREMIUM).ranks(8))
            .now(1000.0)
            .build())

Running jobs are placed first-fit in the order they were added (or on the node given with
`.running(d, node=...)`, or on the exact `.on_devices(...)`). `synthetic_fleet` builds large
uniform fleets straight as arrays, for the simulator and the bench.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from scheduler.snapshot import (
    BASIC,
    NO_JOB,
    NODE_READY,
    PENDING,
    RUNNING,
    SPREAD_REGION,
    UNLIMITED,
    Accelerators,
    Jobs,
    PolicySettings,
    Snapshot,
    Teams,
)

DEFAULT_TYPE = "H100-80GB"


class FleetBuilder:
    """Regions of clusters of racks of nodes of devices, all of one type per region call."""

    def __init__(self):
        self._regions: list[tuple] = []

    def region(self, name: str, clusters: int = 1, racks: int = 1, nodes: int = 2, devices: int = 8,
               type: str = DEFAULT_TYPE) -> "FleetBuilder":
        """Adds a region: `clusters` x `racks` (per cluster) x `nodes` (per rack) x `devices`."""
        self._regions.append((name, clusters, racks, nodes, devices, type))
        return self

    def build(self, type_names: list[str]) -> tuple[dict, list[str]]:
        """Returns (accelerator columns, region names); extends type_names with new types."""
        cols: dict[str, list[int]] = {c: [] for c in ("type_id", "node", "rack", "cluster", "region")}
        node = rack = cluster = 0
        names: list[str] = []
        regions = self._regions or [("region-0", 1, 1, 2, 8, DEFAULT_TYPE)]
        for r, (name, n_clusters, n_racks, n_nodes, n_devices, type_name) in enumerate(regions):
            names.append(name)
            if type_name not in type_names:
                type_names.append(type_name)
            type_id = type_names.index(type_name)
            for _ in range(n_clusters):
                for _ in range(n_racks):
                    for _ in range(n_nodes):
                        for _ in range(n_devices):
                            cols["type_id"].append(type_id)
                            cols["node"].append(node)
                            cols["rack"].append(rack)
                            cols["cluster"].append(cluster)
                            cols["region"].append(r)
                        node += 1
                    rack += 1
                cluster += 1
        return cols, names


def make_fleet() -> FleetBuilder:
    return FleetBuilder()


class TeamBuilder:
    def __init__(self, name: str):
        self.name = name
        self.quotas: dict[str, int] = {}
        self.decayed: dict[str, float] = {}
        self.weight_value = 1.0

    def quota(self, type_name: str, devices: int) -> "TeamBuilder":
        self.quotas[type_name] = devices
        return self

    def past_usage(self, type_name: str, decayed_device_seconds: float) -> "TeamBuilder":
        self.decayed[type_name] = decayed_device_seconds
        return self

    def weight(self, weight: float) -> "TeamBuilder":
        self.weight_value = weight
        return self


def make_team(name: str) -> TeamBuilder:
    return TeamBuilder(name)


class JobBuilder:
    """One job; defaults: team of the first team added, Basic, 1 rank, rigid, pending."""

    def __init__(self, name: str):
        self.fields: dict[str, Any] = dict(name=name, team=None, tier=BASIC, type=None, world_size=1, min_devices=0,
                           submit_time=0.0, attained=0.0, ideal=0.0, last_checkpoint_time=-np.inf,
                           last_checkpoint_step=0, checkpoint_bytes=0, last_start_time=-np.inf,
                           last_resize_time=-np.inf, approved=False, denied=False, max_spread=SPREAD_REGION,
                           running=None, node=None, devices=None, id=None)

    def _set(self, **kw) -> "JobBuilder":
        self.fields.update(kw)
        return self

    def team(self, name: str): return self._set(team=name)
    def tier(self, tier: int): return self._set(tier=tier)
    def type(self, type_name: str): return self._set(type=type_name)
    def ranks(self, world_size: int): return self._set(world_size=world_size)
    def id(self, job_id: int): return self._set(id=job_id)

    def elastic(self, min_devices: int):
        """Allows any divisor of W down to min_devices."""
        return self._set(min_devices=min_devices)

    def submitted(self, at: float): return self._set(submit_time=at)

    def attained(self, fraction: float, ideal_device_seconds: float = 1000.0):
        """Sets attained/ideal device-seconds so attained fraction = `fraction`."""
        return self._set(attained=fraction * ideal_device_seconds, ideal=ideal_device_seconds)

    def checkpoint(self, at: float, step: int = 0, size_bytes: int = 0):
        return self._set(last_checkpoint_time=at, last_checkpoint_step=step, checkpoint_bytes=size_bytes)

    def started(self, at: float): return self._set(last_start_time=at)
    def resized(self, at: float): return self._set(last_resize_time=at)
    def approved(self, yes: bool = True): return self._set(approved=yes)
    def denied(self, yes: bool = True): return self._set(denied=yes)
    def spread(self, max_spread: int): return self._set(max_spread=max_spread)

    def running(self, devices: int, node: int | None = None):
        """Makes it RUNNING on `devices` devices, first fit (on `node` if given)."""
        return self._set(running=devices, node=node)

    def on_devices(self, *devices: int):
        """Makes it RUNNING on exactly these accelerator indices."""
        return self._set(running=len(devices), devices=list(devices))

    def build(self) -> "JobBuilder":
        return self


def make_job(name: str) -> JobBuilder:
    return JobBuilder(name)


class SnapshotBuilder:
    def __init__(self):
        self._fleet = FleetBuilder()
        self._teams: list[TeamBuilder] = []
        self._jobs: list[JobBuilder] = []
        self._now = 0.0
        self._settings = PolicySettings()
        self._node_status: dict[int, int] = {}
        self._drained: set[str] = set()
        self._unhealthy: list[int] = []
        self._releasing: dict[int, float] = {}
        self._types: list[str] = []

    def fleet(self, fleet: FleetBuilder) -> "SnapshotBuilder":
        self._fleet = fleet
        return self

    def team(self, team: TeamBuilder) -> "SnapshotBuilder":
        self._teams.append(team)
        return self

    def job(self, job: JobBuilder) -> "SnapshotBuilder":
        self._jobs.append(job)
        return self

    def now(self, now: float) -> "SnapshotBuilder":
        self._now = now
        return self

    def settings(self, **kw) -> "SnapshotBuilder":
        self._settings = PolicySettings(**kw)
        return self

    def node(self, node: int, status: int) -> "SnapshotBuilder":
        self._node_status[node] = status
        return self

    def drain_region(self, name: str) -> "SnapshotBuilder":
        self._drained.add(name)
        return self

    def unhealthy(self, *devices: int) -> "SnapshotBuilder":
        self._unhealthy.extend(devices)
        return self

    def releasing(self, *devices: int, until: float) -> "SnapshotBuilder":
        """Marks free devices as still being released (a previous holder checkpointing) until `until`."""
        self._releasing.update({d: until for d in devices})
        return self

    def types(self, *names: str) -> "SnapshotBuilder":
        """Declares accelerator types up front (e.g. a type no device has)."""
        self._types.extend(n for n in names if n not in self._types)
        return self

    def build(self) -> Snapshot:
        types = list(self._types)
        cols, region_names = self._fleet.build(types)
        for job in self._jobs:
            if job.fields["type"] is not None and job.fields["type"] not in types:
                types.append(job.fields["type"])
        n = len(cols["type_id"])
        holder = np.full(n, NO_JOB, np.int32)
        healthy = np.ones(n, np.bool_)
        healthy[self._unhealthy] = False
        teams = self._teams or [TeamBuilder("team")]
        team_index = {t.name: i for i, t in enumerate(teams)}
        quota = np.full((len(teams), len(types)), UNLIMITED, np.int64)
        decayed = np.zeros((len(teams), len(types)))
        for i, t in enumerate(teams):
            for type_name, q in t.quotas.items():
                quota[i, types.index(type_name)] = q
            for type_name, u in t.decayed.items():
                decayed[i, types.index(type_name)] = u
        type_of_device = np.asarray(cols["type_id"], np.int64)
        node_of_device = np.asarray(cols["node"], np.int64)
        rows: dict[str, list[Any]] = {
            k: [] for k in ("ids", "team", "tier", "type_id", "world_size", "min_devices", "state", "submit_time",
                            "attained", "ideal", "ckpt_time", "ckpt_step", "ckpt_bytes", "start", "resized",
                            "approved", "denied", "spread", "names")}
        for index, job in enumerate(self._jobs):
            f = job.fields
            type_name = f["type"] or (types[0] if types else DEFAULT_TYPE)
            k = types.index(type_name)
            state = PENDING
            if f["running"]:
                state = RUNNING
                if f["devices"] is not None:
                    devs = np.asarray(f["devices"], np.int64)
                else:
                    ok = (holder == NO_JOB) & (type_of_device == k) & healthy
                    if f["node"] is not None:
                        ok &= node_of_device == f["node"]
                    devs = np.flatnonzero(ok)[:f["running"]]
                if len(devs) != f["running"] or (holder[devs] != NO_JOB).any():
                    raise ValueError(f"builder: no room to run job {f['name']} on {f['running']} devices")
                holder[devs] = index
            if f["team"] is not None and f["team"] not in team_index:
                raise ValueError(f"builder: job {f['name']} names unknown team {f['team']}")
            rows["ids"].append(f["id"] if f["id"] is not None else index + 1)
            rows["team"].append(team_index.get(f["team"], 0))
            rows["tier"].append(f["tier"])
            rows["type_id"].append(k)
            rows["world_size"].append(f["world_size"])
            rows["min_devices"].append(f["min_devices"] or f["world_size"])
            rows["state"].append(state)
            rows["submit_time"].append(f["submit_time"])
            rows["attained"].append(f["attained"])
            rows["ideal"].append(f["ideal"])
            rows["ckpt_time"].append(f["last_checkpoint_time"])
            rows["ckpt_step"].append(f["last_checkpoint_step"])
            rows["ckpt_bytes"].append(f["checkpoint_bytes"])
            rows["start"].append(f["last_start_time"])
            rows["resized"].append(f["last_resize_time"])
            rows["approved"].append(f["approved"])
            rows["denied"].append(f["denied"])
            rows["spread"].append(f["max_spread"])
            rows["names"].append(f["name"])
        jobs = Jobs(ids=rows["ids"], team=rows["team"], tier=rows["tier"], type_id=rows["type_id"],
                    world_size=rows["world_size"], min_devices=rows["min_devices"], state=rows["state"],
                    submit_time=rows["submit_time"], attained_device_seconds=rows["attained"],
                    ideal_device_seconds=rows["ideal"], last_checkpoint_time=rows["ckpt_time"],
                    last_checkpoint_step=rows["ckpt_step"], checkpoint_bytes=rows["ckpt_bytes"],
                    last_start_time=rows["start"], last_resize_time=rows["resized"],
                    preemption_approved=rows["approved"],
                    preemption_denied=rows["denied"],
                    max_spread=rows["spread"], names=rows["names"])
        releasing_until = np.full(n, -np.inf)
        for device, until in self._releasing.items():
            releasing_until[device] = until
        acc = Accelerators(type_id=cols["type_id"], node=cols["node"], rack=cols["rack"],
                           cluster=cols["cluster"], region=cols["region"], healthy=healthy, holder=holder,
                           releasing_until=releasing_until)
        n_nodes = int(node_of_device.max()) + 1 if n else 0
        node_status = np.full(n_nodes, NODE_READY, np.int8)
        for node, status in self._node_status.items():
            node_status[node] = status
        drained = np.array([name in self._drained for name in region_names], np.bool_)
        return Snapshot(accelerators=acc, jobs=jobs,
                        teams=Teams(names=[t.name for t in teams], quota=quota, decayed_usage=decayed,
                                    weight=[t.weight_value for t in teams]),
                        now=self._now, type_names=types, region_names=region_names,
                        node_status=node_status, region_drained=drained,
                        settings=self._settings).validate()


def make_snapshot() -> SnapshotBuilder:
    return SnapshotBuilder()


def synthetic_fleet(n_accelerators: int, devices_per_node: int = 8, nodes_per_rack: int = 4,
                    racks_per_cluster: int = 32, clusters_per_region: int = 8,
                    n_types: int = 1) -> Accelerators:
    """Returns a uniform fleet of n_accelerators as arrays (no Python loop per device).

    Types alternate per cluster when n_types > 1 (per rack in fleets with fewer clusters than
    types, per node below that); every device is healthy and free.
    """
    i = np.arange(n_accelerators, dtype=np.int64)
    node = i // devices_per_node
    rack = node // nodes_per_rack
    cluster = rack // racks_per_cluster
    region = cluster // clusters_per_region
    unit = cluster if cluster[-1] + 1 >= n_types else rack if rack[-1] + 1 >= n_types else node
    type_id = (unit % n_types).astype(np.int16)
    return Accelerators(type_id=type_id, node=node, rack=rack, cluster=cluster, region=region)
