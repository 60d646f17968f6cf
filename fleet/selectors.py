"""Selectors: reads of the fleet. Everything here aggregates in the database; nothing
loops over devices in Python, so a 100k-accelerator fleet costs a few queries."""
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db.models import Avg, Count, Max, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce

from fleet.models import (
    TELEMETRY_PHYSICAL,
    TELEMETRY_RETENTION,
    Accelerator,
    ClusterTelemetryBucket,
    Node,
    NodeTelemetryBucket,
    TelemetryResolution,
    node_token_hash,
    telemetry_bucket_start,
)

# "Allocated" = some job replica points at the device. The relation is declared by
# jobs.Replica (related_name="replicas"); fleet reads it by name and never imports jobs.
ALLOCATED = Q(replicas__isnull=False)


def node_get_by_token(*, token):
    """Returns the node whose agent token is `token`, or None (unknown or revoked).

    Runs on every agent request: the node row alone, no joins and no ORDER BY (the hash is
    unique in practice); half the CPU of select_related(cluster, region).first(), measured."""
    if not token:
        return None
    # A raw query (the ORM's converters still apply): compiling the filter cost more CPU than the
    # query itself, on every agent request.
    return next(iter(Node.objects.raw(_NODE_BY_TOKEN_SQL, [node_token_hash(token)])), None)


_NODE_BY_TOKEN_SQL = (f"SELECT {', '.join(f.column for f in Node._meta.concrete_fields)} "
                      f"FROM {Node._meta.db_table} WHERE agent_token_hash = %s LIMIT 1")


def node_list(*, filters=None):
    """Returns nodes with their cluster/region, device counts and the number of jobs holding devices
    on them, filtered by any of hostname, region (name), cluster (id), state."""
    filters = filters or {}
    # Correlated subqueries, not Count() over a join: the page's COUNT(*) then skips them
    # (Django strips unused non-aggregate annotations), and only the page's rows pay.
    per_node = Accelerator.objects.filter(node=OuterRef("pk")).order_by().values("node")
    nodes = Node.objects.select_related("cluster", "cluster__region").annotate(
        accelerator_count=Coalesce(Subquery(per_node.annotate(n=Count("id")).values("n")), 0),
        healthy_count=Coalesce(Subquery(per_node.filter(healthy=True).annotate(n=Count("id")).values("n")), 0),
        # what a drain waits for: the jobs whose replicas still point at the node's devices
        jobs_holding_devices=Coalesce(Subquery(per_node.filter(ALLOCATED).annotate(
            n=Count("replicas__job_id", distinct=True)).values("n")), 0),
    )
    if filters.get("hostname"):
        nodes = nodes.filter(hostname=filters["hostname"])
    if filters.get("region"):
        nodes = nodes.filter(cluster__region__name=filters["region"])
    if filters.get("cluster"):
        nodes = nodes.filter(cluster_id=filters["cluster"])
    if filters.get("state"):
        nodes = nodes.filter(state=filters["state"])
    return nodes.order_by("hostname")


def accelerator_list(*, filters=None):
    """Returns accelerators with their node, filtered by any of node (id), type, healthy,
    region (name), cluster (id)."""
    filters = filters or {}
    devices = Accelerator.objects.select_related("node", "node__cluster", "node__cluster__region")
    if filters.get("node"):
        devices = devices.filter(node_id=filters["node"])
    if filters.get("type"):
        devices = devices.filter(type=filters["type"])
    if filters.get("healthy") is not None:
        devices = devices.filter(healthy=filters["healthy"])
    if filters.get("region"):
        devices = devices.filter(node__cluster__region__name=filters["region"])
    if filters.get("cluster"):
        devices = devices.filter(node__cluster_id=filters["cluster"])
    return devices.order_by("node_id", "index")


# What one job's devices may span (settings.MERIDIAN_JOB_MAX_SPREAD) -> the columns that name one
# such group of devices.
_SPREAD_GROUP = {
    "node": ("node_id",),
    "rack": ("node__cluster_id", "node__rack"),
    "cluster": ("node__cluster_id",),
    "region": ("node__cluster__region_id",),
}


