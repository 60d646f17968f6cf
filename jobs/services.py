"""Services: every write to jobs, teams and preemption requests goes through here.

HTTP views, the Celery control loop, management commands and tests all call these
same functions (HackSoft styleguide: services write, selectors read).

Errors:
  django.core.exceptions.ValidationError  bad input (a job spec, a quota); message_dict
                                           names the field and what to do
  django.core.exceptions.PermissionDenied  the user may not do this
  IllegalTransition                        the state machine forbids the move
  StaleJobState (an IllegalTransition)     someone else moved the job first
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection, transaction
from django.db.models import Count, F, Sum, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from fleet.accelerator_types import ACCELERATOR_TYPES
from fleet.leases import desired_serials_bump, nodes_alive_by_lease
from fleet.live import GROUP_APPROVALS, GROUP_FLEET, events_publish, group_for_job, group_for_team
from fleet.models import Node
from fleet.services import user_is_fleet_operator
from jobs.bulk import EventRow, RowWrites, cursor_prepared, events_insert, rows_update
from jobs.desired_signal import desired_changed
from jobs.logs import log_marker_for_transition
from jobs.models import (
    Checkpoint,
    Job,
    JobEvent,
    Membership,
    PreemptionRequest,
    Replica,
    Team,
    TeamQuotaClaim,
    Tier,
)
from jobs.selectors import approver_team_ids
from protocol.layout import device_counts_allowed, layout_fits
from protocol.node import checkpoint_uri_problem

logger = logging.getLogger(__name__)
S = Job.State

# The job state machine. A move not listed here raises IllegalTransition.
#   pending     waits in the queue for devices
#   scheduled   devices chosen (Replica.device set); agents are starting the ranks
#   running     ranks are training
#   preempting  taking a checkpoint at a consistent cut before releasing its devices
#   preempted   checkpointed and released; waits in the queue to resume
#   migrating   checkpointed, moving to other devices (possibly another cluster/region)
#   resizing    changing how many devices hold its W ranks (splicing); W never changes
#   succeeded / failed / cancelled   terminal
TRANSITIONS = {
    S.PENDING: {S.SCHEDULED, S.CANCELLED, S.FAILED},
    # scheduled → pending: the placement was withdrawn before the ranks started.
    # scheduled → preempted: its node was lost before it started; resume from its checkpoint.
    S.SCHEDULED: {S.RUNNING, S.PENDING, S.PREEMPTED, S.CANCELLED, S.FAILED},
    # running → preempted: its node was lost; it resumes from its last checkpoint.
    S.RUNNING: {S.PREEMPTING, S.PREEMPTED, S.MIGRATING, S.RESIZING, S.SUCCEEDED, S.FAILED, S.CANCELLED},
    S.PREEMPTING: {S.PREEMPTED, S.RUNNING, S.FAILED, S.CANCELLED},
    S.PREEMPTED: {S.SCHEDULED, S.CANCELLED, S.FAILED},
    # migrating → preempted: checkpointed but no room to restore yet; it waits in the queue.
    S.MIGRATING: {S.RUNNING, S.PREEMPTED, S.FAILED, S.CANCELLED},
    S.RESIZING: {S.RUNNING, S.PREEMPTED, S.SUCCEEDED, S.FAILED, S.CANCELLED},
    S.SUCCEEDED: set(),
    S.FAILED: set(),
    S.CANCELLED: set(),
}
# States in which the job holds devices (its replicas point at accelerators).
DEVICE_HOLDING_STATES = frozenset({S.SCHEDULED, S.RUNNING, S.PREEMPTING, S.MIGRATING, S.RESIZING})

PREEMPTION_REQUEST_TTL = timedelta(minutes=10)
# The wire's ceiling (protocol.node.MAX_WORLD_SIZE); the policy's, lower, is
# settings.MERIDIAN_MAX_WORLD_SIZE (job_world_size_limits).
MAX_WORLD_SIZE = 100_000
MAX_TOTAL_STEPS = 2**63 - 1  # Job.total_steps is a PositiveBigIntegerField
MAX_ARGS = 1000
MAX_ENV = 500
# \Z, not $: "$" also matches before a trailing newline, so "FOO\n" would pass.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class IllegalTransition(Exception):
    """The state machine has no arrow from the job's state to the requested one."""

    def __init__(self, *, job_id, from_state, to_state, message=None):
        self.job_id, self.from_state, self.to_state = job_id, from_state, to_state
        allowed = sorted(TRANSITIONS.get(from_state, ()))
        super().__init__(
            message
            or f"job {job_id} cannot go from {from_state} to {to_state}; from {from_state} it may go to: "
            + (", ".join(allowed) if allowed else "nothing (it has finished)")
        )


class StaleJobState(IllegalTransition):
    """The job left `from_state` before this caller's conditional update: someone else won."""


class JobSpecsInvalid(ValidationError):
    """Some specs of a bulk submission are bad; `per_item` maps each bad one's index (a str) to
    {field: [message]}. As a ValidationError its "jobs" messages say the same in words."""

    def __init__(self, per_item: dict[str, dict[str, list[str]]]):
        self.per_item = per_item
        super().__init__({"jobs": [
            f"job {index}: " + "; ".join(f"{field}: {' '.join(messages)}" for field, messages in errors.items())
            for index, errors in per_item.items()]})


# --- permissions ---------------------------------------------------------------


def user_is_global_admin(user):
    """True for superusers: every team is theirs, and they operate the fleet (one rule, in fleet)."""
    return user_is_fleet_operator(user)


def user_team_role(*, user, team_id):
    """Returns the user's Membership.Role in the team, or None when not a member."""
    if not (user and user.is_authenticated):
        return None
    return (
        Membership.objects.filter(user_id=user.pk, team_id=team_id).values_list("role", flat=True).first()
    )


def user_can_approve_preemptions(*, user, team_id) -> bool:
    """True for capacity managers and admins of the team, and for global admins (approver_team_ids)."""
    if user_is_global_admin(user):
        return True  # without a query: every team is theirs
    return team_id in approver_team_ids(user=user)


def user_can_see_team(*, user, team_id):
    return user_is_global_admin(user) or user_team_role(user=user, team_id=team_id) is not None


# --- live pushes -----------------------------------------------------------------


def _job_payload(job):
    return {
        "job_id": job.pk,
        "team_id": job.team_id,
        "state": job.state,
        "device_count": job.device_count,
        "progress_step": job.progress_step,
        "updated_at": timezone.now().isoformat(),
    }


def job_updated_message(*, job) -> dict:
    """Returns the "jobs.job_updated" channel message for `job` (what job_publish_updated sends)."""
    return {"type": "jobs.job_updated", "job": _job_payload(job)}


def job_publish_updated(*, job, fleet=False, new=False):
    """Pushes "jobs.job_updated" to the job's and team's groups (and "fleet" if asked) on commit.
    A `new` job's own group is left out: no page can have joined it before the job existed."""
    groups = [group_for_team(job.team_id)] if new else [group_for_job(job.pk), group_for_team(job.team_id)]
    if fleet:
        groups.append(GROUP_FLEET)
    message = job_updated_message(job=job)
    events_publish(groups=groups, type=message.pop("type"), payload=message)


def job_event_add(*, job, type, reason="", actor=None, extra=None, from_state="", to_state=""):
    """Returns a new JobEvent for `job`. Call it inside the transaction of the change (once it
    commits, the job's nodes are told their desired state may have changed: jobs/desired_signal.py)."""
    desired_changed(job_ids=(job.pk,))
    return JobEvent.objects.create(
        job=job,
        type=type,
        reason=reason[:500],
        actor=actor if (actor is not None and actor.is_authenticated) else None,
        extra_data=extra or {},
        from_state=from_state,
        to_state=to_state,
    )


# --- the state machine --------------------------------------------------------------


