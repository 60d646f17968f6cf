"""Teams, jobs and everything that happens to them.

Rows are written only through jobs/services.py (the state machine lives there);
models own small derivations such as `job.is_elastic` and `job.attained_sla_fraction`.
"""
from django.conf import settings
from django.db import models
from django.utils import timezone

from fleet.accelerator_types import ACCELERATOR_TYPE_CHOICES
from fleet.models import Accelerator
from protocol.layout import device_counts_allowed


class Tier(models.TextChoices):
    PREMIUM = "premium", "Premium"
    STANDARD = "standard", "Standard"
    BASIC = "basic", "Basic"


# Fraction of ideal device-time a tier is promised (Singularity's SLA tiers).
SLA_TARGETS = {Tier.PREMIUM: 0.95, Tier.STANDARD: 0.70, Tier.BASIC: 0.0}


class Team(models.Model):
    name = models.CharField(max_length=128, unique=True)
    slug = models.SlugField(max_length=64, unique=True)
    # Devices per accelerator type the team's unfinished jobs may claim as their
    # minimum (sum of min_devices), e.g. {"H100-80GB": 64}. A missing type is 0.
    quotas = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def quota_for(self, accelerator_type):
        """Returns the team's quota for `accelerator_type` (0 when none is set)."""
        return int(self.quotas.get(accelerator_type, 0))


