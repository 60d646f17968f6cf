"""The control loop's tick: selectors build the Snapshot from the database, the scheduler core
returns a Plan, services apply it in one transaction.

    tick_run(now=None) -> TickResult        the whole tick (what the Celery task calls)
    snapshot_build(now=...) -> SnapshotIndex the read half (selectors), also for the bench
    plan_apply(index=..., plan=..., now=...) the write half (services), inside the caller's transaction

How the database maps onto the core's model:
  * Jobs in pending / preempted are PENDING; in scheduled / running they are RUNNING and hold
    the accelerators their Replica rows point at.
  * Jobs in the middle of a move (preempting, migrating, resizing) are left out of the tick:
    the agents are still acting on them. The devices they keep (a migrating job's new ones, a
    resizing job's current ones) are shown to the core as unhealthy, so nothing else lands on
    them until the move finishes (jobs/moves.py). The devices a move gives up (all of a
    preempting job's, a migrating job's old ones, the ones a shrink drops; recorded as
    "released_devices" on the event of the job's entry into its moving state) are free with
    releasing_until = the move's current step deadline: the core uses them last, and a Start on
    them carries starts_at (written to its PLACED event), as the previous holder is still
    stopping; the agents launch there only after that stop.
  * A node whose agent missed heartbeats is LOST (node_lost_sweep); the core moves its jobs,
    which restart from their last checkpoint.
  * An approved PreemptionRequest decided after the job's last start sets preemption_approved.
  * A running job's last_resize_time is when its newest resize Move was created.

Applying the plan (all in one transaction, with JobEvents). Every new placement bumps the job's
generation (agents' reports of older copies are then rejected: fencing). Preempt, Migrate and
Resize of a running job create a Move (jobs/moves.py) whose Celery chain runs its steps:
  Start        pending/preempted -> scheduled, replicas on the devices (rank_layout), generation+1
  Preempt      running -> preempting, replicas released, Move(preemption): barrier, checkpoint,
               store, release (-> preempted); scheduled -> pending; a job on a lost node ->
               preempted at once, generation+1 (it restarts from its last checkpoint)
  Preempt needing approval: preemption_request_create (idempotent; nothing else happens)
  Migrate      running -> migrating, replicas on the new devices, generation+1, Move(migration):
               live: barrier, checkpoint, store (old node), restore (new node), release (->
               running). From a checkpoint (lost node): restore, release
  Resize       running -> resizing, replicas re-laid on the new devices, Move(resize): barrier,
               resize (the agent splices), release (-> running)
  waiting      wait_reason and queue_position written to every waiting job

Policy knobs come from the environment so tests and the demo can use short times:
  MERIDIAN_MIN_RUN_SECONDS (default 600), MERIDIAN_STANDARD_SLA_FLOOR (0.70),
  MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS (600: a job is not grown again sooner after a resize),
  MERIDIAN_PREMIUM_RESERVE_DEVICES (0: free devices per region and type kept for Premium jobs),
  MERIDIAN_NODE_LOST_AFTER_SECONDS (30), MERIDIAN_ACCOUNTING_SECONDS (10), MERIDIAN_JOB_MAX_SPREAD ("node": the meridian-run
  launcher runs all of a job's ranks on one host; "region" for hollow/scale runs).
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import numpy as np
from django.db import connection, transaction
from django.db.models import F, Max, Q, Subquery
from django.utils import timezone

import scheduler
from fleet.models import Accelerator, Node
from jobs.models import ControlLoopLease, Job, JobEvent, Move, PreemptionRequest, Replica, Team
from jobs.moves import move_create
from jobs.services import job_event_add, job_transition, preemption_request_create

logger = logging.getLogger(__name__)
S = Job.State

TICK_LEASE = "scheduler-tick"
TICK_LEASE_SECONDS = 60.0
RUNNING_STATES = (S.SCHEDULED, S.RUNNING)
MOVING_STATES = (S.PREEMPTING, S.MIGRATING, S.RESIZING)
WAITING_STATES = (S.PENDING, S.PREEMPTED)
SPREADS = {"node": scheduler.SPREAD_NODE, "rack": scheduler.SPREAD_RACK,
           "cluster": scheduler.SPREAD_CLUSTER, "region": scheduler.SPREAD_REGION}
NODE_STATUS = {Node.State.READY: scheduler.NODE_READY, Node.State.DRAINING: scheduler.NODE_DRAINING,
               Node.State.LOST: scheduler.NODE_LOST}
TIERS = {"premium": scheduler.PREMIUM, "standard": scheduler.STANDARD, "basic": scheduler.BASIC}
_HOLDER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _env_float(name, default):
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def _env_count(name, default):
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number") from None
    if count < 0:
        raise ValueError(f"{name}={value!r} must be 0 or more")
    return count


def policy_settings():
    """Returns the PolicySettings of this deployment (environment overrides, see module doc)."""
    return scheduler.PolicySettings(
        min_run_seconds=_env_float("MERIDIAN_MIN_RUN_SECONDS", 600.0),
        standard_sla_floor=_env_float("MERIDIAN_STANDARD_SLA_FLOOR", 0.70),
        min_resize_interval_seconds=_env_float("MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS", 600.0),
        premium_reserve_devices=_env_count("MERIDIAN_PREMIUM_RESERVE_DEVICES", 0),
    )


def job_max_spread():
    name = os.environ.get("MERIDIAN_JOB_MAX_SPREAD", "node").strip().lower()
    if name not in SPREADS:
        raise ValueError(f"MERIDIAN_JOB_MAX_SPREAD={name!r}; choose one of {', '.join(SPREADS)}")
    return SPREADS[name]


def accounting_period():
    """Device-time is accrued at most this often (MERIDIAN_ACCOUNTING_SECONDS, default 10): two
    UPDATEs over every unfinished job are the tick's biggest write at scale."""
    return timedelta(seconds=_env_float("MERIDIAN_ACCOUNTING_SECONDS", 10.0))


