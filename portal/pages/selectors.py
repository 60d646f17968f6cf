"""Reads for the dashboard pages that the fleet and jobs selectors do not offer.

Everything that touches devices aggregates in the database (values/annotate): the
fleet page of a 100,000-accelerator fleet costs a handful of grouped queries and
never a row per device in Python or in the HTML.

Heatmap levels (the page drills down on click):
  fleet    one cell per cluster, rows = regions          (fleet.selectors.fleet_summary's clusters)
  cluster  one cell per node of a cluster, or per rack when the cluster has more
           than MAX_HEATMAP_CELLS nodes
  node     one cell per device of a node
"""
import math

from django.db.models import Avg, Count, Q
from django.utils import timezone

from fleet.models import Accelerator, Cluster, Node
from fleet.selectors import fleet_summary, telemetry_series, telemetry_window
from jobs.models import Job, JobEvent, PreemptionRequest, Replica
from jobs.selectors import team_ids_for_user

# More cells than this and a heatmap stops being readable on a laptop screen:
# the cluster level then aggregates nodes by rack.
MAX_HEATMAP_CELLS = 2048
HEATMAP_COLUMNS = 32
NODES_ATTENTION_LIMIT = 50


def _fraction(part, whole):
    return round(part / whole, 4) if whole else None


def _allocated_ids():
    """Returns a subquery of the ids of devices some replica points at (each once)."""
    return Replica.objects.filter(device__isnull=False).values("device_id")


def fleet_nodes_needing_attention(*, limit=NODES_ATTENTION_LIMIT):
    """Returns (count, [node dicts]) of nodes draining or lost, the lost first."""
    nodes = Node.objects.filter(state__in=[Node.State.DRAINING, Node.State.LOST])
    total = nodes.count()
    rows = list(
        nodes.order_by("state", "hostname").values(
            "id", "hostname", "state", "last_heartbeat", "cluster__name", "cluster__region__name"
        )[:limit]
    )
    # "lost" sorts after "draining"; lost nodes matter more.
    rows.sort(key=lambda r: (r["state"] != Node.State.LOST, r["hostname"]))
    return total, rows


def _grid(cells, columns):
    """Lays `cells` (dicts with value fields) out row-major in `columns` columns."""
    columns = max(1, min(columns, len(cells) or 1))
    rows = math.ceil(len(cells) / columns) if cells else 0
    return columns, rows


def heatmap_fleet(*, summary):
    """Returns the fleet-level heatmap: rows = regions, columns = clusters of each region."""
    regions = sorted({c["region"] for c in summary["clusters"]})
    by_region = {r: [c for c in summary["clusters"] if c["region"] == r] for r in regions}
    width = max((len(cs) for cs in by_region.values()), default=0)
    allocated, used, text, ids = [], [], [], []
    for region in regions:
        clusters = by_region[region] + [None] * (width - len(by_region[region]))
        allocated.append([_fraction(c["allocated"], c["healthy"]) if c else None for c in clusters])
        used.append([round(c["utilization"], 4) if c and c["utilization"] is not None else None for c in clusters])
        ids.append([c["cluster_id"] if c else None for c in clusters])
        text.append(
            [
                f"{region}/{c['cluster']}: {c['allocated']}/{c['healthy']} healthy devices allocated, "
                f"{c['nodes']} nodes ({c['nodes_by_state'].get('draining', 0)} draining, "
                f"{c['nodes_by_state'].get('lost', 0)} lost)"
                if c else ""
                for c in clusters
            ]
        )
    return {
        "level": "fleet",
        "title": "Fleet: regions × clusters",
        "x": [f"cluster {i + 1}" for i in range(width)],
        "y": regions,
        "allocated": allocated,
        "used": used,
        "text": text,
        "ids": ids,
        "drill": "cluster",
        "breadcrumbs": [{"label": "Fleet", "query": ""}],
    }