@dataclass(frozen=True)
class _TransitionWrites:
    """What a move from one state to another writes on the job row: one rule for job_transition
    and jobs_transition_bulk."""

    columns: dict  # column -> value, the same for every job making this move
    counter: str | None  # a *_count column that goes up by one, or None
    sets_started_at: bool  # started_at = now unless it is set (the first entry into running)
    releases_devices: bool  # replicas unplaced, device_count 0, region None


def _transition_writes(*, from_state: S, to: S, now: datetime) -> _TransitionWrites:
    columns = {"state": to, "state_changed_at": now, "updated_at": now}
    if to == S.RUNNING:
        columns["last_started_at"] = now
    if to in Job.TERMINAL_STATES:
        columns["finished_at"] = now
        columns["queue_position"] = None
        columns["wait_reason"] = ""
    releases_devices = to in Job.TERMINAL_STATES or to in Job.WAITING_STATES
    if releases_devices:
        columns["device_count"] = 0
        columns["region"] = None
    if from_state in Job.WAITING_STATES and to not in Job.WAITING_STATES:
        columns["queue_position"] = None
        columns["wait_reason"] = ""
    counter = None
    if to == S.PREEMPTED and from_state != S.MIGRATING:
        counter = "preemption_count"
    if to == S.MIGRATING:
        counter = "migration_count"
    if to == S.RESIZING:
        counter = "resize_count"
    return _TransitionWrites(columns=columns, counter=counter, sets_started_at=to == S.RUNNING,
                             releases_devices=releases_devices)


def _transition_rows_update(*, writes: _TransitionWrites, state: S, jobs: list[Job], rows: list[int],
                            row_writes: RowWrites, now: datetime) -> int:
    """Returns how many of the jobs at positions `rows` of `jobs` (all in from-state `state`) moved:
    the move's `writes` and each job's `row_writes` in one conditional UPDATE (WHERE state =
    `state`: a job that left it meanwhile is not written, and the caller's count tells)."""
    fields = [Job._meta.get_field(name) for name in writes.columns]
    assignments = [f"{field.column} = %s" for field in fields]
    params = [field.get_db_prep_save(value, connection) for field, value in zip(fields, writes.columns.values())]
    if writes.sets_started_at:
        assignments.append("started_at = COALESCE(started_at, %s)")
        params.append(Job._meta.get_field("started_at").get_db_prep_save(now, connection))
    if writes.counter:
        assignments.append(f"{writes.counter} = {writes.counter} + 1")
    written = {field.column for field in fields}
    if writes.sets_started_at:
        written.add("started_at")
    if writes.counter:
        written.add(writes.counter)
    clash = written & row_writes.assigned()
    if clash:
        raise ValueError(f"row_writes assign {sorted(clash)}, which the move to {writes.columns['state']} writes")
    set_sql = ", ".join([*assignments, *([row_writes.set_sql] if row_writes.set_sql else [])])
    return rows_update(Job._meta.db_table, set_sql=set_sql, ids=[jobs[i].pk for i in rows],
                       columns=[[column[i] for i in rows] for column in row_writes.columns],
                       types=row_writes.types, params=params, where_sql="state = %s",
                       where_params=[str(state.value)])


def job_transition(*, job, to, reason="", by=None, extra=None, now=None):
    """Moves `job` from its current (in-memory) state to `to`; returns the refreshed job.

    Raises IllegalTransition when TRANSITIONS has no such arrow, StaleJobState when the
    row is no longer in job.state (another worker moved it first: reload and decide
    again). Writes a STATE_CHANGED JobEvent in the same transaction and pushes
    "jobs.job_updated" after commit. Sets started_at / last_started_at on entering
    running and finished_at on a terminal state; a terminal or waiting state releases
    the job's devices (replicas unplaced, device_count 0). Device-time accounting is
    the control loop's (it accrues attained/ideal seconds every tick).
    """
    to = S(to)
    from_state = S(job.state)
    if to not in TRANSITIONS[from_state]:
        raise IllegalTransition(job_id=job.pk, from_state=from_state, to_state=to)
    now = now or timezone.now()
    writes = _transition_writes(from_state=from_state, to=to, now=now)
    changes = dict(writes.columns)
    if writes.sets_started_at and job.started_at is None:
        changes["started_at"] = now
    if writes.counter:
        changes[writes.counter] = getattr(job, writes.counter) + 1
    releases_devices = writes.releases_devices

    with transaction.atomic():
        updated = Job.objects.filter(pk=job.pk, state=from_state).update(**changes)
        if updated != 1:
            current = Job.objects.filter(pk=job.pk).values_list("state", flat=True).first()
            raise StaleJobState(
                job_id=job.pk,
                from_state=from_state,
                to_state=to,
                message=f"job {job.pk} is no longer {from_state} (it is {current}); reload it and decide again",
            )
        if releases_devices:
            released = Replica.objects.filter(job_id=job.pk, device__isnull=False).update(device=None)
        else:
            released = 0
        if to in Job.TERMINAL_STATES:
            _team_quota_release(jobs=[job])
        for field, value in changes.items():
            setattr(job, field, value)
        job_event_add(
            job=job,
            type=JobEvent.Type.STATE_CHANGED,
            reason=reason,
            actor=by,
            extra={**(extra or {}), **({"released_replicas": released} if released else {})},
            from_state=from_state,
            to_state=to,
        )
        job_publish_updated(job=job, fleet=releases_devices or to == S.SCHEDULED)
        log_marker_for_transition(job=job, from_state=from_state, to_state=to, reason=reason, now=now)
    return job