def accelerator_type_capacity(*, accelerator_type, spread):
    """Returns the most devices of `accelerator_type` that one job could ever hold: the largest
    count under one node, rack, cluster or region (`spread`, as settings.MERIDIAN_JOB_MAX_SPREAD),
    counting every device whatever its health or its node's state (a lost node may come back).
    0 when the fleet has none of that type. One grouped query."""
    row = (
        Accelerator.objects.filter(type=accelerator_type).order_by()
        .values(*_SPREAD_GROUP[spread]).annotate(n=Count("id")).order_by("-n").first()
    )
    return row["n"] if row else 0


def fleet_summary():
    """Returns the fleet aggregated three ways, in two grouped queries whatever its size:

    {"totals": {accelerators, healthy, allocated, free, nodes, nodes_by_state},
     "by_type": [{type, accelerators, healthy, allocated, free, mean_utilization}],
     "clusters": [{region, cluster_id, cluster, accelerators, healthy, allocated,
                   utilization, nodes, nodes_by_state}]}
    allocated = some replica points at the device; free = healthy, unallocated devices on
    ready nodes; utilization is the mean over the devices that report one (None if none).

    One pass over the devices grouped by (cluster, type), with the allocated set as a
    hashed IN-subquery, then a small node count by (cluster, state); the sums over at most
    clusters × types rows are done in Python. (Separate scans per count cost ~0.7 s at
    100k devices on PostgreSQL; the fleet page refetches this on every live push.)
    """
    usable = Q(healthy=True, node__state=Node.State.READY)
    allocated = Q(id__in=Accelerator.objects.filter(ALLOCATED).values("id"))
    rows = list(
        Accelerator.objects.order_by()
        .values("node__cluster_id", "type")
        .annotate(
            n=Count("id"),
            n_healthy=Count("id", filter=Q(healthy=True)),
            n_usable=Count("id", filter=usable),
            n_allocated=Count("id", filter=allocated),
            n_allocated_usable=Count("id", filter=allocated & usable),
            n_reporting=Count("utilization"),
            mean_utilization=Avg("utilization"),
        )
    )
    by_type, per_cluster = {}, {}
    for row in rows:
        for key, bucket in ((row["type"], by_type), (row["node__cluster_id"], per_cluster)):
            entry = bucket.setdefault(
                key,
                {"accelerators": 0, "healthy": 0, "allocated": 0, "free": 0, "reporting": 0, "utilization_sum": 0.0},
            )
            entry["accelerators"] += row["n"]
            entry["healthy"] += row["n_healthy"]
            entry["allocated"] += row["n_allocated"]
            entry["free"] += row["n_usable"] - row["n_allocated_usable"]
            entry["reporting"] += row["n_reporting"]
            entry["utilization_sum"] += (row["mean_utilization"] or 0.0) * row["n_reporting"]

    def mean(entry):
        return entry["utilization_sum"] / entry["reporting"] if entry["reporting"] else None

    node_rows = (
        Node.objects.order_by()
        .values("cluster_id", "cluster__name", "cluster__region__name", "state")
        .annotate(n=Count("id"))
    )
    clusters = {}
    for row in node_rows:
        entry = clusters.setdefault(
            row["cluster_id"],
            {"region": row["cluster__region__name"], "cluster_id": row["cluster_id"], "cluster": row["cluster__name"],
             "nodes": 0, "nodes_by_state": {s: 0 for s in Node.State.values}},
        )
        entry["nodes"] += row["n"]
        entry["nodes_by_state"][row["state"]] += row["n"]
    for cluster_id, entry in clusters.items():
        devices = per_cluster.get(cluster_id)
        entry.update(
            accelerators=devices["accelerators"] if devices else 0,
            healthy=devices["healthy"] if devices else 0,
            allocated=devices["allocated"] if devices else 0,
            utilization=mean(devices) if devices else None,
        )
    clusters = sorted(clusters.values(), key=lambda e: (e["region"], e["cluster"]))
    types = [
        {"type": name, "accelerators": e["accelerators"], "healthy": e["healthy"], "allocated": e["allocated"],
         "free": e["free"], "mean_utilization": mean(e)}
        for name, e in sorted(by_type.items())
    ]
    nodes_by_state = {s: sum(c["nodes_by_state"][s] for c in clusters) for s in Node.State.values}
    totals = {
        "accelerators": sum(t["accelerators"] for t in types),
        "healthy": sum(t["healthy"] for t in types),
        "allocated": sum(t["allocated"] for t in types),
        "free": sum(t["free"] for t in types),
        "nodes": sum(nodes_by_state.values()),
        "nodes_by_state": nodes_by_state,
    }
    return {"totals": totals, "by_type": types, "clusters": clusters}