def heatmap_cluster(*, cluster_id):
    """Returns the heatmap of one cluster: a cell per node (per rack when it has too many),
    or None when the cluster does not exist."""
    cluster = Cluster.objects.select_related("region").filter(pk=cluster_id).first()
    if cluster is None:
        return None
    devices = Accelerator.objects.filter(node__cluster_id=cluster.pk).order_by()
    healthy_allocated = Q(healthy=True, id__in=_allocated_ids())
    node_count = Node.objects.filter(cluster_id=cluster.pk).count()
    by_rack = node_count > MAX_HEATMAP_CELLS
    key = "node__rack" if by_rack else "node_id"
    rows = list(
        devices.values(key)
        .annotate(
            total=Count("id"),
            healthy_n=Count("id", filter=Q(healthy=True)),
            allocated_n=Count("id", filter=healthy_allocated),
            mean_utilization=Avg("utilization"),
        )
        .order_by(key)
    )
    if by_rack:
        cells = [
            {
                "id": None,
                "label": f"rack {row['node__rack'] or '(none)'}",
                "allocated": _fraction(row["allocated_n"], row["healthy_n"]),
                "used": row["mean_utilization"],
                "detail": f"{row['allocated_n']}/{row['healthy_n']} healthy devices allocated",
            }
            for row in rows
        ]
    else:
        nodes = {
            n["id"]: n for n in Node.objects.filter(cluster_id=cluster.pk).values("id", "hostname", "state")
        }
        stats = {row["node_id"]: row for row in rows}
        cells = []
        for node_id in sorted(nodes, key=lambda i: nodes[i]["hostname"]):
            row = stats.get(node_id, {"allocated_n": 0, "healthy_n": 0, "mean_utilization": None})
            node = nodes[node_id]
            cells.append(
                {
                    "id": node_id,
                    "label": node["hostname"],
                    "allocated": _fraction(row["allocated_n"], row["healthy_n"]),
                    "used": row["mean_utilization"],
                    "detail": (
                        f"{row['allocated_n']}/{row['healthy_n']} healthy devices allocated; node {node['state']}"
                    ),
                }
            )
    heatmap = _cells_to_heatmap(cells, drill=None if by_rack else "node")
    heatmap.update(
        level="cluster",
        title=f"Cluster {cluster.region.name}/{cluster.name}: " + ("racks" if by_rack else "nodes"),
        breadcrumbs=[
            {"label": "Fleet", "query": ""},
            {"label": f"{cluster.region.name}/{cluster.name}", "query": f"cluster={cluster.pk}"},
        ],
    )
    return heatmap


def heatmap_node(*, node_id, user):
    """Returns the heatmap of one node: a cell per device, naming the jobs on it when the
    user may see them; None when the node does not exist."""
    node = Node.objects.select_related("cluster", "cluster__region").filter(pk=node_id).first()
    if node is None:
        return None
    visible_teams = set(team_ids_for_user(user))
    placements = {}
    for device_id, job_id, job_name, team_id in Replica.objects.filter(device__node_id=node.pk).values_list(
        "device_id", "job_id", "job__name", "job__team_id"
    ):
        label = f"#{job_id} {job_name}" if team_id in visible_teams else "another team's job"
        placements.setdefault(device_id, set()).add(label)
    cells = []
    for device in Accelerator.objects.filter(node_id=node.pk).order_by("index").values(
        "id", "index", "type", "healthy", "utilization"
    ):
        jobs = sorted(placements.get(device["id"], ()))
        cells.append(
            {
                "id": device["id"],
                "label": f"{node.hostname}:{device['index']} {device['type']}",
                "allocated": (1.0 if jobs else 0.0) if device["healthy"] else None,
                "used": device["utilization"],
                "detail": ("unhealthy; " if not device["healthy"] else "") + (", ".join(jobs) or "free"),
            }
        )
    heatmap = _cells_to_heatmap(cells, drill=None, columns=max(8, min(HEATMAP_COLUMNS, len(cells))))
    heatmap.update(
        level="node",
        title=f"Node {node.hostname} ({node.state}): devices",
        breadcrumbs=[
            {"label": "Fleet", "query": ""},
            {"label": f"{node.cluster.region.name}/{node.cluster.name}", "query": f"cluster={node.cluster_id}"},
            {"label": node.hostname, "query": f"node={node.pk}"},
        ],
    )
    return heatmap


def _cells_to_heatmap(cells, *, drill, columns=HEATMAP_COLUMNS):
    columns, rows = _grid(cells, columns)
    allocated = [[None] * columns for _ in range(rows)]
    used = [[None] * columns for _ in range(rows)]
    text = [[""] * columns for _ in range(rows)]
    ids = [[None] * columns for _ in range(rows)]
    for i, cell in enumerate(cells):
        r, c = divmod(i, columns)
        allocated[r][c] = cell["allocated"]
        used[r][c] = round(cell["used"], 4) if cell["used"] is not None else None
        text[r][c] = f"{cell['label']}: {cell['detail']}"
        ids[r][c] = cell["id"]
    return {
        "x": [str(c) for c in range(columns)],
        "y": [str(r) for r in range(rows)],
        "allocated": allocated,
        "used": used,
        "text": text,
        "ids": ids,
        "drill": drill,
    }