def node_lost_after():
    return timedelta(seconds=_env_float("MERIDIAN_NODE_LOST_AFTER_SECONDS", 30.0))


# --- the lease: one leader per tick -----------------------------------------------------------


def tick_lease_claim(*, now, holder=_HOLDER, seconds=TICK_LEASE_SECONDS, name=TICK_LEASE):
    """Returns True when `holder` now leads `name` (until now + seconds), False if another does.

    A conditional UPDATE that only one caller can win (healthchecks' sendalerts): the row is
    free when its lease expired or the same holder renews it.
    """
    ControlLoopLease.objects.get_or_create(name=name)
    updated = ControlLoopLease.objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__lt=now) | Q(holder=holder), name=name
    ).update(holder=holder, expires_at=now + timedelta(seconds=seconds))
    return updated == 1


def tick_lease_release(*, holder=_HOLDER, name=TICK_LEASE):
    ControlLoopLease.objects.filter(name=name, holder=holder).update(holder="", expires_at=None)


# --- selectors: the snapshot ----------------------------------------------------------------


@dataclass
class SnapshotIndex:
    """The Snapshot plus the maps back to database ids that applying a plan needs."""

    snapshot: scheduler.Snapshot
    accelerator_ids: np.ndarray  # int64[N]: Accelerator.pk of snapshot device i
    accelerator_node_ids: np.ndarray  # int64[N]: Node.pk of device i
    job_rows: list  # dicts of the Job rows in snapshot order
    region_ids: list  # Region.pk of snapshot region index r
    hostnames: dict = field(default_factory=dict)  # Node.pk -> hostname
    seconds: dict = field(default_factory=dict)


def _index(values):
    """Returns (codes, uniques): codes[i] = position of values[i] in uniques (first-seen order)."""
    uniques, codes = {}, []
    for v in values:
        codes.append(uniques.setdefault(v, len(uniques)))
    return np.asarray(codes, np.int32), list(uniques)


def _epoch_sql(column):
    """Returns SQL for `column` (a datetime) as float seconds since the epoch, on this database."""
    if connection.vendor == "postgresql":
        return f"EXTRACT(EPOCH FROM {column})::float8"
    if connection.vendor == "sqlite":
        return f"(julianday({column}) - 2440587.5) * 86400.0"
    raise NotImplementedError(f"the tick supports PostgreSQL and SQLite, not {connection.vendor}")


