from django.contrib import admin

from fleet.models import Accelerator, Cluster, ClusterTelemetryBucket, Node, NodeTelemetryBucket, Region


@admin.register(Region)
class RegionAdmin(admin.ModelAdmin):
    list_display = ["name", "display_name", "created_at"]
    search_fields = ["name", "display_name"]


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    list_display = ["name", "region", "created_at"]
    list_filter = ["region"]
    list_select_related = ["region"]
    search_fields = ["name"]


class AcceleratorInline(admin.TabularInline):
    model = Accelerator
    extra = 0
    fields = ["index", "type", "memory_gb", "healthy", "utilization", "memory_used_gb", "uuid"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["hostname", "cluster", "rack", "nvlink_domain", "state", "last_heartbeat", "utilization"]
    list_filter = ["state", "cluster__region"]
    list_select_related = ["cluster", "cluster__region"]
    search_fields = ["hostname", "rack", "nvlink_domain"]
    raw_id_fields = ["cluster"]
    # The token hash is a credential: show that one is set, never let it be edited here.
    readonly_fields = ["agent_token_hash", "created_at"]
    inlines = [AcceleratorInline]


@admin.register(Accelerator)
class AcceleratorAdmin(admin.ModelAdmin):
    list_display = ["id", "node", "index", "type", "memory_gb", "healthy", "utilization"]
    list_filter = ["type", "healthy"]
    list_select_related = ["node"]
    search_fields = ["node__hostname", "uuid"]
    raw_id_fields = ["node"]
    # 100k rows: don't count them on every page.
    show_full_result_count = False


class TelemetryBucketAdmin(admin.ModelAdmin):
    """Read-only: history is written by heartbeats and the rollup task only."""

    list_filter = ["resolution", "accelerator_type"]
    date_hierarchy = None
    show_full_result_count = False  # millions of rows at scale
    ordering = ["-bucket_start"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(NodeTelemetryBucket)
class NodeTelemetryBucketAdmin(TelemetryBucketAdmin):
    list_display = ["bucket_start", "resolution", "node", "accelerator_type", "heartbeats", "device_samples",
                    "utilization_max"]
    list_select_related = ["node"]
    raw_id_fields = ["node"]
    search_fields = ["node__hostname"]


@admin.register(ClusterTelemetryBucket)
class ClusterTelemetryBucketAdmin(TelemetryBucketAdmin):
    list_display = ["bucket_start", "resolution", "cluster", "accelerator_type", "heartbeats", "device_samples",
                    "utilization_max"]
    list_select_related = ["cluster", "cluster__region"]
    raw_id_fields = ["cluster"]