def jobs_transition_bulk(*, jobs: Sequence[Job], to: str, reasons: Mapping[int, str] | None = None,
                         extras: Mapping[int, dict] | None = None, events: Iterable[JobEvent | EventRow] = (),
                         by=None, now: datetime | None = None, publish_max: int | None = None,
                         row_writes: RowWrites | None = None,
                         nodes: Mapping[int, set[int]] | None = None) -> list[Job]:
    """Moves every job in `jobs` from its (in-memory) state to `to`; returns them, updated in memory.

    job_transition for many jobs in a constant number of statements: the same TRANSITIONS table
    (IllegalTransition, before anything is written, when any job has no such arrow), the same
    columns, a conditional UPDATE per from-state (jobs.bulk.rows_update: one statement per 50k
    rows on PostgreSQL, an executemany elsewhere), a
    STATE_CHANGED JobEvent per job (reason and extra from `reasons` / `extras` by job id) written
    with the caller's `events` (JobEvents or EventRows) by jobs.bulk.events_insert (COPY on
    PostgreSQL), all in one transaction. StaleJobState when a job
    left its state first (nothing is written then, but a caller's enclosing transaction must end:
    no savepoint is taken; lock the rows with select_for_update to avoid it). "jobs.job_updated"
    is pushed after commit, with what the objects hold at the call, unless there are more than
    `publish_max` jobs (None: no limit): pages catch up on their next poll.
    Deferred fields that the move changes (a counter, started_at) stay deferred and load fresh.
    `row_writes` (columns in `jobs`' order) are written by the same conditional UPDATE, so each row
    is written once; ValueError if they assign a column the move writes too. The objects are not
    changed by them: set what the caller needs on them itself. `nodes` ({job id: the Node pks it
    is on after the move}) spares the after-commit lookup of those nodes when the caller knows
    them (jobs.desired_signal).
    """
    to = S(to)
    jobs = list(jobs)
    now = now or timezone.now()
    reasons, extras = reasons or {}, extras or {}
    rows_by_state: dict[S, list[int]] = {}  # from-state -> positions in `jobs`
    for row, job in enumerate(jobs):
        from_state = S(job.state)
        if to not in TRANSITIONS[from_state]:
            raise IllegalTransition(job_id=job.pk, from_state=from_state, to_state=to)
        rows_by_state.setdefault(from_state, []).append(row)
    writes_of = {state: _transition_writes(from_state=state, to=to, now=now) for state in rows_by_state}
    # No savepoint inside a caller's transaction: a tick's start path pays no extra statements.
    # A StaleJobState then dooms that transaction (it must end), which rolls this back with it.
    row_writes = row_writes or RowWrites(set_sql="", columns=[], types=())
    with transaction.atomic(savepoint=False):
        updated = 0
        for state, writes in writes_of.items():
            updated += _transition_rows_update(writes=writes, state=state, jobs=jobs, rows=rows_by_state[state],
                                               row_writes=row_writes, now=now)
        if updated != len(jobs):
            # This UPDATE moved the others to `to` already (rolled back with the raise); the stale
            # one is elsewhere (or was moved to `to` by someone else: then name the first).
            current = dict(Job.objects.filter(pk__any_of=[job.pk for job in jobs]).values_list("id", "state"))
            stale = next((job for job in jobs if current.get(job.pk) != to), jobs[0])
            raise StaleJobState(
                job_id=stale.pk, from_state=S(stale.state), to_state=to,
                message=f"job {stale.pk} is no longer {stale.state} (it is {current.get(stale.pk)}); "
                        f"reload it and decide again")
        if to in Job.TERMINAL_STATES:
            _team_quota_release(jobs=jobs)
        releasing = [job.pk for job in jobs if writes_of[S(job.state)].releases_devices]
        released = {}
        if releasing:
            placed = Replica.objects.filter(job_id__any_of=releasing, device__isnull=False)
            released = dict(placed.values("job_id").annotate(n=Count("id")).values_list("job_id", "n"))
            placed.update(device=None)
        state_events = []
        actor_id = by.pk if (by is not None and by.is_authenticated) else None
        for job in jobs:
            from_state = S(job.state)
            writes = writes_of[from_state]
            # Only when needed: get_deferred_fields walks every field (~30 µs a job; a placement tick
            # moves 30k jobs to scheduled, which sets neither).
            deferred = job.get_deferred_fields() if writes.sets_started_at or writes.counter else set()
            for field, value in writes.columns.items():
                setattr(job, field, value)
            if writes.sets_started_at and "started_at" not in deferred and job.started_at is None:
                job.started_at = now
            if writes.counter and writes.counter not in deferred:
                setattr(job, writes.counter, getattr(job, writes.counter) + 1)
            extra = {**extras.get(job.pk, {}),
                     **({"released_replicas": released[job.pk]} if released.get(job.pk) else {})}
            state_events.append(EventRow(
                job_id=job.pk, type=JobEvent.Type.STATE_CHANGED, from_state=from_state, to_state=to,
                reason=reasons.get(job.pk, ""), extra_data=extra, created_at=now, actor_id=actor_id))
        events_insert([*state_events, *events], now=now)
        desired_changed(job_ids=[job.pk for job in jobs], nodes=nodes)
        if publish_max is None or len(jobs) <= publish_max:
            releases_devices = to in Job.TERMINAL_STATES or to in Job.WAITING_STATES
            for job in jobs:
                job_publish_updated(job=job, fleet=releases_devices or to == S.SCHEDULED)
    return jobs


# --- submit and cancel --------------------------------------------------------------------

SPEC_FIELDS = {
    "name", "tier", "accelerator_type", "world_size", "min_devices", "entrypoint", "args", "env", "total_steps",
    "bundle", "if_resume_refused", "network",
}


HOST_NETWORK_DENIED = ("network host (the node's network, with every service it reaches) is not allowed here: "
                       "the operator's setting MERIDIAN_JOB_HOST_NETWORK is deny, so jobs run isolated (loopback "
                       "only). Ask your operator, or fetch data before submitting (bundle it).")


def _int_field(spec, field, errors, *, default=None):
    value = spec.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int):
        # isascii: str.isdigit() is true of "²" and other digits int() refuses
        if isinstance(value, str) and value.strip().lstrip("-").isascii() and value.strip().lstrip("-").isdigit():
            return int(value)
        errors[field] = f"{field} must be a whole number, got {value!r}"
        return None
    return value


def job_spec_clean(spec: object) -> dict:
    """Returns a cleaned copy of a job spec dict; raises ValidationError naming every bad field.

    Fields: name, tier (premium|standard|basic), accelerator_type (fleet registry),
    world_size W >= 1, min_devices (default 1: every job is elastic unless asked
    otherwise; must divide W), entrypoint, args (list of strings), env (str → str),
    total_steps (optional), if_resume_refused (fail|restart, default fail: what the launcher does
    when the framework engine refuses a resume), network (isolated|host, default isolated; host
    only where settings.MERIDIAN_JOB_HOST_NETWORK is "allow"). The team quota is checked by job_submit.
    """
    if not isinstance(spec, dict):
        raise ValidationError({"spec": "a job spec must be a JSON object"})
    errors = {}
    unknown = sorted(set(spec) - SPEC_FIELDS)
    if unknown:
        errors["non_field_errors"] = f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(SPEC_FIELDS))}"
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        errors["name"] = "name is required: a short label such as 'resnet50-imagenet'"
    elif len(name) > 200:
        errors["name"] = "name must be at most 200 characters"
    tier = spec.get("tier", Tier.STANDARD)
    if tier not in Tier.values:
        errors["tier"] = f"unknown tier {tier!r}; choose one of {', '.join(Tier.values)}"
    accelerator_type = spec.get("accelerator_type")
    if accelerator_type not in ACCELERATOR_TYPES:
        errors["accelerator_type"] = (
            f"unknown accelerator type {accelerator_type!r}; known types: {', '.join(ACCELERATOR_TYPES)}"
        )
    world_size = _int_field(spec, "world_size", errors)
    if world_size is not None and not 1 <= world_size <= MAX_WORLD_SIZE:
        errors["world_size"] = f"world_size (W, logical ranks) must be between 1 and {MAX_WORLD_SIZE}, got {world_size}"
        world_size = None
    min_devices = _int_field(spec, "min_devices", errors, default=1)
    if min_devices is not None and world_size is not None:
        if not 1 <= min_devices <= world_size:
            errors["min_devices"] = f"min_devices must be between 1 and world_size ({world_size}), got {min_devices}"
        elif not layout_fits(world_size, min_devices):
            divisors = device_counts_allowed(world_size)
            shown = ", ".join(map(str, divisors[:20])) + (", ..." if len(divisors) > 20 else "")
            errors["min_devices"] = (
                f"min_devices must divide world_size {world_size} (ranks are spread evenly over "
                f"devices); {min_devices} does not. Divisors of {world_size}: {shown}"
            )
    entrypoint = spec.get("entrypoint")
    if not isinstance(entrypoint, str) or not entrypoint.strip():
        errors["entrypoint"] = "entrypoint is required: the script or module to run, e.g. 'train.py'"
    elif len(entrypoint) > 1000:
        errors["entrypoint"] = "entrypoint must be at most 1000 characters"
    args = spec.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        errors["args"] = 'args must be a list of strings, e.g. ["--epochs", "3"]'
    elif len(args) > MAX_ARGS:
        errors["args"] = f"at most {MAX_ARGS} args"
    env = spec.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        errors["env"] = 'env must be an object of string values, e.g. {"LR": "0.1"}'
    elif len(env) > MAX_ENV:
        errors["env"] = f"at most {MAX_ENV} env variables"
    else:
        bad = [k for k in env if not ENV_NAME.match(k)]
        if bad:
            errors["env"] = f"invalid environment variable name(s): {', '.join(map(repr, bad[:5]))}"
    total_steps = spec.get("total_steps")
    if total_steps is not None:
        total_steps = _int_field(spec, "total_steps", errors)
        if total_steps is not None and total_steps < 1:
            errors["total_steps"] = "total_steps must be at least 1 when given"
        elif total_steps is not None and total_steps > MAX_TOTAL_STEPS:
            errors["total_steps"] = f"total_steps must be at most {MAX_TOTAL_STEPS} (2**63 - 1), got {total_steps}"
    if_resume_refused = spec.get("if_resume_refused", Job.ResumeRefused.FAIL)
    if if_resume_refused not in Job.ResumeRefused.values:
        errors["if_resume_refused"] = (f"if_resume_refused must be one of {', '.join(Job.ResumeRefused.values)} "
                                       f"(what to do when a resume is refused), got {if_resume_refused!r}")
    network = spec.get("network", Job.Network.ISOLATED)
    if network not in Job.Network.values:
        errors["network"] = (f"network must be one of {', '.join(Job.Network.values)} (isolated: loopback only; "
                             f"host: the node's network), got {network!r}")
    elif network == Job.Network.HOST and settings.MERIDIAN_JOB_HOST_NETWORK != "allow":
        errors["network"] = HOST_NETWORK_DENIED
    if spec.get("bundle") is not None and type(spec["bundle"]).__name__ != "Bundle":
        errors["bundle"] = "bundle must be an uploaded bundle (bundle_resolve_for_submit resolves a digest)"
    if errors:
        raise ValidationError(errors)
    return {
        "name": name.strip(),
        "tier": tier,
        "accelerator_type": accelerator_type,
        "world_size": world_size,
        "min_devices": min_devices,
        "entrypoint": entrypoint.strip(),
        "args": args,
        "env": env,
        "total_steps": total_steps,
        "bundle": spec.get("bundle"),  # a Bundle row or None (jobs.bundles.bundle_resolve_for_submit)
        "if_resume_refused": if_resume_refused,
        "network": network,
    }