def fleet_utilization_history(*, now, cluster_id=None, node_id=None):
    """Returns the fleet page's utilization-over-time chart for the level shown (the fleet, one
    cluster or one node): the default window (telemetry_window) by minute, points as JSON-able
    dicts, and the API query that fetches other windows of the same scope."""
    since, until, resolution = telemetry_window(now=now, node_level=node_id is not None)
    points = telemetry_series(since=since, until=until, resolution=resolution, node_id=node_id, cluster_id=cluster_id)
    scope = f"node={node_id}" if node_id is not None else (f"cluster={cluster_id}" if cluster_id is not None else "")
    return {
        "since": since.isoformat(),
        "until": until.isoformat(),
        "resolution_seconds": resolution,
        "scope_query": scope,
        "points": [{**p, "t": p["t"].isoformat()} for p in points],
    }


def fleet_page_data(*, user, cluster_id=None, node_id=None):
    """Returns everything the fleet page draws (also its live JSON), or None when the
    asked-for cluster or node does not exist."""
    summary = fleet_summary()
    if node_id is not None:
        heatmap = heatmap_node(node_id=node_id, user=user)
    elif cluster_id is not None:
        heatmap = heatmap_cluster(cluster_id=cluster_id)
    else:
        heatmap = heatmap_fleet(summary=summary)
    if heatmap is None:
        return None
    by_type = [
        {
            **row,
            "unavailable": row["accelerators"] - row["allocated"] - row["free"],
            "allocated_fraction": _fraction(row["allocated"], row["healthy"]),
            "used_fraction": round(row["mean_utilization"], 4) if row["mean_utilization"] is not None else None,
        }
        for row in summary["by_type"]
    ]
    attention_total, attention = fleet_nodes_needing_attention()
    totals = summary["totals"]
    history = fleet_utilization_history(now=timezone.now(), cluster_id=cluster_id, node_id=node_id)
    return {
        "utilization_history": history,
        "totals": {**totals, "allocated_fraction": _fraction(totals["allocated"], totals["healthy"])},
        "by_type": by_type,
        "heatmap": heatmap,
        "attention_total": attention_total,
        "attention": [
            {**n, "last_heartbeat": n["last_heartbeat"].isoformat() if n["last_heartbeat"] else None} for n in attention
        ],
    }


# --- jobs --------------------------------------------------------------------------------

STATE_COLORS = {
    "pending": "#9aa4b5",
    "scheduled": "#7fb3ff",
    "running": "#2e9b4f",
    "preempting": "#e6a23c",
    "preempted": "#d9822b",
    "migrating": "#8a63d2",
    "resizing": "#3aa6b9",
    "succeeded": "#1f6f3a",
    "failed": "#b3261e",
    "cancelled": "#5b6475",
}
MARKER_TYPES = {
    JobEvent.Type.CHECKPOINTED,
    JobEvent.Type.RESTORED,
    JobEvent.Type.PREEMPTION_REQUESTED,
    JobEvent.Type.PREEMPTION_APPROVED,
    JobEvent.Type.PREEMPTION_DENIED,
    JobEvent.Type.PREEMPTION_EXPIRED,
    JobEvent.Type.NODE_LOST,
    JobEvent.Type.CANCEL_REQUESTED,
}
PLACEMENT_TYPES = {JobEvent.Type.PLACED, JobEvent.Type.MIGRATED, JobEvent.Type.RESIZED}


def _placement_label(event, hostnames):
    """Returns "host-a, host-b (8 devices)" for a placed / migrated / resized event; the
    control loop writes node ids under "nodes" and device ids under "devices"."""
    extra = event.extra_data or {}
    devices = extra.get("devices", extra.get("to_devices"))
    device_count = len(devices) if isinstance(devices, list) else devices
    nodes = extra.get("nodes") or extra.get("hosts") or []
    nodes = nodes if isinstance(nodes, list) else [nodes]
    names = [hostnames.get(n, str(n)) if isinstance(n, int) else str(n) for n in nodes]
    shown = ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
    if shown and device_count:
        return f"{shown} ({device_count} devices)"
    if shown:
        return shown
    if device_count:
        return f"{device_count} devices"
    return event.reason or event.get_type_display()


def _placement_hostnames(events):
    node_ids = {
        n
        for e in events
        if e.type in PLACEMENT_TYPES
        for n in ((e.extra_data or {}).get("nodes") or [])
        if isinstance(n, int)
    }
    return dict(Node.objects.filter(pk__in=node_ids).values_list("id", "hostname")) if node_ids else {}


