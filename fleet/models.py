"""The fleet: Region → Cluster → Node → Accelerator.

Sized for 100,000+ accelerators: every foreign key and filtered column is indexed,
and summaries aggregate in the database (see fleet/selectors.py), never per device.
"""
import hashlib
import hmac
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.db import models
from django.utils import timezone

from fleet.accelerator_types import ACCELERATOR_TYPE_CHOICES
from protocol.node import MAX_DEVICE_MEMORY_GB

# A node whose agent has not reported for this long is stale (the control loop
# decides when stale becomes lost).
NODE_HEARTBEAT_STALE_AFTER = timedelta(seconds=30)
# An operator's reason for draining a node (fleet.services.node_drain): one line for a person.
NODE_DRAIN_REASON_MAX_LENGTH = 500


class Region(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    display_name = models.CharField(max_length=128, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class Cluster(models.Model):
    region = models.ForeignKey(Region, on_delete=models.CASCADE, related_name="clusters")
    name = models.SlugField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["region__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["region", "name"], name="cluster_name_unique_in_region")
        ]

    def __str__(self):
        return f"{self.region.name}/{self.name}"


def node_token_hash(token):
    """Returns the stored form of a node agent token: its SHA-256 hex digest.

    Tokens are 256-bit random strings, so an unsalted fast hash is enough (as for API
    keys); the plaintext is shown once when issued and never stored.
    """
    return hashlib.sha256(token.encode()).hexdigest()


class Node(models.Model):
    class State(models.TextChoices):
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        LOST = "lost", "Lost"

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="nodes")
    hostname = models.CharField(max_length=253, unique=True)
    rack = models.CharField(max_length=64, blank=True)
    nvlink_domain = models.CharField(max_length=64, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.READY, db_index=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True, db_index=True)
    # SHA-256 of the agent's token (see node_token_hash); empty until one is issued.
    agent_token_hash = models.CharField(max_length=64, blank=True, db_index=True)
    agent_version = models.CharField(max_length=64, blank=True)
    # When an agent first enrolled as this node (or an admin issued its token). An enrollment token
    # may create a node, or claim one described in the database that never enrolled; an enrolled
    # node re-registers only with its own token (fleet.agent_services), and re-enrolling it is an
    # admin's action (fleet_node_token, or the admin's actions on nodes).
    enrolled_at = models.DateTimeField(null=True, blank=True)
    # Latest telemetry, aggregated on the node by its agent (means over its devices).
    utilization = models.FloatField(null=True, blank=True)
    telemetry_at = models.DateTimeField(null=True, blank=True)
    # Set by an operator's drain (fleet.services.node_drain), cleared by undrain. They outlive a loss:
    # a drained node that was lost and comes back is draining again, not ready (alive_state).
    drain_reason = models.CharField(max_length=NODE_DRAIN_REASON_MAX_LENGTH, blank=True)
    drained_by = models.CharField(max_length=150, blank=True)  # the operator's username
    drained_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["hostname"]
        indexes = [models.Index(fields=["cluster", "state"], name="node_cluster_state")]

    def __str__(self):
        return self.hostname

    def is_stale(self, now):
        """Returns True when the agent has never reported or not within NODE_HEARTBEAT_STALE_AFTER."""
        return self.last_heartbeat is None or now - self.last_heartbeat > NODE_HEARTBEAT_STALE_AFTER

    @staticmethod
    def alive_state():
        """Returns the state (an expression for an UPDATE) a node takes when its agent reports again
        or registers: draining while an operator's drain stands (drained_at set), else ready."""
        return models.Case(models.When(drained_at__isnull=False, then=models.Value(Node.State.DRAINING)),
                           default=models.Value(Node.State.READY), output_field=models.CharField())

    def token_matches(self, token):
        """Returns True when `token` is this node's agent token (constant-time compare)."""
        return bool(self.agent_token_hash) and hmac.compare_digest(
            self.agent_token_hash, node_token_hash(token)
        )


class EnrollmentToken(models.Model):
    """A token that lets agents enrol new nodes into one cluster until it expires (or is revoked).

    Made by an admin (`manage.py fleet_enrollment_token`); only its SHA-256 is stored (as for node
    tokens), the plaintext is printed once. It never takes over an enrolled node."""

    token_hash = models.CharField(max_length=64, unique=True)
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="enrollment_tokens")
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    note = models.CharField(max_length=200, blank=True)
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    nodes_enrolled = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"enrollment token for {self.cluster} (expires {self.expires_at:%Y-%m-%d %H:%M})"

    def unusable_reason(self, now):
        """Returns why the token cannot enrol a node at `now` (revoked, expired), or None."""
        if self.revoked_at is not None:
            return "this enrollment token was revoked"
        if now >= self.expires_at:
            return f"this enrollment token expired at {self.expires_at.isoformat()}; ask an admin for a new one"
        return None


