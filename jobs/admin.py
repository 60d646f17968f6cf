"""Admin for every jobs model. State changes go through the services (the admin shows
state read-only so nobody bypasses the state machine)."""
from django.contrib import admin

from jobs.models import (
    Bundle,
    Checkpoint,
    ControlLoopLease,
    Job,
    JobEvent,
    LogChunk,
    Membership,
    Move,
    PreemptionRequest,
    Replica,
    Team,
    TeamQuotaClaim,
)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written only by the control plane's own code: viewable (and deletable) here, never
    added or edited by hand."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "quotas", "created_at"]
    search_fields = ["name", "slug"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "team", "role"]
    list_filter = ["role", "team"]
    list_select_related = ["user", "team"]
    raw_id_fields = ["user"]


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    fields = ["created_at", "type", "from_state", "to_state", "reason", "actor", "extra_data"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "id", "name", "team", "tier", "accelerator_type", "world_size", "min_devices", "state", "device_count",
        "submitted_at",
    ]
    list_filter = ["state", "tier", "accelerator_type", "team"]
    list_select_related = ["team"]
    search_fields = ["name", "entrypoint"]
    raw_id_fields = ["submitted_by", "region", "bundle"]
    readonly_fields = [
        "state", "state_changed_at", "submitted_at", "started_at", "last_started_at", "finished_at", "updated_at",
        "team", "accelerator_type", "min_devices",  # what the team's quota counter claimed (TeamQuotaClaim)
    ]
    inlines = [JobEventInline]


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ["job", "rank", "device"]
    raw_id_fields = ["job", "device"]
    list_select_related = ["job", "device"]


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["job", "step", "engine", "bytes", "created_at", "retired_at"]
    list_filter = ["engine"]
    raw_id_fields = ["job"]
    list_select_related = ["job"]


@admin.register(JobEvent)
class JobEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "job", "type", "from_state", "to_state", "reason", "actor"]
    list_filter = ["type"]
    raw_id_fields = ["job", "actor"]
    list_select_related = ["job", "actor"]


@admin.register(PreemptionRequest)
class PreemptionRequestAdmin(admin.ModelAdmin):
    list_display = ["id", "job", "state", "lost_work_seconds", "requested_at", "expires_at", "decided_by"]
    list_filter = ["state"]
    raw_id_fields = ["job", "decided_by"]
    list_select_related = ["job", "decided_by"]
    # Decisions go through the approvals API/page so permissions and events apply.
    readonly_fields = ["state", "decided_by", "decided_at"]


@admin.register(ControlLoopLease)
class ControlLoopLeaseAdmin(admin.ModelAdmin):
    """Read-only: the lease is claimed by conditional updates in jobs.lease; editing it by
    hand could let two ticks apply plans at once."""

    list_display = ["name", "holder", "expires_at", "last_tick_at"]
    readonly_fields = ["name", "holder", "expires_at", "last_tick_at", "last_tick_stats"]

    def has_add_permission(self, request):
        return False


@admin.register(Move)
class MoveAdmin(ReadOnlyAdmin):
    """Read-only: a move is advanced only by its Celery steps (jobs/moves.py)."""

    list_display = ["id", "job", "kind", "step", "state", "from_node", "to_node", "cut_step", "step_deadline",
                    "finished_at"]
    list_filter = ["kind", "state", "step"]
    list_select_related = ["job", "from_node", "to_node"]
    raw_id_fields = ["job", "from_node", "to_node"]


@admin.register(LogChunk)
class LogChunkAdmin(ReadOnlyAdmin):
    """Read-only: log chunks come from agents (jobs/logs.py) and the state machine's markers."""

    list_display = ["id", "job", "kind", "rank", "generation", "attempt", "node", "offset", "created_at"]
    list_filter = ["kind"]
    list_select_related = ["job", "node"]
    raw_id_fields = ["job", "node"]


@admin.register(Bundle)
class BundleAdmin(admin.ModelAdmin):
    """Read-only: a bundle's row describes bytes in the artifact store (jobs/bundles.py)."""

    list_display = ["id", "sha256", "size_bytes", "unpacked_bytes", "entries", "created_at"]
    search_fields = ["sha256"]
    readonly_fields = ["sha256", "size_bytes", "unpacked_bytes", "entries", "created_at"]
    raw_id_fields = ["uploaders"]


@admin.register(TeamQuotaClaim)
class TeamQuotaClaimAdmin(ReadOnlyAdmin):
    """Read-only: kept by jobs.services (job_submit claims, the state machine releases). Deleting a
    row is safe: the team's next submission of the type recounts it from the jobs."""

    list_display = ["team", "accelerator_type", "claimed"]