# --- telemetry history ---------------------------------------------------------------------------

# Where a series of each scope reads, coarsest first: the rollups the beat task has written,
# then the finer rows it has not rolled up yet (the live edge).
_SERIES_LAYERS = {
    "node": ((NodeTelemetryBucket, TelemetryResolution.HOUR), (NodeTelemetryBucket, TelemetryResolution.MINUTE)),
    "cluster": (
        (ClusterTelemetryBucket, TelemetryResolution.HOUR),
        (ClusterTelemetryBucket, TelemetryResolution.MINUTE),
        (NodeTelemetryBucket, TelemetryResolution.MINUTE),
    ),
}


TELEMETRY_DEFAULT_HOURS = 6
# Longer windows than this default to hourly buckets.
TELEMETRY_MINUTE_WINDOW_HOURS = 24
TELEMETRY_MAX_POINTS = 10_000
RESOLUTION_NAMES = {"minute": TelemetryResolution.MINUTE, "hour": TelemetryResolution.HOUR}


def telemetry_window(*, now, since=None, until=None, hours=None, resolution=None, node_level=False):
    """Returns (since, until, resolution seconds) of a history request, or raises ValidationError
    with a message naming what to change.

    Defaults: until = now, since = until - `hours` (default TELEMETRY_DEFAULT_HOURS), resolution
    "minute" for windows up to TELEMETRY_MINUTE_WINDOW_HOURS whose minutes are still kept, else
    "hour". Refused: `since` with
    `hours`, an empty or reversed window, more than TELEMETRY_MAX_POINTS buckets, and minute
    buckets older than they are kept (`node_level`: a node's minutes, else the clusters').
    """
    if since is not None and hours is not None:
        raise ValidationError({"hours": "give either since or hours, not both"})
    until = until or now
    window_hours = hours if hours is not None else TELEMETRY_DEFAULT_HOURS
    try:
        since = since or until - timedelta(hours=window_hours)
    except OverflowError:  # until near year 1: the window would start before the calendar does
        raise ValidationError({"until": f"until ({until.isoformat()}) is too early for a {window_hours:g} h window"}
                              ) from None
    if since >= until:
        raise ValidationError({"since": f"since ({since.isoformat()}) must be before until ({until.isoformat()})"})
    minutes_kept = TELEMETRY_RETENTION[("node" if node_level else "cluster", TelemetryResolution.MINUTE)]
    minutes_since = now - minutes_kept - timedelta(minutes=1)
    if resolution is None:
        short = until - since <= timedelta(hours=TELEMETRY_MINUTE_WINDOW_HOURS)
        resolution = "minute" if short and since >= minutes_since else "hour"
    seconds = RESOLUTION_NAMES[resolution]
    points = (until - since).total_seconds() / seconds
    if points > TELEMETRY_MAX_POINTS:
        raise ValidationError({"resolution": f"{points:,.0f} {resolution} buckets is too many (at most "
                                             f"{TELEMETRY_MAX_POINTS:,}); shorten the window or ask resolution=hour"})
    if seconds == TelemetryResolution.MINUTE and since < minutes_since:
        raise ValidationError({
            "resolution": f"minute buckets are kept for {minutes_kept.total_seconds() / 3600:g} h"
                          f"{' on a node' if node_level else ''}; ask resolution=hour for older history"
        })
    return since, until, seconds