def _team_quota_claimed_recomputed(*, team_id, accelerator_type) -> int:
    """Returns the sum of min_devices over the team's unfinished jobs of that type (a scan of them)."""
    return (
        Job.objects.filter(team_id=team_id, accelerator_type=accelerator_type)
        .exclude(state__in=Job.TERMINAL_STATES)
        .aggregate(total=Sum("min_devices"))["total"]
        or 0
    )


def team_quota_claimed(*, team, accelerator_type) -> int:
    """Returns what the team's unfinished jobs of that type claim (the sum of their min_devices),
    from its TeamQuotaClaim counter, or recomputed from the jobs while the counter does not exist."""
    claimed = (TeamQuotaClaim.objects.filter(team_id=team.pk, accelerator_type=accelerator_type)
               .values_list("claimed", flat=True).first())
    if claimed is None:
        return _team_quota_claimed_recomputed(team_id=team.pk, accelerator_type=accelerator_type)
    return claimed


def team_quota_claim(*, team, accelerator_type, devices, quota) -> int | None:
    """Adds `devices` to the team's claim of `accelerator_type` if the claim stays within `quota`;
    returns None when it did, else the current claim (the caller refuses the job). Call it inside
    the transaction that creates the job: the counter row stays locked until it ends.

    One UPDATE ... WHERE claimed + devices <= quota, so its cost does not depend on the queue. A
    team's first claim of a type creates the row from the jobs (ON CONFLICT DO NOTHING: concurrent
    first submissions agree on one row; on PostgreSQL the loser waits for the winner's commit).
    """
    claims = TeamQuotaClaim.objects.filter(team_id=team.pk, accelerator_type=accelerator_type)
    for _attempt in range(2):
        if claims.filter(claimed__lte=quota - devices).update(claimed=F("claimed") + devices) == 1:
            return None
        current = claims.values_list("claimed", flat=True).first()
        if current is not None:
            return current
        TeamQuotaClaim.objects.bulk_create([TeamQuotaClaim(
            team_id=team.pk, accelerator_type=accelerator_type,
            claimed=_team_quota_claimed_recomputed(team_id=team.pk, accelerator_type=accelerator_type))],
            ignore_conflicts=True)
    return claims.values_list("claimed", flat=True).first() or 0


def _team_quota_release(*, jobs: Sequence[Job]) -> None:
    """Gives back the min_devices of `jobs` (which are entering a terminal state, inside the
    transition's transaction) to their teams' claim counters: one UPDATE per (team, type).

    Never below 0: a job written without job_submit (a fixture, an import) was never claimed."""
    released: dict[tuple[int, str], int] = {}
    unloaded = []
    for job in jobs:
        if {"team_id", "accelerator_type", "min_devices"} & job.get_deferred_fields():
            unloaded.append(job.pk)
        else:
            key = (job.team_id, job.accelerator_type)
            released[key] = released.get(key, 0) + job.min_devices
    if unloaded:
        rows = (Job.objects.filter(pk__in=unloaded).order_by().values_list("team_id", "accelerator_type")
                .annotate(n=Sum("min_devices")))
        for team_id, accelerator_type, n in rows:
            released[(team_id, accelerator_type)] = released.get((team_id, accelerator_type), 0) + n
    for (team_id, accelerator_type), devices in released.items():
        TeamQuotaClaim.objects.filter(team_id=team_id, accelerator_type=accelerator_type).update(
            claimed=Greatest(F("claimed") - devices, Value(0)))


def team_quota_recount() -> int:
    """Rebuilds every TeamQuotaClaim from the jobs; returns how many counters it changed.

    For a database whose jobs were written around job_submit (an import, the admin editing a
    job's min_devices): the counters then drift from the jobs. Locks the counter rows first, so
    a submission that claimed before the lock has committed its job when the sums are read."""
    with transaction.atomic():
        counters = {(row.team_id, row.accelerator_type): row for row in TeamQuotaClaim.objects.select_for_update()}
        sums = {(team_id, accelerator_type): n for team_id, accelerator_type, n in (
            Job.objects.exclude(state__in=Job.TERMINAL_STATES).order_by()
            .values_list("team_id", "accelerator_type").annotate(n=Sum("min_devices")))}
        changed = []
        for key in counters.keys() | sums.keys():
            row = counters.get(key) or TeamQuotaClaim(team_id=key[0], accelerator_type=key[1], claimed=-1)
            if row.claimed != sums.get(key, 0):
                row.claimed = sums.get(key, 0)
                changed.append(row)
        for row in changed:
            row.save()
    return len(changed)


def job_world_size_limits(*, accelerator_type: str, min_devices: int, fleet: bool = True) -> dict:
    """Returns the bounds a job of `accelerator_type` and `min_devices` must keep, each with why:

      {"max_world_size": W at most, "world_size_because": why that W,
       "max_min_devices": min_devices at most or None, "min_devices_because": why}

    W is bounded by the smallest of
      settings.MERIDIAN_MAX_WORLD_SIZE          the operator's absolute cap;
      min_devices * MERIDIAN_MAX_RANKS_PER_DEVICE  shrunk to min_devices devices, a device takes
                                                W / min_devices rank processes in turns; and since
                                                min_devices counts against the team's quota, a
                                                team's ranks are at most quota * that factor;
    and min_devices by the most devices of the type one job could ever hold (fleet.selectors.
    accelerator_type_capacity: under one node, rack, cluster or region as MERIDIAN_JOB_MAX_SPREAD
    says): a job needing more could never start. So W <= capacity * ranks per device as well. A
    fleet without any device of the type yet (nodes enroll later) bounds only W: the job waits,
    and the scheduler says why. `fleet=False` leaves the fleet out (no query; max_min_devices None).
    """
    from fleet.selectors import accelerator_type_capacity

    per_device = int(settings.MERIDIAN_MAX_RANKS_PER_DEVICE)
    cap = min(int(settings.MERIDIAN_MAX_WORLD_SIZE), MAX_WORLD_SIZE)
    bounds = [(cap, f"the largest world_size this installation runs is {cap} (MERIDIAN_MAX_WORLD_SIZE)"),
              (min_devices * per_device,
               f"at most {per_device} ranks share one device (MERIDIAN_MAX_RANKS_PER_DEVICE), so with "
               f"min_devices {min_devices} world_size may be at most {min_devices * per_device}; "
               f"raise min_devices (it counts against your team's quota) or lower world_size")]
    capacity = accelerator_type_capacity(accelerator_type=accelerator_type,
                                         spread=str(settings.MERIDIAN_JOB_MAX_SPREAD).strip().lower()) if fleet else 0
    limits = {"max_min_devices": None, "min_devices_because": ""}
    if capacity:
        where = f"one {settings.MERIDIAN_JOB_MAX_SPREAD}"
        limits.update(max_min_devices=capacity,
                      min_devices_because=f"the fleet has at most {capacity} {accelerator_type} device(s) in "
                                          f"{where} (a job's devices never span more); a job needing more "
                                          f"could never start")
    limit, because = min(bounds, key=lambda bound: bound[0])
    return {**limits, "max_world_size": limit, "world_size_because": because}