class TeamQuotaClaim(models.Model):
    """The sum of min_devices over a team's unfinished jobs of one accelerator type, kept by
    jobs.services (claimed at job_submit, released when the state machine finishes a job) so that
    a submission checks its quota with one conditional UPDATE whose cost does not grow with the
    queue. jobs.services.team_quota_recount rebuilds it from the jobs (see its docstring)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="quota_claims")
    accelerator_type = models.CharField(max_length=32, choices=ACCELERATOR_TYPE_CHOICES)
    claimed = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "accelerator_type"], name="teamquotaclaim_unique")]

    def __str__(self):
        return f"{self.team_id}/{self.accelerator_type}: {self.claimed}"


class Membership(models.Model):
    class Role(models.TextChoices):
        MEMBER = "member", "Member"
        CAPACITY_MANAGER = "capacity_manager", "Capacity manager"
        ADMIN = "admin", "Team admin"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=32, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["team__name", "user__username"]
        constraints = [models.UniqueConstraint(fields=["user", "team"], name="membership_unique")]

    def __str__(self):
        return f"{self.user} in {self.team} ({self.role})"

    @property
    def can_approve_preemptions(self):
        return self.role in {self.Role.CAPACITY_MANAGER, self.Role.ADMIN}


class Job(models.Model):
    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        SCHEDULED = "scheduled", "Scheduled"
        RUNNING = "running", "Running"
        PREEMPTING = "preempting", "Preempting"
        PREEMPTED = "preempted", "Preempted"
        MIGRATING = "migrating", "Migrating"
        RESIZING = "resizing", "Resizing"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    class Network(models.TextChoices):
        """The network the job's ranks have on a node (protocol.states.JobNetwork: the same words)."""

        ISOLATED = "isolated", "Isolated (loopback only)"
        HOST = "host", "The node's network"

    class ResumeRefused(models.TextChoices):
        """What the job's launcher does when the framework engine refuses a resume because the
        re-run is not the run that was cut (protocol.states.ResumeRefused: the same words)."""

        FAIL = "fail", "Fail, naming what differed"
        RESTART = "restart", "Start again from scratch"

    TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED})
    # States in which the job waits for devices (the scheduler's queue).
    WAITING_STATES = frozenset({State.PENDING, State.PREEMPTED})

    name = models.CharField(max_length=200)
    # No index of its own: job_team_state (team, state) serves every lookup by team (PROTECT's check
    # too), and each job UPDATE that changes the state writes a new entry in every index of the
    # table (a placement tick: ~30k such updates).
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="jobs", db_index=False)
    submitted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="submitted_jobs"
    )
    tier = models.CharField(max_length=16, choices=Tier.choices)
    accelerator_type = models.CharField(max_length=32, choices=ACCELERATOR_TYPE_CHOICES)
    world_size = models.PositiveIntegerField(help_text="W, the job's logical ranks; never changes.")
    min_devices = models.PositiveIntegerField(help_text="Fewest devices it may run on; divides W.")
    entrypoint = models.CharField(max_length=1000)
    # The job's code (jobs/bundles.py): the entrypoint is relative to the unpacked bundle. None:
    # the entrypoint is on the node itself (relative to the agent's --workload-root).
    bundle = models.ForeignKey("jobs.Bundle", on_delete=models.PROTECT, null=True, blank=True, related_name="jobs")
    args = models.JSONField(default=list, blank=True)
    env = models.JSONField(default=dict, blank=True)
    total_steps = models.PositiveBigIntegerField(null=True, blank=True)
    if_resume_refused = models.CharField(
        max_length=8, choices=ResumeRefused.choices, default=ResumeRefused.FAIL,
        help_text="When the framework engine refuses a resume (the re-run is not the run that was cut): fail, "
                  "or start the script again from scratch (a job spanning hosts always fails).")
    network = models.CharField(
        max_length=8, choices=Network.choices, default=Network.ISOLATED,
        help_text="isolated: a network namespace of the job's own with only loopback (the default); host: the "
                  "node's network, granted only where MERIDIAN_JOB_HOST_NETWORK=allow. A job spanning hosts "
                  "runs on the node's network whatever it asked, and its events say so.")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    state_changed_at = models.DateTimeField(default=timezone.now)

    submitted_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True, help_text="First time it ran.")
    last_started_at = models.DateTimeField(null=True, blank=True, help_text="Latest entry into running.")
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    # Placement and accounting, maintained by the control loop.
    # No foreign-key constraint in the database (db_constraint=False; the index stays), as
    # Replica.device: a placement tick sets ~30k jobs' region, each checked at commit for nothing.
    # The tick writes region ids it read in the same transaction, Meridian deletes no region, and
    # Django's collector still clears the jobs of a region deleted through the ORM (SET_NULL).
    region = models.ForeignKey(
        "fleet.Region", on_delete=models.SET_NULL, null=True, blank=True, related_name="+", db_constraint=False,
        help_text="Region of its current placement; replicas never span regions.",
    )
    device_count = models.PositiveIntegerField(default=0, help_text="Devices under it now.")
    attained_device_seconds = models.FloatField(default=0.0)
    # Device-seconds it would have had on W devices since submission (minus time the
    # user asked for nothing); the SLA fraction is attained / ideal.
    ideal_device_seconds = models.FloatField(default=0.0)
    progress_step = models.PositiveBigIntegerField(default=0)
    steps_per_second = models.FloatField(null=True, blank=True)
    last_checkpoint_step = models.PositiveBigIntegerField(null=True, blank=True)
    last_checkpoint_at = models.DateTimeField(null=True, blank=True)
    checkpoint_bytes = models.PositiveBigIntegerField(default=0)
    preemption_count = models.PositiveIntegerField(default=0)
    migration_count = models.PositiveIntegerField(default=0)
    resize_count = models.PositiveIntegerField(default=0)
    # Why a waiting job waits (the scheduler plugin's reason) and its place in line.
    wait_reason = models.CharField(max_length=500, blank=True)
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    failure_reason = models.TextField(blank=True)
    # Placement generation (epoch): +1 whenever the job is given a new copy to launch (start,
    # migration, restart after a lost node). Agents carry it on every report; a report or a
    # checkpoint of an older generation comes from a fenced-off copy and is rejected.
    generation = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [
            models.Index(fields=["state", "accelerator_type"], name="job_state_type"),
            models.Index(fields=["team", "state"], name="job_team_state"),
            models.Index(fields=["tier", "state"], name="job_tier_state"),
            models.Index(fields=["-submitted_at"], name="job_submitted_desc"),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(world_size__gte=1), name="job_world_size_positive"),
            models.CheckConstraint(condition=models.Q(min_devices__gte=1), name="job_min_devices_positive"),
            models.CheckConstraint(
                condition=models.Q(min_devices__lte=models.F("world_size")), name="job_min_devices_le_world"
            ),
        ]

    def __str__(self):
        return f"#{self.pk} {self.name}"

    @property
    def is_elastic(self):
        """True when the job may run on fewer devices than ranks (replica splicing)."""
        return self.min_devices < self.world_size

    @property
    def is_terminal(self):
        return self.state in self.TERMINAL_STATES

    @property
    def sla_target(self):
        return SLA_TARGETS[Tier(self.tier)]

    @property
    def attained_sla_fraction(self):
        """Returns attained / ideal device-seconds, or None before any ideal time accrued."""
        if self.ideal_device_seconds <= 0:
            return None
        return self.attained_device_seconds / self.ideal_device_seconds

    def allowed_device_counts(self) -> list[int]:
        """Returns the device counts the job can run on, ascending: divisors of W that are >= min_devices."""
        return list(device_counts_allowed(self.world_size, at_least=self.min_devices))