def snapshot_build(*, now):
    """Returns a SnapshotIndex of the fleet and the unfinished jobs at `now` (aware datetime).

    A handful of queries whatever the fleet's size (values_list, no model instances per device).
    """
    t0 = time.perf_counter()
    nodes = list(Node.objects.order_by("id").values_list("id", "cluster_id", "cluster__region_id", "rack", "state",
                                                         "hostname"))
    # The two per-device tables are read with plain cursors into numpy: at 100k devices the ORM's
    # per-row machinery would cost seconds.
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, node_id, type, healthy FROM {Accelerator._meta.db_table} ORDER BY id")
        acc_rows = cursor.fetchall()
        holding = tuple(RUNNING_STATES) + tuple(MOVING_STATES)
        cursor.execute(
            f"SELECT r.device_id, r.job_id, j.state FROM {Replica._meta.db_table} r "
            f"JOIN {Job._meta.db_table} j ON j.id = r.job_id "
            f"WHERE r.device_id IS NOT NULL AND j.state IN ({', '.join(['%s'] * len(holding))})",
            [str(x) for x in holding])
        holder_rows = cursor.fetchall()
    job_columns = ("id", "team_id", "tier", "accelerator_type", "world_size", "min_devices", "state",
                   "submitted_at", "attained_device_seconds", "ideal_device_seconds", "last_checkpoint_at",
                   "last_checkpoint_step", "checkpoint_bytes", "last_started_at", "name")
    times = {"submitted_at", "last_checkpoint_at", "last_started_at"}
    select = ", ".join(_epoch_sql(c) if c in times else c for c in job_columns)
    terminal = sorted(str(x) for x in Job.TERMINAL_STATES)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {select} FROM {Job._meta.db_table} WHERE state NOT IN "
                       f"({', '.join(['%s'] * len(terminal))}) ORDER BY id", terminal)
        jobs = [dict(zip(job_columns, row)) for row in cursor.fetchall()]
        # When each running job last changed its device count: its newest resize Move (grow or
        # shrink), so min_resize_interval_seconds holds across ticks. One grouped query.
        running_states = sorted(str(x) for x in RUNNING_STATES)
        cursor.execute(f"SELECT m.job_id, MAX({_epoch_sql('m.created_at')}) FROM {Move._meta.db_table} m "
                       f"JOIN {Job._meta.db_table} j ON j.id = m.job_id WHERE m.kind = %s AND j.state IN "
                       f"({', '.join(['%s'] * len(running_states))}) GROUP BY m.job_id",
                       [str(Move.Kind.RESIZE), *running_states])
        resized_at = dict(cursor.fetchall())
    approved_since = dict(
        PreemptionRequest.objects.filter(state=PreemptionRequest.State.APPROVED)
        .values_list("job_id", "decided_at")
    )
    approved_since = {job_id: decided.timestamp() for job_id, decided in approved_since.items() if decided}
    teams = list(Team.objects.order_by("id").values_list("id", "name", "quotas"))
    released = _devices_being_released(now=now) if any(r["state"] in MOVING_STATES for r in jobs) else {}
    t1 = time.perf_counter()

    n_acc = len(acc_rows)
    acc_ids = np.fromiter((r[0] for r in acc_rows), np.int64, n_acc)
    acc_node = np.fromiter((r[1] for r in acc_rows), np.int64, n_acc)
    healthy = np.fromiter((bool(r[3]) for r in acc_rows), bool, n_acc)
    type_strings, type_codes = np.unique(np.asarray([r[2] for r in acc_rows], dtype=object).astype(str),
                                         return_inverse=True) if n_acc else (np.asarray([], str), np.zeros(0, np.int64))
    type_names = [str(t) for t in type_strings]
    type_pos = {name: i for i, name in enumerate(type_names)}
    for row in jobs:
        if row["accelerator_type"] not in type_pos:
            type_pos[row["accelerator_type"]] = len(type_names)
            type_names.append(row["accelerator_type"])
    node_ids = np.asarray([r[0] for r in nodes], np.int64)
    node_idx = np.searchsorted(node_ids, acc_node).astype(np.int32)
    node_cluster = np.asarray([r[1] for r in nodes], np.int64)
    node_region = np.asarray([r[2] for r in nodes], np.int64)
    cluster_codes, _ = _index(node_cluster.tolist())
    region_codes, region_ids = _index(node_region.tolist())
    rack_codes, _ = _index([(r[1], r[3]) for r in nodes])
    node_status = np.asarray([NODE_STATUS[r[4]] for r in nodes], np.int8)

    moving = [r for r in jobs if r["state"] in MOVING_STATES]
    in_tick = [r for r in jobs if r["state"] not in MOVING_STATES]
    holder = np.full(n_acc, -1, np.int32)
    held_count = np.zeros(len(in_tick), np.int64)
    if holder_rows:
        h_dev = np.fromiter((r[0] for r in holder_rows), np.int64, len(holder_rows))
        h_job = np.fromiter((r[1] for r in holder_rows), np.int64, len(holder_rows))
        h_moving = np.fromiter((r[2] in MOVING_STATES for r in holder_rows), bool, len(holder_rows))
        dev_idx = np.searchsorted(acc_ids, h_dev)
        healthy[dev_idx[h_moving]] = False  # busy with a move; nobody else may land here yet
        in_ids = np.asarray([r["id"] for r in in_tick], np.int64)  # ascending: ordered by id
        running = ~h_moving
        pos = np.searchsorted(in_ids, h_job[running])
        found = (pos < len(in_ids)) & (in_ids[np.minimum(pos, max(len(in_ids) - 1, 0))] == h_job[running]) \
            if len(in_ids) else np.zeros(int(running.sum()), bool)
        # several ranks share a device when spliced: count each (job, device) once
        pairs = np.unique(np.stack([dev_idx[running][found], pos[found]]), axis=1) if found.any() \
            else np.zeros((2, 0), np.int64)
        holder[pairs[0]] = pairs[1]
        held_count = np.bincount(pairs[1], minlength=len(in_tick)).astype(np.int64)
    releasing_until = np.full(n_acc, -np.inf)
    if released and n_acc:
        r_dev = np.fromiter(released, np.int64, len(released))
        r_until = np.fromiter(released.values(), np.float64, len(released))
        pos = np.minimum(np.searchsorted(acc_ids, r_dev), n_acc - 1)
        known = acc_ids[pos] == r_dev  # a device deleted since is skipped
        releasing_until[pos[known]] = r_until[known]

    team_pos = {t[0]: i for i, t in enumerate(teams)}
    quota = np.zeros((len(teams), len(type_names)), np.int64)
    for i, (_tid, _name, quotas) in enumerate(teams):
        for type_name, amount in (quotas or {}).items():
            if type_name in type_pos:
                quota[i, type_pos[type_name]] = int(amount)
    spread = job_max_spread()
    epoch = lambda seconds: float(seconds) if seconds is not None else float("-inf")  # noqa: E731
    rows = []
    for j, r in enumerate(in_tick):
        running = r["state"] in RUNNING_STATES and held_count[j] > 0
        approved_at = approved_since.get(r["id"])
        rows.append(scheduler.JobRow(
            id=r["id"], team=team_pos[r["team_id"]], tier=TIERS[r["tier"]],
            type_id=type_pos[r["accelerator_type"]], world_size=r["world_size"],
            min_devices=r["min_devices"], state=scheduler.RUNNING if running else scheduler.PENDING,
            submit_time=float(r["submitted_at"]),
            attained_device_seconds=r["attained_device_seconds"],
            ideal_device_seconds=r["ideal_device_seconds"],
            last_checkpoint_time=epoch(r["last_checkpoint_at"]),
            last_checkpoint_step=r["last_checkpoint_step"] or 0,
            checkpoint_bytes=r["checkpoint_bytes"], last_start_time=epoch(r["last_started_at"]),
            last_resize_time=epoch(resized_at.get(r["id"])),
            preemption_approved=bool(approved_at and (r["last_started_at"] is None
                                                      or approved_at >= r["last_started_at"])),
            # also for W=1: the core shrinks elastic victims on a pinned preemptor's node
            # before it preempts whole jobs
            max_spread=spread,
            name=f"#{r['id']} {r['name']}",
        ))
    snap = scheduler.Snapshot(
        accelerators=scheduler.Accelerators(
            type_id=type_codes, node=node_idx, rack=rack_codes[node_idx] if len(node_idx) else [],
            cluster=cluster_codes[node_idx] if len(node_idx) else [],
            region=region_codes[node_idx] if len(node_idx) else [], healthy=healthy, holder=holder,
            releasing_until=releasing_until),
        jobs=scheduler.Jobs.from_rows(rows),
        teams=scheduler.Teams(names=[t[1] for t in teams], quota=quota),
        now=now.timestamp(), type_names=type_names, node_status=node_status,
        settings=policy_settings(), node_names=tuple(r[0] for r in nodes),
    )
    t2 = time.perf_counter()
    return SnapshotIndex(
        snapshot=snap, accelerator_ids=acc_ids,
        accelerator_node_ids=acc_node, job_rows=in_tick + moving,
        region_ids=region_ids, hostnames={r[0]: r[5] for r in nodes}, seconds={"snapshot_queries": t1 - t0, "snapshot_arrays": t2 - t1},
    )