def _job_start_devices(clean: dict) -> int:
    """Returns the fewest devices `clean`'s job can ever start on: W for a tier the scheduler starts
    only at its full size (PolicySettings.full_size_tiers: Premium, whose SLA is 95% of the ideal
    device-time at W), min_devices for the others (they start smaller and grow)."""
    from jobs.snapshot import TIERS, policy_settings

    full_size = TIERS.get(str(clean["tier"])) in policy_settings().full_size_tiers
    return clean["world_size"] if full_size else clean["min_devices"]


def _job_world_size_check(clean: dict, *, limits_of: dict | None = None) -> None:
    """Raises ValidationError naming world_size or min_devices when the job is bigger than this
    installation or its fleet could ever run (job_world_size_limits), or, for a tier that starts
    only at its full size, when the fleet could never give it W devices at once: such a job would
    wait forever. `limits_of` caches the limits by (type, min_devices, devices to start) across the
    jobs of one bulk submission (each costs a query)."""
    start_devices = _job_start_devices(clean)
    key = (clean["accelerator_type"], clean["min_devices"], start_devices)
    # The fleet bounds the devices a job needs to start (W's other bounds are settings and
    # min_devices), and a single device never exceeds it (no device of the type bounds nothing), so
    # a job that starts on one device, the common case, skips the capacity query: a scan of the
    # type's devices that grows with the fleet.
    limits = (limits_of or {}).get(key) or job_world_size_limits(accelerator_type=key[0], min_devices=key[1],
                                                                 fleet=start_devices > 1)
    if limits_of is not None:
        limits_of[key] = limits
    errors = {}
    capacity = limits["max_min_devices"]
    if capacity is not None and clean["min_devices"] > capacity:
        errors["min_devices"] = f"min_devices {clean['min_devices']} is too many: {limits['min_devices_because']}"
    if clean["world_size"] > limits["max_world_size"]:
        errors["world_size"] = (f"world_size {clean['world_size']} is too large (at most "
                                f"{limits['max_world_size']}): {limits['world_size_because']}")
    elif capacity is not None and start_devices > capacity and "min_devices" not in errors:
        errors["world_size"] = (
            f"world_size {clean['world_size']} is too large for a {clean['tier']} job: it starts only on all W "
            f"devices at once (its SLA is counted at W), and {limits['min_devices_because']}. Lower "
            f"world_size to {capacity} or less, or submit it as standard or basic (they start on fewer "
            f"devices and grow)")
    if errors:
        raise ValidationError(errors)


def _job_spec_validate(*, spec, submitted_by, limits_of=None) -> dict:
    """Returns the cleaned spec (job_spec_clean, its bundle resolved, its size checked)."""
    from jobs.bundles import bundle_resolve_for_submit
    clean = job_spec_clean(bundle_resolve_for_submit(spec=spec, user=submitted_by) if isinstance(spec, dict) else spec)
    _job_world_size_check(clean, limits_of=limits_of)
    return clean


# A bulk submission publishes no live push above this many jobs: pages catch up on their next poll.
BULK_PUBLISH_MAX = 20


def _jobs_create(*, team, submitted_by, cleans: Sequence[dict], now) -> list[Job]:
    """Returns new pending Jobs for the cleaned specs, in one transaction: the team's quota claimed
    per accelerator type (one conditional UPDATE each: ValidationError naming min_devices, and
    nothing written, when a type would go over), then the jobs, their W unplaced replicas each
    and their SUBMITTED events in one bulk INSERT per table."""
    needs: dict[str, int] = {}
    for clean in cleans:
        needs[clean["accelerator_type"]] = needs.get(clean["accelerator_type"], 0) + clean["min_devices"]
    with transaction.atomic():
        # The claim counter's row is the lock: two submissions cannot both squeeze under the quota,
        # and the check's cost does not grow with the queue.
        for accelerator_type, devices in needs.items():
            quota = team.quota_for(accelerator_type)
            claimed = team_quota_claim(team=team, accelerator_type=accelerator_type, devices=devices, quota=quota)
            if claimed is not None:
                what = "this job needs" if len(cleans) == 1 else f"these {len(cleans)} jobs need"
                raise ValidationError(
                    {
                        "min_devices": (
                            f"over team quota: team {team.name} may claim {quota} {accelerator_type} "
                            f"device(s); its unfinished jobs already claim {claimed} and {what} "
                            f"{devices} more. Lower min_devices, wait for a job to finish, "
                            f"or ask a team admin for more quota."
                        )
                    }
                )
        jobs = Job.objects.bulk_create([
            Job(team=team, submitted_by=submitted_by, submitted_at=now, state_changed_at=now, **clean)
            for clean in cleans])
        Replica.objects.bulk_create([Replica(job=job, rank=rank) for job in jobs for rank in range(job.world_size)],
                                    batch_size=5000)
        actor = submitted_by if (submitted_by is not None and submitted_by.is_authenticated) else None
        JobEvent.objects.bulk_create([JobEvent(
            job=job, type=JobEvent.Type.SUBMITTED, actor=actor, to_state=S.PENDING, created_at=now,
            extra_data={"tier": job.tier, "world_size": job.world_size, "min_devices": job.min_devices})
            for job in jobs], batch_size=2000)
        if len(jobs) <= BULK_PUBLISH_MAX:
            for job in jobs:
                job_publish_updated(job=job, new=True)
    return jobs


def _insert_select(instance, *, expressions: Mapping[str, str]) -> tuple[list[str], list[str], list]:
    """Returns (quoted columns, select expressions, parameters) that INSERT the unsaved model
    `instance` as Django's own INSERT would (defaults, auto_now, JSON adaptation), its auto pk left
    out, and the columns named in `expressions` (by field name) taking that SQL instead of a value."""
    qn = connection.ops.quote_name
    columns, selects, params = [], [], []
    for field in instance._meta.local_concrete_fields:
        if field.primary_key:
            continue
        columns.append(qn(field.column))
        if field.name in expressions:
            selects.append(expressions[field.name])
            continue
        value = field.get_db_prep_save(field.pre_save(instance, True), connection)
        if value is None:
            # NULL in the text: fewer parameters (psycopg caches its parse of a statement only
            # up to 50), and a few texts at most (which columns are NULL), each prepared once
            selects.append("NULL")
        else:
            selects.append("%s")
            params.append(value)
    return columns, selects, params