class Replica(models.Model):
    """One logical rank of a job. `device` is the desired placement (None: unplaced);
    several ranks share a device when the job is spliced onto fewer devices than W."""

    # No index of its own: replica_rank_unique (job, rank) serves lookups by job, and a placement
    # tick rewrites ~100k replica rows, each of which would update one index more.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="replicas", db_index=False)
    rank = models.PositiveIntegerField()
    # No foreign-key constraint in the database (db_constraint=False; the index stays): a placement
    # tick at 100k accelerators points ~110k replicas at new devices, and PostgreSQL checked each
    # one at commit (~0.5 s of the tick) for nothing. The tick takes the device ids from the
    # accelerator rows it read in the same transaction, and Meridian never deletes an accelerator
    # (a lost or drained node keeps its rows). on_delete=SET_NULL is Django's own (its collector
    # unplaces the replicas of an accelerator deleted through the ORM), with or without the
    # constraint; only a DELETE outside Django could leave a replica naming a missing device.
    device = models.ForeignKey(
        Accelerator, on_delete=models.SET_NULL, null=True, blank=True, related_name="replicas", db_constraint=False
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["job_id", "rank"]
        constraints = [models.UniqueConstraint(fields=["job", "rank"], name="replica_rank_unique")]

    def __str__(self):
        return f"{self.job_id}/rank {self.rank}"


class Checkpoint(models.Model):
    class Engine(models.TextChoices):
        CRIU = "criu", "CRIU process snapshot"
        FRAMEWORK = "framework", "Framework state (model, optimizer, RNG, data loader)"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveBigIntegerField()
    engine = models.CharField(max_length=16, choices=Engine.choices)
    uri = models.CharField(max_length=2000)
    bytes = models.PositiveBigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Set when the run that wrote it was given up: its resume was refused and the job started again
    # from scratch (if_resume_refused "restart"). A retired checkpoint is never restored from and no
    # longer counts as the job's latest; the row stays so that a late report of it is not recorded
    # again (reports are matched by uri), until retention prunes it.
    retired_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job_id", "-step", "-id"]
        indexes = [models.Index(fields=["job", "-created_at"], name="checkpoint_job_created")]

    def __str__(self):
        return f"{self.job_id}@{self.step} ({self.engine})"


class JobEvent(models.Model):
    """The job's timeline (an audit log, like zulip's RealmAuditLog): written in the
    same transaction as the change it records."""

    class Type(models.TextChoices):
        SUBMITTED = "submitted", "Submitted"
        STATE_CHANGED = "state_changed", "State changed"
        PLACED = "placed", "Placed"
        RELEASED = "released", "Devices released"
        RESIZED = "resized", "Resized"
        MIGRATED = "migrated", "Migrated"
        CHECKPOINTED = "checkpointed", "Checkpoint saved"
        RESTORED = "restored", "Restored from checkpoint"
        PROGRESS = "progress", "Progress"
        NODE_LOST = "node_lost", "Node lost"
        PREEMPTION_REQUESTED = "preemption_requested", "Preemption requested"
        PREEMPTION_APPROVED = "preemption_approved", "Preemption approved"
        PREEMPTION_DENIED = "preemption_denied", "Preemption denied"
        PREEMPTION_EXPIRED = "preemption_expired", "Preemption request expired"
        CANCEL_REQUESTED = "cancel_requested", "Cancel requested"
        MOVE_STEP = "move_step", "Move step done"
        MOVE_ENDED = "move_ended", "Move ended early"
        RESTARTED_FROM_SCRATCH = "restarted_from_scratch", "Restarted from scratch (resume refused)"
        MESSAGE = "message", "Message"

    # No index of its own: jobevent_job_created (job, created_at) serves lookups by job, and a
    # placement tick inserts ~60k events.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events", db_index=False)
    type = models.CharField(max_length=32, choices=Type.choices)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16, blank=True)
    reason = models.CharField(max_length=500, blank=True)
    # Indexed where set only (jobevent_actor): the control loop's events have no actor (~60k at a
    # placement tick), and the one lookup by actor (a user deleted: SET_NULL) names a user.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", db_index=False
    )
    extra_data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["job", "created_at"], name="jobevent_job_created"),
                   models.Index(fields=["actor"], condition=models.Q(actor__isnull=False), name="jobevent_actor")]

    def __str__(self):
        return f"{self.job_id} {self.type} {self.created_at:%H:%M:%S}"