def _devices_being_released(*, now):
    """Returns {Accelerator.pk: seconds since the epoch} for the devices moves are giving up: the
    "released_devices" recorded on each moving job's entry into its current moving state, until
    its active Move's current step deadline (the move ends by then, done or timed out). Without
    an active move (it just ended; the job leaves its moving state in the same transaction)
    now + the step timeout. A device two moves give up gets the later time. Two queries.
    """
    from jobs.moves import step_timeout

    entries = JobEvent.objects.filter(
        type=JobEvent.Type.STATE_CHANGED, job__state__in=MOVING_STATES, to_state=F("job__state")
    ).values("job_id").annotate(newest=Max("id")).values("newest")
    events = JobEvent.objects.filter(id__in=Subquery(entries)).values_list("job_id", "extra_data")
    deadlines = dict(Move.objects.filter(state=Move.State.ACTIVE, job__state__in=MOVING_STATES)
                     .values_list("job_id", "step_deadline"))
    fallback = (now + step_timeout()).timestamp()
    until = {}
    for job_id, extra in events:
        deadline = deadlines[job_id].timestamp() if job_id in deadlines else fallback
        for device_id in (extra or {}).get("released_devices") or ():
            until[int(device_id)] = max(until.get(int(device_id), -np.inf), deadline)
    return until


# --- services: applying the plan ----------------------------------------------------------------


def _place_replicas(*, job, device_ids):
    """Points the job's W replicas at `device_ids` (accelerator pks) by rank_layout; returns rows written."""
    layout = scheduler.rank_layout(device_ids, job.world_size)
    replicas = list(Replica.objects.filter(job_id=job.pk).order_by("rank"))
    for replica in replicas:
        replica.device_id = layout[replica.rank]
    Replica.objects.bulk_update(replicas, ["device"], batch_size=1000)
    return len(replicas)


