from django.contrib import admin

from fleet.models import Accelerator, Cluster, Node, Region


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