class Move(models.Model):
    """One preemption, migration or resize of a job, run step by step by a Celery chain
    (jobs/moves.py). `step` is the step in progress; each step is done when the agents' reports
    (recorded in `observed`, per placement generation) show it happened, or ends the move when
    its deadline passes. At most one active move per job."""

    class Kind(models.TextChoices):
        PREEMPTION = "preemption", "Preemption"
        MIGRATION = "migration", "Migration"
        RESIZE = "resize", "Resize"

    class Step(models.TextChoices):
        BARRIER = "barrier", "Barrier (consistent cut)"
        CHECKPOINT = "checkpoint", "Checkpoint"
        STORE = "store", "Store commit"
        RESTORE = "restore", "Restore on the new node"
        RESIZE = "resize", "Resize (splice)"
        RELEASE = "release", "Release"
        DONE = "done", "Done"

    class State(models.TextChoices):
        ACTIVE = "active", "Active"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"
        TIMED_OUT = "timed_out", "Timed out"

    FROM_NODES = "from_nodes"  # observed's key: the old copy's follower hosts (jobs.moves.move_create)

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="moves")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    step = models.CharField(max_length=16, choices=Step.choices)
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE)
    reason = models.CharField(max_length=500, blank=True)
    from_node = models.ForeignKey("fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    to_node = models.ForeignKey("fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    from_generation = models.PositiveIntegerField(default=0)
    to_generation = models.PositiveIntegerField(default=0)
    from_devices = models.PositiveIntegerField(default=0)
    to_devices = models.PositiveIntegerField(default=0)
    start_step = models.PositiveBigIntegerField(default=0, help_text="The job's progress when the move began.")
    cut_step = models.PositiveBigIntegerField(null=True, blank=True, help_text="Step of the move's consistent cut.")
    checkpoint_uri = models.CharField(max_length=2000, blank=True)
    # The latest report of each copy involved, keyed "g<generation>": state, step, devices, cut,
    # checkpoint, node. Written by jobs.workflows.node_report_apply, read by the steps.
    observed = models.JSONField(default=dict, blank=True)
    chain_id = models.CharField(max_length=32, blank=True, help_text="The live Celery chain; others exit.")
    created_at = models.DateTimeField(default=timezone.now)
    step_started_at = models.DateTimeField(default=timezone.now)
    step_deadline = models.DateTimeField()
    polled_at = models.DateTimeField(null=True, blank=True, help_text="Last time a step task looked at it.")
    finished_at = models.DateTimeField(null=True, blank=True)
    log = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["state", "step_deadline"], name="move_state_deadline")]
        constraints = [
            models.UniqueConstraint(fields=["job"], condition=models.Q(state="active"), name="move_one_active_per_job")
        ]

    def __str__(self):
        return f"{self.kind} of #{self.job_id} at {self.step} ({self.state})"

    def ran_old_copy_on(self, node_id) -> bool:
        """True when node `node_id` ran this move's old copy (from_generation): as its leader
        (from_node) or as one of its follower hosts (observed[FROM_NODES])."""
        return self.from_node_id == node_id or node_id in ((self.observed or {}).get(self.FROM_NODES) or ())

    @classmethod
    def copies_taken_off(cls, *, node_id, job_ids, generations) -> set[tuple[int, int]]:
        """Returns the (job id, generation) among `job_ids` x `generations` of the copies a move took
        or takes off node `node_id` (active or over: ran_old_copy_on). One query."""
        moves = cls.objects.filter(job_id__in=list(job_ids), from_generation__in=list(generations)).only(
            "job_id", "from_generation", "from_node_id", "observed")
        return {(move.job_id, move.from_generation) for move in moves if move.ran_old_copy_on(node_id)}


