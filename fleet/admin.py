from django.contrib import admin, messages

from fleet.models import (
    Accelerator,
    Cluster,
    ClusterTelemetryBucket,
    EnrollmentToken,
    Node,
    NodeTelemetryBucket,
    Region,
)
from fleet.services import (
    NodeStateConflict,
    enrollment_token_revoke,
    node_enrollment_allow,
    node_token_issue,
    node_undrain,
)


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
    # The token hash is a credential: show that one is set, never let it be edited here. The state
    # and the drain are changed by the drain service only (the node's page, the API, `meridian drain`),
    # which records who and why and tells the node's agent.
    readonly_fields = ["agent_token_hash", "enrolled_at", "created_at", "state", "drain_reason", "drained_by",
                       "drained_at"]
    inlines = [AcceleratorInline]
    actions = ["issue_agent_token", "allow_enrollment", "undrain"]

    @admin.action(description="Re-enrol: issue a new agent token (shown once; the old one stops working)")
    def issue_agent_token(self, request, queryset):
        for node in queryset.order_by("hostname")[:20]:
            token = node_token_issue(node=node)
            self.message_user(request, f"{node.hostname}: new agent token (copy it now, it is not stored): {token}",
                              messages.WARNING)

    @admin.action(description="Revoke the agent token and let the node enrol again with an enrollment token")
    def allow_enrollment(self, request, queryset):
        for node in queryset:
            node_enrollment_allow(node=node)
        self.message_user(request, f"{queryset.count()} node(s) may enrol again")

    @admin.action(description="Undrain (drain a node on its page in the portal: it asks why)")
    def undrain(self, request, queryset):
        for node in queryset.order_by("hostname"):
            try:
                node_undrain(node=node, by=request.user)
            except NodeStateConflict as error:
                self.message_user(request, str(error), messages.WARNING)
        self.message_user(request, f"{queryset.filter(state=Node.State.READY).count()} selected node(s) ready")


@admin.register(EnrollmentToken)
class EnrollmentTokenAdmin(admin.ModelAdmin):
    """Made by `manage.py fleet_enrollment_token` (which prints the token once); revoked here."""

    list_display = ["id", "cluster", "expires_at", "revoked_at", "nodes_enrolled", "last_used_at", "note"]
    list_select_related = ["cluster", "cluster__region"]
    readonly_fields = ["token_hash", "cluster", "expires_at", "revoked_at", "created_by", "created_at",
                       "last_used_at", "nodes_enrolled"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Revoke the selected enrollment tokens")
    def revoke(self, request, queryset):
        for row in queryset:
            enrollment_token_revoke(token_row=row)
        self.message_user(request, f"{queryset.count()} enrollment token(s) revoked")


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