def _device_ids_held(job_id):
    """Returns the Accelerator pks the job's replicas point at now, ascending."""
    return sorted(set(Replica.objects.filter(job_id=job_id, device__isnull=False).values_list("device_id", flat=True)))


def _nodes_of(index, devices):
    """Returns the hostnames of the nodes holding snapshot devices `devices`."""
    return sorted({index.hostnames[int(index.accelerator_node_ids[d])] for d in devices})


def plan_apply(*, index, plan, now):
    """Applies `plan` (made from `index`) to the database; returns {"rows": n, "counts": {...}}.

    Call inside a transaction. A decision whose job moved meanwhile (StaleJobState) is skipped
    and logged: the next tick decides again from fresh state (level-triggered).
    """
    from jobs.services import IllegalTransition

    snap = index.snapshot
    rows = 0
    counts = {"start": 0, "preempt": 0, "approval": 0, "migrate": 0, "resize": 0, "skipped": 0}
    starts = []
    job_ids = [d.job_id for d in plan.decisions if not isinstance(d, scheduler.Start)]
    jobs = Job.objects.in_bulk(job_ids)
    for decision in plan.decisions:
        if isinstance(decision, scheduler.Start):
            starts.append(decision)
            continue
        job = jobs.get(decision.job_id)
        if job is None:
            continue
        try:
            if isinstance(decision, scheduler.Start):
                starts.append(decision)  # applied together below
                continue
            elif isinstance(decision, scheduler.Preempt) and decision.needs_approval:
                held = snap.allocation_counts()[decision.job]
                since = snap.now - max(snap.jobs.last_checkpoint_time[decision.job],
                                       snap.jobs.last_start_time[decision.job])
                lost = float(held * since) if np.isfinite(since) else 0.0
                preemption_request_create(job=job, reason=decision.reason, lost_work_seconds=lost,
                                          extra={"code": decision.code}, now=now)
                rows += 2
                counts["approval"] += 1
            elif isinstance(decision, scheduler.Preempt):
                rows += _preempt(job=job, decision=decision, now=now)
                counts["preempt"] += 1
            elif isinstance(decision, scheduler.Migrate):
                devices = [int(index.accelerator_ids[d]) for d in decision.devices]
                region = index.region_ids[int(snap.accelerators.region[decision.devices[0]])]
                rows += _migrate(job=job, decision=decision, devices=devices, region=region,
                                 nodes=_nodes_of(index, decision.devices), now=now)
                counts["migrate"] += 1
            elif isinstance(decision, scheduler.Resize):
                devices = [int(index.accelerator_ids[d]) for d in decision.devices]
                if job.state == S.SCHEDULED:
                    # not started yet: just lay it out anew
                    rows += _place_replicas(job=job, device_ids=devices)
                    Job.objects.filter(pk=job.pk).update(device_count=len(devices))
                else:
                    from_devices = job.device_count
                    dropped = sorted(set(_device_ids_held(job.pk)) - set(devices))  # a shrink's; none on growth
                    job = job_transition(job=job, to=S.RESIZING, reason=decision.reason, now=now,
                                         extra={"code": decision.code, "from_devices": from_devices,
                                                "to_devices": len(devices), "released_devices": dropped})
                    rows += _place_replicas(job=job, device_ids=devices)
                    Job.objects.filter(pk=job.pk).update(device_count=len(devices))
                    node_id = _rank0_node(job.pk)
                    move_create(job=job, kind=Move.Kind.RESIZE, reason=decision.reason, now=now,
                                from_node_id=node_id, to_node_id=node_id, from_devices=from_devices,
                                to_devices=len(devices))
                    rows += 2
                rows += 2
                counts["resize"] += 1
        except IllegalTransition as exc:
            logger.info("tick: skipped %s of job %s: %s", decision.kind, decision.job_id, exc)
            counts["skipped"] += 1
    # Starts go last and together: a placement tick may start thousands of jobs. The devices they
    # take were released above (Replica rows are per job, so the order in the database is free).
    started, start_rows = _start_many(index=index, starts=starts, now=now)
    counts["start"] += started
    counts["skipped"] += len(starts) - started
    rows += start_rows
    rows += _write_waiting(plan=plan)
    return {"rows": rows, "counts": counts}


LIVE_PUSH_MAX_STARTS = 50  # above this many starts in one tick, pages catch up on their next poll