class Accelerator(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="accelerators")
    index = models.PositiveSmallIntegerField(help_text="Device index on its node (0-based).")
    type = models.CharField(max_length=32, choices=ACCELERATOR_TYPE_CHOICES)
    memory_gb = models.PositiveIntegerField(default=0)
    healthy = models.BooleanField(default=True)
    uuid = models.CharField(max_length=64, blank=True, help_text="NVML UUID where known.")
    # Latest telemetry from the agent; null until it reports.
    utilization = models.FloatField(null=True, blank=True, help_text="0..1")
    memory_used_gb = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["node_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="accelerator_index_unique_on_node")
        ]
        indexes = [models.Index(fields=["type", "healthy"], name="accelerator_type_healthy")]

    def __str__(self):
        return f"{self.node_id}:{self.index} {self.type}"


# --- telemetry history ------------------------------------------------------------------------
#
# Agents heartbeat every few seconds; history is kept as rollup rows, never as raw readings:
#   NodeTelemetryBucket     per node and accelerator type; a heartbeat upserts the current
#                           minute (one row write per heartbeat, whatever the device count)
#   ClusterTelemetryBucket  per cluster and accelerator type, rolled up from the node minutes
#                           by fleet.tasks.telemetry_rollup; fleet, region, cluster and type
#                           charts read these, so they cost clusters × types rows per bucket
# Every stat is a count, a sum or a maximum, so buckets merge exactly (an hour is the sum of
# its minutes, a cluster the sum of its nodes) and means are sums / counts.


class TelemetryResolution(models.IntegerChoices):
    MINUTE = 60, "1 minute"
    HOUR = 3600, "1 hour"


# How long each kind of bucket is kept (fleet.services.telemetry_rollup deletes older ones).
# Node rows are the bulky ones (nodes × buckets, ~240 bytes each with their indexes on
# PostgreSQL): minutes for 6 hours of drill-down, hours for a week, ~130 kB per node in all
# (bench/control_plane.py). Cluster rows are few (clusters × types × buckets): minutes for two
# days, hours for a year; fleet, region, cluster and type charts read only these.
TELEMETRY_RETENTION = {
    ("node", TelemetryResolution.MINUTE): timedelta(hours=6),
    ("node", TelemetryResolution.HOUR): timedelta(days=7),
    ("cluster", TelemetryResolution.MINUTE): timedelta(days=2),
    ("cluster", TelemetryResolution.HOUR): timedelta(days=365),
}


# A bucket whose readings a device can have produced (protocol.node bounds every reading so):
# reads and rollups leave other rows (written before those bounds) out, so no sum overflows.
TELEMETRY_PHYSICAL = models.Q(utilization_max__gte=0.0, utilization_max__lte=1.0, memory_used_gb_max__gte=0.0,
                              memory_used_gb_max__lte=MAX_DEVICE_MEMORY_GB)


def telemetry_bucket_start(moment, resolution):
    """Returns the start of the `resolution`-second bucket holding `moment` (UTC, aligned to the epoch)."""
    seconds = int(moment.timestamp()) // int(resolution) * int(resolution)
    return datetime.fromtimestamp(seconds, tz=dt_timezone.utc)


class TelemetryStats(models.Model):
    """The mergeable telemetry of one time bucket."""

    resolution = models.PositiveIntegerField(choices=TelemetryResolution.choices)
    bucket_start = models.DateTimeField()
    accelerator_type = models.CharField(max_length=32, choices=ACCELERATOR_TYPE_CHOICES)
    heartbeats = models.PositiveIntegerField(default=0)
    # Device readings folded in; utilization and memory means are the sums over this count.
    device_samples = models.PositiveIntegerField(default=0)
    utilization_sum = models.FloatField(default=0.0)
    utilization_max = models.FloatField(default=0.0)
    memory_used_gb_sum = models.FloatField(default=0.0)
    memory_used_gb_max = models.FloatField(default=0.0)

    class Meta:
        abstract = True

    @property
    def utilization_mean(self):
        return self.utilization_sum / self.device_samples if self.device_samples else None


class NodeTelemetryBucket(TelemetryStats):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="telemetry_buckets", db_index=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "resolution", "bucket_start", "accelerator_type"],
                                    name="node_telemetry_bucket_unique")
        ]
        indexes = [models.Index(fields=["resolution", "bucket_start"], name="node_telemetry_bucket_time")]


class ClusterTelemetryBucket(TelemetryStats):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="telemetry_buckets", db_index=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["cluster", "resolution", "bucket_start", "accelerator_type"],
                                    name="cluster_telemetry_bucket_unique")
        ]
        indexes = [models.Index(fields=["resolution", "bucket_start"], name="cluster_telemetry_bucket_time")]