def job_submit_direct(*, team: Team, submitted_by, spec: dict, now: datetime | None = None) -> Job | None:
    """Returns a new pending Job exactly as job_submit writes it (W unplaced replicas, a SUBMITTED
    event, its min_devices claimed on the team's TeamQuotaClaim counter), or None, with nothing
    written, when the claim would pass the team's quota or the team has no counter for the type
    yet: the caller then calls job_submit, which says why (or creates the counter).

    The fast path of POST /api/jobs/ (jobs/submit_api.py). The caller vouches that `submitted_by`
    is a member of `team` (jobs.selectors.submitter_by_token read both in one query); the spec is
    cleaned and size-checked here as job_submit does (ValidationError). Written without the ORM's
    per-statement cost: ONE statement on PostgreSQL (the claim, the job, its replicas and its event
    as data-modifying CTEs: all or nothing, one round trip), one short transaction elsewhere
    (SQLite). The live push is the caller's, after this returns (committed): job_updated_message.
    """
    clean = _job_spec_validate(spec=spec, submitted_by=submitted_by)
    now = now or timezone.now()
    quota = team.quota_for(clean["accelerator_type"])
    job = Job(team=team, submitted_by=submitted_by, submitted_at=now, state_changed_at=now, **clean)
    event = JobEvent(job=job, type=JobEvent.Type.SUBMITTED, actor=submitted_by, to_state=S.PENDING, created_at=now,
                     extra_data={"tier": job.tier, "world_size": job.world_size, "min_devices": job.min_devices})
    qn = connection.ops.quote_name
    claim = (f"UPDATE {qn(TeamQuotaClaim._meta.db_table)} SET {qn('claimed')} = {qn('claimed')} + %s "
             f"WHERE {qn('team_id')} = %s AND {qn('accelerator_type')} = %s AND {qn('claimed')} <= %s")
    claim_params = [job.min_devices, team.pk, job.accelerator_type, quota - job.min_devices]
    replica = Replica(job=job, rank=0)
    if connection.vendor == "postgresql":
        job_columns, job_selects, job_params = _insert_select(job, expressions={})
        replica_columns, replica_selects, replica_params = _insert_select(
            replica, expressions={"job": f"new_job.{qn('id')}", "rank": "ranks.rank"})
        event_columns, event_selects, event_params = _insert_select(event, expressions={"job": f"new_job.{qn('id')}"})
        # Every sub-statement runs once, on one snapshot; the job is inserted only if the claim
        # matched a row, the replicas and event only for an inserted job.
        sql = (f"WITH claim AS ({claim} RETURNING 1), "
               f"new_job AS (INSERT INTO {qn(Job._meta.db_table)} ({', '.join(job_columns)}) "
               f"SELECT {', '.join(job_selects)} FROM claim RETURNING {qn('id')}), "
               f"replicas AS (INSERT INTO {qn(Replica._meta.db_table)} ({', '.join(replica_columns)}) "
               f"SELECT {', '.join(replica_selects)} FROM new_job, generate_series(0, %s) AS ranks(rank)), "
               f"event AS (INSERT INTO {qn(JobEvent._meta.db_table)} ({', '.join(event_columns)}) "
               f"SELECT {', '.join(event_selects)} FROM new_job) "
               f"SELECT {qn('id')} FROM new_job")
        with cursor_prepared() as cursor:
            cursor.execute(sql, [*claim_params, *job_params, *replica_params, job.world_size - 1, *event_params])
            row = cursor.fetchone()
        if row is None:
            return None
        job.pk = row[0]
    else:
        job_columns, job_selects, job_params = _insert_select(job, expressions={})
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(claim, claim_params)
            if cursor.rowcount != 1:
                return None
            cursor.execute(f"INSERT INTO {qn(Job._meta.db_table)} ({', '.join(job_columns)}) "
                           f"VALUES ({', '.join(job_selects)})", job_params)
            job.pk = replica.job_id = event.job_id = cursor.lastrowid
            replica_columns, replica_selects, replica_params = _insert_select(
                replica, expressions={"rank": "ranks.rank"})
            cursor.execute(f"WITH RECURSIVE ranks(rank) AS (SELECT 0 UNION ALL SELECT rank + 1 FROM ranks "
                           f"WHERE rank + 1 < %s) INSERT INTO {qn(Replica._meta.db_table)} "
                           f"({', '.join(replica_columns)}) SELECT {', '.join(replica_selects)} FROM ranks",
                           [job.world_size, *replica_params])
            event_columns, event_selects, event_params = _insert_select(event, expressions={})
            cursor.execute(f"INSERT INTO {qn(JobEvent._meta.db_table)} ({', '.join(event_columns)}) "
                           f"VALUES ({', '.join(event_selects)})", event_params)
    job._state.adding, job._state.db = False, connection.alias
    return job


def job_submit(*, team, submitted_by, spec, now=None):
    """Returns a new pending Job with W unplaced replicas and a SUBMITTED event.

    Raises PermissionDenied unless `submitted_by` is a member of `team` (or a global
    admin), ValidationError for a bad spec, for a W or min_devices beyond what the
    installation and its fleet could ever run (job_world_size_limits), or when the job's
    min_devices would put the team's unfinished jobs over its quota for the accelerator type.
    A job costs W Replica rows (one per rank; placing it rewrites them), which is why W is bounded.
    """
    if not user_can_see_team(user=submitted_by, team_id=team.pk):
        raise PermissionDenied(f"you are not a member of team {team.name}")
    clean = _job_spec_validate(spec=spec, submitted_by=submitted_by)
    return _jobs_create(team=team, submitted_by=submitted_by, cleans=[clean], now=now or timezone.now())[0]


def jobs_submit_bulk(*, team, submitted_by, specs: Sequence[object], now=None) -> list[Job]:
    """Returns the new pending Jobs, one per spec in order (Slurm's --array): all or nothing.

    The same rules as job_submit for every spec. ValidationError({"jobs": {index: {field: message}}})
    names every bad spec by its index (nothing is written); ValidationError({"jobs": ...}) too for
    an empty list, more than settings.MERIDIAN_MAX_BULK_JOBS specs or more than
    settings.MERIDIAN_MAX_BULK_RANKS ranks in all (each rank is a Replica row); a quota error names
    min_devices with what all the jobs together need. Live pushes only up to BULK_PUBLISH_MAX jobs.
    """
    if not user_can_see_team(user=submitted_by, team_id=team.pk):
        raise PermissionDenied(f"you are not a member of team {team.name}")
    max_jobs = int(settings.MERIDIAN_MAX_BULK_JOBS)
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValidationError({"jobs": "give a non-empty list of job specs"})
    if len(specs) > max_jobs:
        raise ValidationError({"jobs": f"at most {max_jobs} jobs in one bulk submission "
                                       f"(MERIDIAN_MAX_BULK_JOBS); got {len(specs)}: split them"})
    cleans, errors, limits_of = [], {}, {}
    for index, spec in enumerate(specs):
        try:
            cleans.append(_job_spec_validate(spec=spec, submitted_by=submitted_by, limits_of=limits_of))
        except ValidationError as error:
            errors[str(index)] = error.message_dict if hasattr(error, "error_dict") else {"spec": error.messages}
    if errors:
        raise JobSpecsInvalid(errors)
    ranks, max_ranks = sum(clean["world_size"] for clean in cleans), int(settings.MERIDIAN_MAX_BULK_RANKS)
    if ranks > max_ranks:
        raise ValidationError({"jobs": f"these jobs have {ranks} ranks in all; one bulk submission may have at most "
                                       f"{max_ranks} (MERIDIAN_MAX_BULK_RANKS: each rank is a row): split them"})
    return _jobs_create(team=team, submitted_by=submitted_by, cleans=cleans, now=now or timezone.now())


def job_generation_bump(job) -> int:
    """Moves `job` to its next placement generation (in the database and on `job`); returns it.
    Every copy of an older generation is then fenced: its reports are rejected and its agent kills
    it without a checkpoint (jobs.workflows). Call it before the transition that places the job
    again (or sends it back in line)."""
    Job.objects.filter(pk=job.pk).update(generation=F("generation") + 1)
    job.generation += 1
    return job.generation


def job_cancel(*, job, by, reason=""):
    """Cancels `job`; returns it. Members of its team, and global admins, may cancel.

    Raises PermissionDenied for others and IllegalTransition when the job has finished.
    The devices are released at once in the database; agents stop the ranks on their
    next reconcile (level-triggered).
    """
    if not user_can_see_team(user=by, team_id=job.team_id):
        raise PermissionDenied("you may cancel only your teams' jobs")
    for _attempt in range(3):
        try:
            return job_transition(job=job, to=S.CANCELLED, reason=reason or f"cancelled by {by}", by=by)
        except StaleJobState:
            # The control loop moved it meanwhile; cancelling is still wanted.
            job.refresh_from_db()
    raise IllegalTransition(
        job_id=job.pk, from_state=job.state, to_state=S.CANCELLED,
        message=f"job {job.pk} kept changing state; try cancelling again",
    )


# --- progress and checkpoints (called by the control loop on agents' reports) ---------------