def _scope_filter(model, *, node_id, cluster_id, region, accelerator_type):
    via_node = "" if model is ClusterTelemetryBucket else "node__"
    scope = Q()
    if node_id is not None:
        scope &= Q(node_id=node_id)
    if cluster_id is not None:
        scope &= Q(**{f"{via_node}cluster_id": cluster_id})
    if region:
        scope &= Q(**{f"{via_node}cluster__region__name": region})
    if accelerator_type:
        scope &= Q(accelerator_type=accelerator_type)
    return scope


def telemetry_series(*, since, until, resolution, node_id=None, cluster_id=None, region=None, accelerator_type=None):
    """Returns the utilization and memory history of a scope as points ordered by time:
    [{"t": bucket start, "utilization_mean", "utilization_max", "memory_used_gb_mean",
      "memory_used_gb_max", "device_samples"}], one per `resolution`-second bucket in
    [since, until) that has readings (buckets without any are absent, not zero).

    Scope: one node (`node_id`), or devices of a cluster (id), a region (name), an accelerator
    type, or any combination; none of them = the whole fleet. Means are over device readings
    (each device's reading counts once per heartbeat); maxima are of single device readings.

    Reads the rollups (cluster rows for every scope but a node, so a fleet-wide day costs
    clusters × types rows per bucket, not nodes × ...) and folds in the finer rows not yet
    rolled up, so the newest bucket is live. A few queries, whatever the fleet size.
    """
    since = telemetry_bucket_start(since, resolution)
    layers = [(m, r) for m, r in _SERIES_LAYERS["node" if node_id is not None else "cluster"] if r <= resolution]
    points = {}
    covered_until = since
    for position, (model, layer_resolution) in enumerate(layers):
        rows = model.objects.filter(resolution=layer_resolution)
        last_layer = position == len(layers) - 1
        if not last_layer:
            # Where this layer's rollups end (across the fleet): the next layer takes over from there.
            newest = rows.aggregate(m=Max("bucket_start"))["m"]
        window_rows = (
            rows.filter(TELEMETRY_PHYSICAL, _scope_filter(model, node_id=node_id, cluster_id=cluster_id, region=region,
                                      accelerator_type=accelerator_type),
                        bucket_start__gte=covered_until, bucket_start__lt=until)
            .order_by()
            .values("bucket_start")
            .annotate(device_samples=Sum("device_samples"), utilization_sum=Sum("utilization_sum"),
                      utilization_max=Max("utilization_max"), memory_used_gb_sum=Sum("memory_used_gb_sum"),
                      memory_used_gb_max=Max("memory_used_gb_max"))
        )
        for row in window_rows:
            point = points.setdefault(telemetry_bucket_start(row["bucket_start"], resolution),
                                      {"device_samples": 0, "utilization_sum": 0.0, "utilization_max": 0.0,
                                       "memory_used_gb_sum": 0.0, "memory_used_gb_max": 0.0})
            point["device_samples"] += row["device_samples"] or 0
            point["utilization_sum"] += row["utilization_sum"] or 0.0
            point["memory_used_gb_sum"] += row["memory_used_gb_sum"] or 0.0
            point["utilization_max"] = max(point["utilization_max"], row["utilization_max"] or 0.0)
            point["memory_used_gb_max"] = max(point["memory_used_gb_max"], row["memory_used_gb_max"] or 0.0)
        if not last_layer and newest is not None:
            covered_until = max(covered_until, newest + timedelta(seconds=int(layer_resolution)))
    series = []
    for start in sorted(points):
        p = points[start]
        if not p["device_samples"]:
            continue
        series.append({
            "t": start,
            "utilization_mean": round(p["utilization_sum"] / p["device_samples"], 4),
            "utilization_max": round(p["utilization_max"], 4),
            "memory_used_gb_mean": round(p["memory_used_gb_sum"] / p["device_samples"], 3),
            "memory_used_gb_max": round(p["memory_used_gb_max"], 3),
            "device_samples": p["device_samples"],
        })
    return series