def job_timeline(*, job, events, now=None):
    """Returns the job's Gantt: {"segments": [{lane, label, state, start, end, color}],
    "markers": [{label, at, type}]} built from its JobEvents (oldest first).

    Lane "state": one segment per state from each state change to the next (the last
    one open until now, or until finished_at). Lane "placement": from each placed /
    migrated / resized event until the next one, or until the job releases its devices.
    """
    now = now or timezone.now()
    end_of_time = job.finished_at or now
    segments, markers = [], []
    state_start, state = job.submitted_at, Job.State.PENDING
    placement = None  # (label, start)
    events = list(events)
    hostnames = _placement_hostnames(events)

    def close_placement(at):
        nonlocal placement
        if placement is not None:
            segments.append(
                {
                    "lane": "placement", "label": placement[0], "state": "placed",
                    "start": placement[1], "end": at, "color": "#4c78a8",
                }
            )
            placement = None

    for event in events:
        if event.type == JobEvent.Type.STATE_CHANGED and event.to_state:
            if event.created_at > state_start or segments == []:
                segments.append(
                    {
                        "lane": "state", "label": state, "state": state, "start": state_start,
                        "end": event.created_at, "color": STATE_COLORS.get(state, "#888"),
                    }
                )
            state, state_start = event.to_state, event.created_at
            if state in Job.WAITING_STATES or state in Job.TERMINAL_STATES:
                close_placement(event.created_at)
        elif event.type in PLACEMENT_TYPES:
            close_placement(event.created_at)
            placement = (_placement_label(event, hostnames), event.created_at)
        elif event.type == JobEvent.Type.RELEASED:
            close_placement(event.created_at)
        if event.type in MARKER_TYPES:
            label = event.get_type_display()
            if event.type == JobEvent.Type.CHECKPOINTED and (event.extra_data or {}).get("step") is not None:
                label += f" at step {event.extra_data['step']}"
            markers.append({"label": label, "at": event.created_at, "type": event.type})
    segments.append(
        {
            "lane": "state", "label": state, "state": state, "start": state_start,
            "end": max(end_of_time, state_start), "color": STATE_COLORS.get(state, "#888"),
        }
    )
    close_placement(max(end_of_time, placement[1]) if placement else end_of_time)
    # A job that holds devices now but whose placement events the control loop did not
    # write still shows where it runs: name the nodes from its replicas.
    if job.device_count and not any(s["lane"] == "placement" for s in segments):
        hosts = sorted(
            set(
                Replica.objects.filter(job=job, device__isnull=False).values_list("device__node__hostname", flat=True)
            )
        )
        if hosts:
            shown = ", ".join(hosts[:3]) + (f" +{len(hosts) - 3}" if len(hosts) > 3 else "")
            segments.append(
                {"lane": "placement", "label": f"{shown} ({job.device_count} devices)", "state": "placed",
                 "start": job.last_started_at or job.state_changed_at, "end": end_of_time, "color": "#4c78a8"}
            )
    for item in segments:
        item["start"], item["end"] = item["start"].isoformat(), item["end"].isoformat()
    for item in markers:
        item["at"] = item["at"].isoformat()
    return {"segments": segments, "markers": markers}


def job_place_in_line(*, job):
    """Returns (position, source) for a waiting job: the scheduler's queue_position when
    the control loop has set it, else the 1-based rank by submission among the waiting
    jobs of its accelerator type ("submission order"); (None, None) when not waiting."""
    if job.state not in Job.WAITING_STATES:
        return None, None
    if job.queue_position is not None:
        return job.queue_position, "scheduler"
    ahead = (
        Job.objects.filter(state__in=Job.WAITING_STATES, accelerator_type=job.accelerator_type)
        .filter(Q(submitted_at__lt=job.submitted_at) | Q(submitted_at=job.submitted_at, id__lt=job.pk))
        .count()
    )
    return ahead + 1, "submission order"


def preemption_audit_trail(*, team_ids, limit=50):
    """Returns the latest decided (approved, denied, expired) requests on those teams' jobs."""
    return (
        PreemptionRequest.objects.filter(job__team_id__in=team_ids)
        .exclude(state=PreemptionRequest.State.PENDING)
        .select_related("job", "job__team", "decided_by")
        .order_by("-decided_at", "-id")[:limit]
    )


def preemption_pending_for(*, team_ids):
    """Returns the pending requests on those teams' jobs, oldest first (first come, first decided)."""
    return (
        PreemptionRequest.objects.filter(job__team_id__in=team_ids, state=PreemptionRequest.State.PENDING)
        .select_related("job", "job__team")
        .order_by("requested_at", "id")
    )