def checkpoint_record(*, job, step, engine, uri, size_bytes, sha256="", now=None):
    """Returns a new Checkpoint and moves job.last_checkpoint_* forward (never backward)."""
    return checkpoints_record(checkpoints=[CheckpointNew(job=job, step=step, engine=engine, uri=uri,
                                                         size_bytes=size_bytes, sha256=sha256)], now=now)[0]


@dataclass(frozen=True)
class CheckpointNew:
    """One checkpoint to record (checkpoints_record)."""

    job: Job
    step: int
    engine: str
    uri: str
    size_bytes: int
    sha256: str = ""
    left_out: tuple[str, ...] = ()  # what the checkpoint could not carry, with why (its node said)
    # where its time went, in seconds per stage (protocol.launch.CheckpointSeconds), and how many of
    # its bytes came from devices (GPU state); None where the node did not say
    seconds: dict | None = None
    device_bytes: int | None = None


def _stages_reason(new: CheckpointNew) -> str:
    """Returns where a checkpoint's time went, stage by stage with its rate, in words ("" when its
    node did not say): reaching the cut (with the framework engine the ranks' writes, device ->
    host -> staging, are part of it), the engine's dump (with the CRIU engine on a GPU job the
    driver's move of the ranks' CUDA state into host memory is part of it, and the move back
    follows it), the commit (staging -> store)."""
    seconds = new.seconds
    if not seconds:
        return ""
    gb = new.size_bytes / 1e9

    def rate(size_gb, took):
        return f", {size_gb / took:.2f} GB/s" if took and took > 0 and size_gb > 0 else ""
    stages = [f"cut {seconds['cut']:.2f} s"]
    if seconds.get("save") is not None:
        device_gb = (new.device_bytes or 0) / 1e9
        from_devices = f", {device_gb:.2f} GB from devices{rate(device_gb, seconds['save'])}" if device_gb else ""
        stages.append(f"of which the ranks' writes (device -> host -> staging) {seconds['save']:.2f} s{from_devices}")
    if seconds.get("dump"):
        stages.append(f"dump {seconds['dump']:.2f} s{rate(gb, seconds['dump'])}")
    if seconds.get("device_out") is not None:
        stages.append(f"of which the ranks' CUDA state device -> host {seconds['device_out']:.2f} s")
    if seconds.get("device_in") is not None:
        stages.append(f"then host -> device {seconds['device_in']:.2f} s")
    stages.append(f"staging -> store {seconds['commit']:.2f} s{rate(gb, seconds['commit'])}")
    return f"{gb:.3f} GB in {seconds['total']:.2f} s: " + "; ".join(stages)


def _checkpoint_reason(new: CheckpointNew) -> str:
    """The reason of a checkpoint's event: what it left out first (a person must hear that), then
    its stages, within JobEvent.reason's 500 characters."""
    return "; ".join(part for part in (_left_out_reason(new.left_out), _stages_reason(new)) if part)[:500]


def _left_out_reason(left_out: tuple[str, ...]) -> str:
    """Returns the reason of a checkpoint's event: "" when it carried the whole job, else what it left
    out (the first line, and how many more its extra_data lists), within JobEvent.reason's 500."""
    if not left_out:
        return ""
    more = f" (+{len(left_out) - 1} more: see extra_data.left_out)" if len(left_out) > 1 else ""
    return f"left out of the checkpoint: {left_out[0]}"[:500 - len(more)] + more


def checkpoints_record(*, checkpoints: Sequence[CheckpointNew], now=None) -> list[Checkpoint]:
    """Returns the new Checkpoint rows of `checkpoints` (in order), each with its CHECKPOINTED event;
    moves each job's last_checkpoint_* forward to its highest step (never backward; of equal steps
    the last one), refreshes each job instance given and pushes it to the pages on commit.

    Four statements however many checkpoints (a heartbeat reports one per copy): the rows, the
    jobs' UPDATE ... FROM (VALUES ...), the events, the jobs read back."""
    if not checkpoints:
        return []
    now = now or timezone.now()
    newest: dict[int, CheckpointNew] = {}
    for new in checkpoints:
        if new.job.pk not in newest or new.step >= newest[new.job.pk].step:
            newest[new.job.pk] = new
    table = Job._meta.db_table
    values = ", ".join(["(CAST(%s AS BIGINT), CAST(%s AS BIGINT), CAST(%s AS BIGINT))"] * len(newest))
    at = Job._meta.get_field("last_checkpoint_at").get_db_prep_save(now, connection)
    with transaction.atomic():
        rows = Checkpoint.objects.bulk_create([
            Checkpoint(job=new.job, step=new.step, engine=new.engine, uri=new.uri, bytes=new.size_bytes,
                       sha256=new.sha256, created_at=now) for new in checkpoints])
        with connection.cursor() as cursor:
            cursor.execute(
                f"WITH reported(id, step, size) AS (VALUES {values}) "
                f"UPDATE {table} SET last_checkpoint_step = reported.step, last_checkpoint_at = %s, "
                f"checkpoint_bytes = reported.size, updated_at = %s FROM reported WHERE {table}.id = reported.id "
                f"AND ({table}.last_checkpoint_step IS NULL OR {table}.last_checkpoint_step <= reported.step)",
                [x for job_id, new in newest.items() for x in (job_id, new.step, new.size_bytes)] + [at, at])
        desired_changed(job_ids=newest)  # as job_event_add does
        JobEvent.objects.bulk_create([
            JobEvent(job=new.job, type=JobEvent.Type.CHECKPOINTED, reason=_checkpoint_reason(new),
                     extra_data={"step": new.step, "engine": new.engine, "bytes": new.size_bytes, "uri": new.uri,
                                 **({"left_out": list(new.left_out)} if new.left_out else {}),
                                 **({"seconds": new.seconds} if new.seconds else {}),
                                 **({"device_bytes": new.device_bytes} if new.device_bytes is not None else {})})
            for new in checkpoints])
        fresh = Job.objects.in_bulk(list(newest))
        jobs = {id(new.job): new.job for new in checkpoints}  # each instance given, once
        for job in jobs.values():
            for field in Job._meta.concrete_fields:  # job.refresh_from_db(), from the one read
                setattr(job, field.attname, getattr(fresh[job.pk], field.attname))
        for job in jobs.values():
            job_publish_updated(job=job)
    return rows


def checkpoints_of_refused_run_retire(*, job, store, now=None) -> int:
    """Returns how many of `job`'s checkpoints it retired: every live one outside `store`, the
    folder of the copy whose launcher started the script again from scratch (its resume was
    refused; if_resume_refused "restart"). Those belong to the refused run: restoring one would be
    refused again and throw away the new run's progress. job.last_checkpoint_* then follow the new
    run: its newest live checkpoint (one may already be recorded, from the same report), else
    None. Writes one MESSAGE event saying what was retired, and none when nothing was (a repeated
    call is a no-op). Call it inside the transaction that records the restart."""
    now = now or timezone.now()
    with transaction.atomic():
        live = list(Checkpoint.objects.select_for_update().filter(job=job, retired_at__isnull=True)
                    .order_by("-step", "-id"))
        refused = [c for c in live if checkpoint_uri_problem(c.uri, store=store) is not None]
        if not refused:
            return 0
        Checkpoint.objects.filter(pk__in=[c.pk for c in refused], retired_at__isnull=True).update(retired_at=now)
        newest = next((c for c in live if c not in refused), None)
        Job.objects.filter(pk=job.pk).update(
            last_checkpoint_step=newest.step if newest else None,
            last_checkpoint_at=newest.created_at if newest else None,
            checkpoint_bytes=newest.bytes if newest else 0, updated_at=now)
        steps = sorted(c.step for c in refused)
        job_event_add(
            job=job, type=JobEvent.Type.MESSAGE,
            reason=(f"restarted from scratch: {len(refused)} checkpoint(s) of the refused run retired "
                    f"(newest step {steps[-1]}); it resumes from the new run's checkpoints"),
            extra={"retired_checkpoints": len(refused), "retired_steps": steps,
                   "last_checkpoint_step": newest.step if newest else None, "generation": job.generation})
        job.refresh_from_db()
        job_publish_updated(job=job)
    return len(refused)