def _start_many(*, index, starts, now):
    """Applies Start decisions in bulk: waiting -> scheduled, replicas laid out, events written.

    Returns (jobs started, rows written). The same transitions and events as job_transition, in
    a constant number of statements per batch (a per-job path costs ~10 queries per job).
    """
    if not starts:
        return 0, 0
    snap = index.snapshot
    by_id = {d.job_id: d for d in starts}
    # Lock the rows, then keep only jobs still waiting (a cancel may have won the race).
    current = dict(Job.objects.select_for_update().filter(pk__in=list(by_id)).values_list("id", "state"))
    ready = [job_id for job_id, state in current.items() if state in WAITING_STATES]
    if not ready:
        return 0, 0
    Job.objects.filter(pk__in=ready).update(state=S.SCHEDULED, state_changed_at=now, updated_at=now,
                                             queue_position=None, wait_reason="")
    jobs = list(Job.objects.filter(pk__in=ready).only("id", "team_id", "world_size", "device_count", "region_id",
                                                       "last_checkpoint_step", "progress_step", "state"))
    layouts, events = {}, []
    for job in jobs:
        decision = by_id[job.pk]
        devices = [int(index.accelerator_ids[d]) for d in decision.devices]
        layouts[job.pk] = scheduler.rank_layout(devices, job.world_size)
        job.device_count = len(devices)
        job.region_id = index.region_ids[int(snap.accelerators.region[decision.devices[0]])]
        from_state = current[job.pk]
        events.append(JobEvent(job_id=job.pk, type=JobEvent.Type.STATE_CHANGED, from_state=from_state,
                               to_state=S.SCHEDULED, reason=decision.reason[:500], extra_data={"code": decision.code},
                               created_at=now))
        placed = {"devices": devices, "nodes": _nodes_of(index, decision.devices),
                  "resume_step": job.last_checkpoint_step}
        if decision.starts_at is not None and decision.starts_at > snap.now:
            # a previous holder is still stopping on some of these devices; the node's agent
            # launches this job once that stop finished
            placed["starts_at"] = datetime.fromtimestamp(decision.starts_at, tz=dt_timezone.utc).isoformat()
            placed["starts_in_seconds"] = round(decision.starts_at - snap.now, 1)
        events.append(JobEvent(job_id=job.pk, type=JobEvent.Type.PLACED, reason=decision.reason[:500], created_at=now,
                               extra_data=placed))
    # executemany of one-row UPDATEs (pipelined by psycopg) beats bulk_update's CASE WHEN lists
    # by an order of magnitude at 100k rows, on PostgreSQL and SQLite alike.
    with connection.cursor() as cursor:
        # A new placement is a new generation: reports of any older copy are fenced off.
        cursor.executemany(f"UPDATE {Job._meta.db_table} SET device_count = %s, region_id = %s, "
                           f"generation = generation + 1 WHERE id = %s",
                           [(job.device_count, job.region_id, job.pk) for job in jobs])
        replica_rows = []
        for chunk in range(0, len(ready), 5000):
            ids = ready[chunk:chunk + 5000]
            cursor.execute(f"SELECT id, job_id, rank FROM {Replica._meta.db_table} WHERE job_id IN "
                           f"({', '.join(['%s'] * len(ids))})", ids)
            replica_rows += cursor.fetchall()
        cursor.executemany(f"UPDATE {Replica._meta.db_table} SET device_id = %s, updated_at = %s WHERE id = %s",
                           [(layouts[job_id][rank], now, replica_id) for replica_id, job_id, rank in replica_rows])
    replicas = replica_rows
    JobEvent.objects.bulk_create(events, batch_size=2000)
    if len(jobs) <= LIVE_PUSH_MAX_STARTS:
        from jobs.services import job_publish_updated

        for job in jobs:
            job.state = S.SCHEDULED
            job_publish_updated(job=job, fleet=True)
    return len(jobs), len(ready) * 2 + len(replicas) + len(events)


def _rank0_node(job_id):
    """Returns the Node.pk holding rank 0 of the job (where its launcher runs), or None."""
    return Replica.objects.filter(job_id=job_id, rank=0).values_list("device__node_id", flat=True).first()


def _generation_bump(job):
    Job.objects.filter(pk=job.pk).update(generation=F("generation") + 1)
    job.generation += 1
    return job.generation


def _preempt(*, job, decision, now):
    from scheduler.plugins.drain import REASON_LOST_REQUEUED

    if job.state == S.SCHEDULED:
        _generation_bump(job)  # its copy, if launched meanwhile, is fenced off
        job_transition(job=job, to=S.PENDING, reason=decision.reason, now=now, extra={"code": decision.code})
        return 2
    if decision.code == REASON_LOST_REQUEUED:
        # Its processes died with the node (or are cut off with it: fenced by the new generation):
        # nothing to checkpoint; it resumes from the last one.
        _generation_bump(job)
        job_transition(job=job, to=S.PREEMPTED, reason=decision.reason, now=now, extra={"code": decision.code})
        return 2
    from_node = _rank0_node(job.pk)
    job = job_transition(job=job, to=S.PREEMPTING, reason=decision.reason, now=now,
                         extra={"code": decision.code, "released_devices": _device_ids_held(job.pk)})
    released = Replica.objects.filter(job_id=job.pk, device__isnull=False).update(device=None)
    Job.objects.filter(pk=job.pk).update(device_count=0)
    job_event_add(job=job, type=JobEvent.Type.RELEASED, reason=decision.reason,
                  extra={"replicas": released, "checkpoint": "the agent stops it at a consistent cut"})
    move_create(job=job, kind=Move.Kind.PREEMPTION, reason=decision.reason, now=now, from_node_id=from_node,
                from_devices=job.device_count)
    return released + 4