class PreemptionRequest(models.Model):
    """A preemption that would break the job's SLA waits here for a capacity manager."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        APPROVED = "approved", "Approved"
        DENIED = "denied", "Denied"
        EXPIRED = "expired", "Expired"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="preemption_requests")
    reason = models.CharField(max_length=500)
    lost_work_seconds = models.FloatField(
        default=0.0, help_text="Estimated device-seconds of work since the last checkpoint."
    )
    # Why the scheduler wants the devices, e.g. {"for_job": 12, "devices": 8}.
    extra_data = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    requested_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    note = models.TextField(blank=True)

    class Meta:
        ordering = ["-requested_at", "-id"]
        indexes = [
            models.Index(fields=["state", "expires_at"], name="preemption_state_expires"),
            models.Index(fields=["job", "state"], name="preemption_job_state"),
        ]
        constraints = [
            # At most one open request per job: the control loop asks once and waits.
            models.UniqueConstraint(
                fields=["job"], condition=models.Q(state="pending"), name="preemption_one_pending_per_job"
            )
        ]

    def __str__(self):
        return f"preempt #{self.job_id} ({self.state})"

    def is_expired(self, now):
        return self.state == self.State.PENDING and now >= self.expires_at


class ControlLoopLease(models.Model):
    """One row per periodic control-loop duty ("tick"): who leads it and until when.

    Claimed with a conditional update (jobs.tick.tick_lease_claim), so with any number of
    Celery workers and beats one caller at a time runs the tick, on SQLite and PostgreSQL.
    `last_tick_at` is when a tick last accrued device-time (jobs.tick.accounting_period).
    """

    name = models.CharField(max_length=64, primary_key=True)
    holder = models.CharField(max_length=128, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_tick_at = models.DateTimeField(null=True, blank=True)
    last_tick_stats = models.JSONField(default=dict, blank=True)

    def __str__(self):
        return f"{self.name} held by {self.holder or 'nobody'}"


class LogChunk(models.Model):
    """A piece of a job's log: rank output an agent shipped (jobs/logs.py), a marker the control
    plane wrote at a preemption, move, resize or failure, or a note that output was dropped.
    One log per job across all its attempts, in `id` order (the API's cursor)."""

    class Kind(models.TextChoices):
        OUTPUT = "output", "Rank output"
        MARKER = "marker", "Marker"
        DROPPED = "dropped", "Output dropped"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_chunks")
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.OUTPUT)
    node = models.ForeignKey("fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    generation = models.PositiveIntegerField(null=True, blank=True)
    attempt = models.PositiveIntegerField(default=0)  # the agent's attempt number on that node
    rank = models.PositiveIntegerField(null=True, blank=True)  # None: a marker of every rank
    stream = models.CharField(max_length=8, blank=True)
    offset = models.PositiveBigIntegerField(default=0)  # byte offset in that copy's rank log
    length = models.PositiveIntegerField(default=0)  # bytes of the rank log
    text = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "rank", "id"], name="logchunk_job_rank_id"),
                   models.Index(fields=["created_at"], name="logchunk_created")]
        constraints = [models.UniqueConstraint(
            fields=["job", "node", "generation", "attempt", "rank", "stream", "offset"],
            condition=models.Q(kind="output"), name="logchunk_output_unique")]

    def __str__(self):
        return f"{self.job_id} log #{self.pk} ({self.kind})"


class Bundle(models.Model):
    """A job's code bundle, stored once by its sha256 (jobs/bundles.py) in the artifact store.

    `uploaders`: who sent these bytes; only they may submit a job with it (a digest someone
    else uploaded grants nothing: they upload it too, which stores nothing new)."""

    sha256 = models.CharField(max_length=64, unique=True)
    size_bytes = models.PositiveBigIntegerField()
    unpacked_bytes = models.PositiveBigIntegerField(default=0)
    entries = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    uploaders = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="bundles", blank=True)

    def __str__(self):
        return f"bundle {self.sha256[:12]}"
