"""Selectors: reads of the fleet. Everything here aggregates in the database; nothing
loops over devices in Python, so a 100k-accelerator fleet costs a few queries."""
from django.db.models import Avg, Count, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce

from fleet.models import Accelerator, Node, node_token_hash

# "Allocated" = some job replica points at the device. The relation is declared by
# jobs.Replica (related_name="replicas"); fleet reads it by name and never imports jobs.
ALLOCATED = Q(replicas__isnull=False)


def node_get_by_token(*, token):
    """Returns the node whose agent token is `token`, or None (unknown or revoked)."""
    if not token:
        return None
    return Node.objects.select_related("cluster", "cluster__region").filter(agent_token_hash=node_token_hash(token)).first()


def node_list(*, filters=None):
    """Returns nodes with their cluster/region and device counts, filtered by any of
    region (name), cluster (id), state."""
    filters = filters or {}
    # Correlated subqueries, not Count() over a join: the page's COUNT(*) then skips them
    # (Django strips unused non-aggregate annotations), and only the page's rows pay.
    per_node = Accelerator.objects.filter(node=OuterRef("pk")).order_by().values("node")
    nodes = Node.objects.select_related("cluster", "cluster__region").annotate(
        accelerator_count=Coalesce(Subquery(per_node.annotate(n=Count("id")).values("n")), 0),
        healthy_count=Coalesce(Subquery(per_node.filter(healthy=True).annotate(n=Count("id")).values("n")), 0),
    )
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


def _allocated_accelerators():
    """Returns the devices some replica points at, each once (IN-subquery, no join fan-out)."""
    return Accelerator.objects.filter(id__in=Accelerator.objects.filter(ALLOCATED).values("id"))


def fleet_summary():
    """Returns the fleet aggregated three ways, in five queries whatever its size:

    {"totals": {accelerators, healthy, allocated, free, nodes, nodes_by_state},
     "by_type": [{type, accelerators, healthy, allocated, free}],
     "clusters": [{region, cluster_id, cluster, accelerators, healthy, allocated,
                   utilization, nodes, nodes_by_state}]}
    free = healthy, unallocated devices on ready nodes.
    """
    usable = Q(healthy=True, node__state=Node.State.READY)
    by_type = list(
        Accelerator.objects.order_by()
        .values("type")
        # Aliases differ from field names: an alias "healthy" would shadow the field in later filters.
        .annotate(accelerators=Count("id"), n_healthy=Count("id", filter=Q(healthy=True)), n_usable=Count("id", filter=usable))
        .order_by("type")
    )
    allocated_by_type = {
        row["type"]: row
        for row in _allocated_accelerators().order_by().values("type").annotate(n=Count("id"), n_usable=Count("id", filter=usable))
    }
    for row in by_type:
        allocated = allocated_by_type.get(row["type"], {"n": 0, "n_usable": 0})
        row["healthy"] = row.pop("n_healthy")
        row["allocated"] = allocated["n"]
        row["free"] = row.pop("n_usable") - allocated["n_usable"]
    per_cluster = {
        row["node__cluster_id"]: row
        for row in Accelerator.objects.order_by()
        .values("node__cluster_id")
        .annotate(accelerators=Count("id"), n_healthy=Count("id", filter=Q(healthy=True)), mean_utilization=Avg("utilization"))
    }
    allocated_per_cluster = dict(
        _allocated_accelerators().order_by().values("node__cluster_id").annotate(n=Count("id")).values_list("node__cluster_id", "n")
    )
    node_rows = (
        Node.objects.order_by()
        .values("cluster_id", "cluster__name", "cluster__region__name", "state")
        .annotate(n=Count("id"))
    )
    clusters = {}
    for row in node_rows:
        entry = clusters.setdefault(
            row["cluster_id"],
            {
                "region": row["cluster__region__name"],
                "cluster_id": row["cluster_id"],
                "cluster": row["cluster__name"],
                "nodes": 0,
                "nodes_by_state": {s: 0 for s in Node.State.values},
            },
        )
        entry["nodes"] += row["n"]
        entry["nodes_by_state"][row["state"]] += row["n"]
    for cluster_id, entry in clusters.items():
        devices = per_cluster.get(cluster_id, {})
        entry.update(
            accelerators=devices.get("accelerators", 0),
            healthy=devices.get("n_healthy", 0),
            allocated=allocated_per_cluster.get(cluster_id, 0),
            utilization=devices.get("mean_utilization"),
        )
    clusters = sorted(clusters.values(), key=lambda e: (e["region"], e["cluster"]))
    nodes_by_state = {s: sum(c["nodes_by_state"][s] for c in clusters) for s in Node.State.values}
    totals = {
        "accelerators": sum(t["accelerators"] for t in by_type),
        "healthy": sum(t["healthy"] for t in by_type),
        "allocated": sum(t["allocated"] for t in by_type),
        "free": sum(t["free"] for t in by_type),
        "nodes": sum(nodes_by_state.values()),
        "nodes_by_state": nodes_by_state,
    }
    return {"totals": totals, "by_type": by_type, "clusters": clusters}