def _migrate(*, job, decision, devices, region, nodes, now):
    from_node = _rank0_node(job.pk)
    from_generation = job.generation
    if job.state == S.SCHEDULED:
        job_transition(job=job, to=S.PENDING, reason=decision.reason, now=now)
        job = job_transition(job=job, to=S.SCHEDULED, reason=decision.reason, now=now)
    else:
        old_devices = set(_device_ids_held(job.pk))
        job = job_transition(job=job, to=S.MIGRATING, reason=decision.reason, now=now,
                             extra={"code": decision.code, "from_checkpoint": decision.from_checkpoint,
                                    "released_devices": sorted(old_devices - set(devices))})
    from_devices = job.device_count
    _generation_bump(job)  # the copy on the new devices
    rows = _place_replicas(job=job, device_ids=devices)
    Job.objects.filter(pk=job.pk).update(device_count=len(devices), region_id=region)
    job_event_add(job=job, type=JobEvent.Type.MIGRATED, reason=decision.reason,
                  extra={"devices": devices, "nodes": nodes, "from_checkpoint": decision.from_checkpoint,
                         "restart_step": decision.restart_step, "generation": job.generation})
    if job.state == S.MIGRATING:
        common = dict(job=job, kind=Move.Kind.MIGRATION, reason=decision.reason, now=now, from_node_id=from_node,
                      to_node_id=_rank0_node(job.pk), from_generation=from_generation,
                      to_generation=job.generation, from_devices=from_devices, to_devices=len(devices))
        if decision.from_checkpoint:
            # Its old processes are gone, or cut off with their node: nothing to cut; the new node
            # restores the last checkpoint right away. No from_node: the old copy is not part of the
            # move, so its reports (generation from_generation) are rejected and it is fenced.
            common["from_node_id"] = None
            move_create(**common, first_step=Move.Step.RESTORE, cut_step=job.last_checkpoint_step,
                        note=f"barrier, checkpoint, store skipped: restarting from checkpoint step "
                             f"{job.last_checkpoint_step} (the old copy's node is lost)")
        else:
            move_create(**common)
    return rows + 5


def _write_waiting(*, plan):
    """Writes wait_reason / queue_position of every waiting job; clears them on the others."""
    waiting = {w.job_id: w for w in plan.waiting}
    changed = []
    for job in Job.objects.filter(state__in=WAITING_STATES).only("id", "wait_reason", "queue_position"):
        w = waiting.get(job.pk)
        reason, place = (w.reason[:500], w.place) if w else ("", None)
        if job.wait_reason != reason or job.queue_position != place:
            job.wait_reason, job.queue_position = reason, place
            changed.append(job)
    if changed:
        Job.objects.bulk_update(changed, ["wait_reason", "queue_position"], batch_size=1000)
    return len(changed)


def accounting_accrue(*, since, now):
    """Adds device-time up to `now`: attained += devices held * (now - since); ideal += W * the
    time since `since` or since submission, whichever is later. Returns rows written.

    Three UPDATE statements whatever the number of jobs (device counts, older jobs, newcomers).
    """
    active = Job.objects.exclude(state__in=Job.TERMINAL_STATES)
    rows = 0
    if since is not None:
        seconds = max(0.0, min((now - since).total_seconds(), 300.0))
        if seconds:
            rows += active.filter(device_count__gt=0).update(
                attained_device_seconds=F("attained_device_seconds") + F("device_count") * seconds)
            rows += active.filter(submitted_at__lte=since).update(
                ideal_device_seconds=F("ideal_device_seconds") + F("world_size") * seconds)
    # Jobs submitted since the last accrual (all of them on the first tick): W * (now - submitted_at),
    # in one statement.
    terminal = sorted(str(x) for x in Job.TERMINAL_STATES)
    seconds_since_submit = f"(%s - {_epoch_sql('submitted_at')})"
    sql = (f"UPDATE {Job._meta.db_table} SET ideal_device_seconds = ideal_device_seconds + world_size * "
           f"CASE WHEN {seconds_since_submit} > 0 THEN {seconds_since_submit} ELSE 0 END "
           f"WHERE state NOT IN ({', '.join(['%s'] * len(terminal))})")
    params = [now.timestamp(), now.timestamp(), *terminal]
    if since is not None:
        sql += f" AND {_epoch_sql('submitted_at')} > %s"
        params.append(since.timestamp())
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows += max(cursor.rowcount, 0)
    return rows