# --- preemption approvals ----------------------------------------------------------------


def _preemption_payload(request):
    return {
        "request_id": request.pk,
        "job_id": request.job_id,
        "state": request.state,
    }


def _preemption_publish(*, request, team_id):
    events_publish(
        groups=[GROUP_APPROVALS, group_for_job(request.job_id), group_for_team(team_id)],
        type="jobs.preemption_updated",
        payload={"preemption": _preemption_payload(request)},
    )


def preemption_request_create(*, job, reason, lost_work_seconds, extra=None, ttl=None, now=None):
    """Returns the job's pending PreemptionRequest, creating it if there is none.

    Called by the control loop when preempting `job` would break its SLA. Idempotent:
    a second call while one is pending returns the pending one unchanged.
    """
    now = now or timezone.now()
    with transaction.atomic():
        existing = PreemptionRequest.objects.filter(job=job, state=PreemptionRequest.State.PENDING).first()
        if existing:
            return existing
        request = PreemptionRequest.objects.create(
            job=job,
            reason=reason[:500],
            lost_work_seconds=lost_work_seconds,
            extra_data=extra or {},
            requested_at=now,
            expires_at=now + (ttl or PREEMPTION_REQUEST_TTL),
        )
        job_event_add(
            job=job,
            type=JobEvent.Type.PREEMPTION_REQUESTED,
            reason=reason,
            extra={"request_id": request.pk, "lost_work_seconds": lost_work_seconds, **(extra or {})},
        )
        _preemption_publish(request=request, team_id=job.team_id)
    return request


def _preemption_decide(*, request, to, by, note, event_type, now):
    now = now or timezone.now()
    with transaction.atomic():
        updated = PreemptionRequest.objects.filter(
            pk=request.pk, state=PreemptionRequest.State.PENDING, expires_at__gt=now
        ).update(state=to, decided_by=by, decided_at=now, note=note)
        if updated != 1:
            request.refresh_from_db()
            if request.state == PreemptionRequest.State.PENDING:
                raise IllegalTransition(
                    job_id=request.job_id, from_state=request.state, to_state=to,
                    message=f"preemption request {request.pk} expired at {request.expires_at:%Y-%m-%d %H:%M:%S} UTC",
                )
            raise IllegalTransition(
                job_id=request.job_id, from_state=request.state, to_state=to,
                message=f"preemption request {request.pk} was already {request.state}",
            )
        request.refresh_from_db()
        job_event_add(
            job=request.job, type=event_type, reason=note, actor=by,
            extra={"request_id": request.pk},
        )
        _preemption_publish(request=request, team_id=request.job.team_id)
    return request


def preemption_approve(*, request, by, note="", now=None):
    """Approves a pending request; returns it. The control loop then preempts the job.

    Raises PermissionDenied unless `by` is a capacity manager or admin of the job's
    team (or a global admin); IllegalTransition if it is no longer pending or expired.
    """
    if not user_can_approve_preemptions(user=by, team_id=request.job.team_id):
        raise PermissionDenied("only capacity managers of the job's team may approve preemptions")
    return _preemption_decide(
        request=request, to=PreemptionRequest.State.APPROVED, by=by, note=note,
        event_type=JobEvent.Type.PREEMPTION_APPROVED, now=now,
    )


def preemption_deny(*, request, by, note="", now=None):
    """Denies a pending request; returns it. The job keeps its devices. Same rules as approve."""
    if not user_can_approve_preemptions(user=by, team_id=request.job.team_id):
        raise PermissionDenied("only capacity managers of the job's team may deny preemptions")
    return _preemption_decide(
        request=request, to=PreemptionRequest.State.DENIED, by=by, note=note,
        event_type=JobEvent.Type.PREEMPTION_DENIED, now=now,
    )


def preemption_expire(*, request, now=None):
    """Marks a pending request past its expires_at as expired; returns True if this call did."""
    now = now or timezone.now()
    with transaction.atomic():
        updated = PreemptionRequest.objects.filter(
            pk=request.pk, state=PreemptionRequest.State.PENDING, expires_at__lte=now
        ).update(state=PreemptionRequest.State.EXPIRED, decided_at=now)
        if updated != 1:
            return False
        request.refresh_from_db()
        job_event_add(job=request.job, type=JobEvent.Type.PREEMPTION_EXPIRED, extra={"request_id": request.pk})
        _preemption_publish(request=request, team_id=request.job.team_id)
    return True


def preemption_expire_due(*, now=None):
    """Expires every pending request past its deadline; returns how many it expired."""
    now = now or timezone.now()
    due = PreemptionRequest.objects.filter(
        state=PreemptionRequest.State.PENDING, expires_at__lte=now
    ).select_related("job")
    return sum(preemption_expire(request=request, now=now) for request in due)


# --- teams --------------------------------------------------------------------------------


def team_create(*, name, slug, quotas=None):
    """Returns a new Team; raises ValidationError for an unknown accelerator type or a negative quota."""
    quotas = quotas or {}
    errors = [
        f"{key!r}: {value!r}" for key, value in quotas.items()
        if key not in ACCELERATOR_TYPES or isinstance(value, bool) or not isinstance(value, int) or value < 0
    ]
    if errors:
        raise ValidationError(
            {"quotas": f"quotas map a known accelerator type to a whole number >= 0; bad: {', '.join(errors)}"}
        )
    return Team.objects.create(name=name, slug=slug, quotas=quotas)


def membership_set(*, team, user, role):
    """Returns the user's Membership in `team` with `role`, creating or updating it."""
    membership, _ = Membership.objects.update_or_create(team=team, user=user, defaults={"role": role})
    return membership


# --- lost nodes ------------------------------------------------------------------------------


def node_lost_after() -> timedelta:
    """A node whose agent has not reported for this long is lost (settings.MERIDIAN_NODE_LOST_AFTER_SECONDS)."""
    return timedelta(seconds=float(settings.MERIDIAN_NODE_LOST_AFTER_SECONDS))


def node_lost_sweep(*, now: datetime) -> list[str]:
    """Marks ready/draining nodes whose agent missed heartbeats for node_lost_after() as lost.

    Returns the hostnames marked. Nodes that never reported (last_heartbeat null) are left
    alone: they were created by a fleet description and have no agent yet.

    A node is alive if its last full heartbeat (Node.last_heartbeat) or its last lease (Redis,
    fleet/leases.py: read in one batch for the nodes the database finds stale) is newer than the
    cutoff. When Redis cannot be reached the database decides alone: agents whose lease fails send
    full heartbeats instead, and the leases flushed to last_heartbeat lag by at most
    MERIDIAN_LEASE_FLUSH_SECONDS (fleet.leases.lease_settings_check). The nodes marked lost get
    their desired serial bumped: a node that comes back learns it at its next lease.
    """
    cutoff = now - node_lost_after()
    stale = dict(Node.objects.filter(last_heartbeat__lt=cutoff).exclude(state=Node.State.LOST)
                 .values_list("pk", "hostname"))
    for node_id in nodes_alive_by_lease(node_ids=stale, cutoff=cutoff):
        del stale[node_id]
    hostnames = sorted(stale.values())
    if hostnames:
        Node.objects.filter(pk__in=list(stale), last_heartbeat__lt=cutoff).update(state=Node.State.LOST)
        lost_ids = list(stale)
        transaction.on_commit(lambda: desired_serials_bump(node_ids=lost_ids), robust=True)
        held = Replica.objects.filter(device__node__hostname__in=hostnames).exclude(
            job__state__in=Job.TERMINAL_STATES).values_list("job_id", flat=True).distinct()
        for job in Job.objects.filter(pk__in=list(held)):
            job_event_add(job=job, type=JobEvent.Type.NODE_LOST,
                          reason=f"node(s) {', '.join(hostnames)} missed heartbeats for "
                                 f"{node_lost_after().total_seconds():.0f} s")
        logger.warning("nodes lost (missed heartbeats): %s", ", ".join(hostnames))
    return hostnames