def node_lost_sweep(*, now):
    """Marks ready/draining nodes whose agent missed heartbeats for node_lost_after() as lost.

    Returns the hostnames marked. Nodes that never reported (last_heartbeat null) are left
    alone: they were created by a fleet description and have no agent yet.
    """
    cutoff = now - node_lost_after()
    stale = Node.objects.filter(last_heartbeat__lt=cutoff).exclude(state=Node.State.LOST)
    hostnames = list(stale.values_list("hostname", flat=True))
    if hostnames:
        Node.objects.filter(hostname__in=hostnames, last_heartbeat__lt=cutoff).update(state=Node.State.LOST)
        held = Replica.objects.filter(device__node__hostname__in=hostnames).exclude(
            job__state__in=Job.TERMINAL_STATES).values_list("job_id", flat=True).distinct()
        for job in Job.objects.filter(pk__in=list(held)):
            job_event_add(job=job, type=JobEvent.Type.NODE_LOST,
                          reason=f"node(s) {', '.join(hostnames)} missed heartbeats for "
                                 f"{node_lost_after().total_seconds():.0f} s")
        logger.warning("nodes lost (missed heartbeats): %s", ", ".join(hostnames))
    return hostnames


@dataclass
class TickResult:
    ran: bool  # False: another worker holds the lease
    seconds: dict = field(default_factory=dict)  # snapshot, plan, apply, total
    counts: dict = field(default_factory=dict)
    rows_written: int = 0
    devices: int = 0
    jobs: int = 0
    lost_nodes: list = field(default_factory=list)

    def as_dict(self):
        return {"ran": self.ran, "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "counts": self.counts, "rows_written": self.rows_written, "devices": self.devices,
                "jobs": self.jobs, "lost_nodes": self.lost_nodes}


def tick_run(*, now=None, holder=_HOLDER):
    """Runs one tick if this caller wins the lease; returns a TickResult (ran=False otherwise).

    1. sweep lost nodes  2. snapshot (selectors)  3. plan (scheduler.schedule)
    4. apply (services, one transaction)  5. record stats on the lease row.
    Device-time accounting runs apart (accounting_run).
    """
    began = time.perf_counter()
    now = now or timezone.now()
    if not tick_lease_claim(now=now, holder=holder):
        return TickResult(ran=False)
    try:
        result = TickResult(ran=True)
        with transaction.atomic():
            result.lost_nodes = node_lost_sweep(now=now)
            from jobs.services import preemption_expire_due
            from jobs.moves import moves_sweep
            from jobs.workflows import workflow_timeouts_sweep

            result.counts["expired_requests"] = preemption_expire_due(now=now)
            swept = moves_sweep(now=now)
            result.counts["timed_out_moves"] = swept["timed_out"] + workflow_timeouts_sweep(now=now)
            result.counts["requeued_move_chains"] = swept["requeued"]
            t0 = time.perf_counter()
            index = snapshot_build(now=now)
            t1 = time.perf_counter()
            plan = scheduler.schedule(index.snapshot, timer=time.perf_counter)
            t2 = time.perf_counter()
            applied = plan_apply(index=index, plan=plan, now=now)
            t3 = time.perf_counter()
            result.seconds = {"snapshot": t1 - t0, "plan": t2 - t1, "apply": t3 - t2}
            result.counts = {**result.counts, **plan.summary(), **{f"applied_{k}": v for k, v in applied["counts"].items()}}
            result.rows_written = applied["rows"]
            result.devices = len(index.snapshot.accelerators)
            result.jobs = len(index.snapshot.jobs)
            result.seconds["total"] = time.perf_counter() - began
            ControlLoopLease.objects.filter(name=TICK_LEASE).update(last_tick_at=now,
                                                                    last_tick_stats=result.as_dict())
        return result
    finally:
        tick_lease_release(holder=holder)


ACCOUNTING_LEASE = "accounting"


def accounting_run(*, now=None, holder=_HOLDER):
    """Accrues device-time if accounting_period() has passed since the last accrual; returns the
    rows written, or None when another caller leads it or it is not due yet.

    Its own Celery beat task (jobs.tasks.accounting), off the tick's path: at 100k accelerators
    the accrual rewrites every unfinished job row, which would double the tick's latency.
    """
    now = now or timezone.now()
    if not tick_lease_claim(now=now, holder=holder, name=ACCOUNTING_LEASE):
        return None
    try:
        with transaction.atomic():
            lease = ControlLoopLease.objects.get(name=ACCOUNTING_LEASE)
            if lease.last_tick_at is not None and now - lease.last_tick_at < accounting_period():
                return None
            rows = accounting_accrue(since=lease.last_tick_at, now=now)
            ControlLoopLease.objects.filter(name=ACCOUNTING_LEASE).update(
                last_tick_at=now, last_tick_stats={"rows": rows})
        return rows
    finally:
        tick_lease_release(holder=holder, name=ACCOUNTING_LEASE)
