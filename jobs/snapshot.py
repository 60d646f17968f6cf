"""The tick's selector: the frozen Snapshot the scheduler core plans from, built from the database.

    snapshot_build(now=...) -> SnapshotIndex   the Snapshot plus the maps back to database ids
    policy_settings() -> scheduler.PolicySettings   this deployment's policy knobs (settings.MERIDIAN_*)

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
  * A node whose agent missed heartbeats is LOST (jobs.services.node_lost_sweep); the core moves
    its jobs, which restart from their last checkpoint.
  * An approved PreemptionRequest decided after the job's last start sets preemption_approved.
  * A running job's last_resize_time is when its newest resize Move was created.

Policy knobs are read once, in portal/settings.py (MERIDIAN_MIN_RUN_SECONDS,
MERIDIAN_STANDARD_SLA_FLOOR, MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS, MERIDIAN_PREMIUM_RESERVE_DEVICES,
MERIDIAN_JOB_MAX_SPREAD); this module reads django.conf.settings at call time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
from django.conf import settings
from django.db import connection
from django.db.models import F, Max, Subquery

import scheduler
from fleet.models import Accelerator, Node
from jobs.models import Job, JobEvent, Move, PreemptionRequest, Replica, Team
from jobs.moves import step_timeout

S = Job.State

RUNNING_STATES = (S.SCHEDULED, S.RUNNING)
MOVING_STATES = (S.PREEMPTING, S.MIGRATING, S.RESIZING)
WAITING_STATES = (S.PENDING, S.PREEMPTED)
SPREADS = {"node": scheduler.SPREAD_NODE, "rack": scheduler.SPREAD_RACK,
           "cluster": scheduler.SPREAD_CLUSTER, "region": scheduler.SPREAD_REGION}
NODE_STATUS = {Node.State.READY: scheduler.NODE_READY, Node.State.DRAINING: scheduler.NODE_DRAINING,
               Node.State.LOST: scheduler.NODE_LOST}
TIERS = {"premium": scheduler.PREMIUM, "standard": scheduler.STANDARD, "basic": scheduler.BASIC}


def policy_settings() -> scheduler.PolicySettings:
    """Returns the PolicySettings of this deployment (settings.MERIDIAN_*, see portal/settings.py)."""
    return scheduler.PolicySettings(
        min_run_seconds=float(settings.MERIDIAN_MIN_RUN_SECONDS),
        standard_sla_floor=float(settings.MERIDIAN_STANDARD_SLA_FLOOR),
        min_resize_interval_seconds=float(settings.MERIDIAN_MIN_RESIZE_INTERVAL_SECONDS),
        premium_reserve_devices=int(settings.MERIDIAN_PREMIUM_RESERVE_DEVICES),
        protected_progress_share=float(settings.MERIDIAN_PROTECTED_PROGRESS_SHARE),
        packed_tiers_may_spread=bool(settings.MERIDIAN_PACKED_TIERS_MAY_SPREAD),
    )


def job_max_spread() -> int:
    """Returns the scheduler's SPREAD_* constant named by settings.MERIDIAN_JOB_MAX_SPREAD."""
    name = str(settings.MERIDIAN_JOB_MAX_SPREAD).strip().lower()
    if name not in SPREADS:
        raise ValueError(f"MERIDIAN_JOB_MAX_SPREAD={name!r}; choose one of {', '.join(SPREADS)}")
    return SPREADS[name]


@dataclass
class SnapshotIndex:
    """The Snapshot plus the maps back to database ids that applying a plan needs."""

    snapshot: scheduler.Snapshot
    accelerator_ids: np.ndarray  # int64[N]: Accelerator.pk of snapshot device i
    accelerator_node_ids: np.ndarray  # int64[N]: Node.pk of device i
    job_ids: list  # Job.pk of the snapshot's jobs in order, then the moving jobs' (left out of the tick)
    region_ids: list  # Region.pk of snapshot region index r
    hostnames: dict = field(default_factory=dict)  # Node.pk -> hostname
    seconds: dict = field(default_factory=dict)


def _index(values: list) -> tuple[np.ndarray, list]:
    """Returns (codes, uniques): codes[i] = position of values[i] in uniques (first-seen order)."""
    uniques, codes = {}, []
    for v in values:
        codes.append(uniques.setdefault(v, len(uniques)))
    return np.asarray(codes, np.int32), list(uniques)


def epoch_sql(column: str) -> str:
    """Returns SQL for `column` (a datetime) as float seconds since the epoch, on this database."""
    if connection.vendor == "postgresql":
        return f"EXTRACT(EPOCH FROM {column})::float8"
    if connection.vendor == "sqlite":
        return f"(julianday({column}) - 2440587.5) * 86400.0"
    raise NotImplementedError(f"the tick supports PostgreSQL and SQLite, not {connection.vendor}")


def snapshot_build(*, now: datetime) -> SnapshotIndex:
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
    select = ", ".join(epoch_sql(c) if c in times else c for c in job_columns)
    terminal = sorted(str(x) for x in Job.TERMINAL_STATES)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {select} FROM {Job._meta.db_table} WHERE state NOT IN "
                       f"({', '.join(['%s'] * len(terminal))}) ORDER BY id", terminal)
        job_tuples = cursor.fetchall()
        # When each running job last changed its device count: its newest resize Move (grow or
        # shrink), so min_resize_interval_seconds holds across ticks. One grouped query.
        running_states = sorted(str(x) for x in RUNNING_STATES)
        cursor.execute(f"SELECT m.job_id, MAX({epoch_sql('m.created_at')}) FROM {Move._meta.db_table} m "
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
    col = {name: i for i, name in enumerate(job_columns)}
    moving_states = {str(x) for x in MOVING_STATES}
    in_tick = [r for r in job_tuples if r[col["state"]] not in moving_states]
    moving_ids = [r[0] for r in job_tuples if r[col["state"]] in moving_states]
    released = _devices_being_released(now=now) if moving_ids else {}
    t1 = time.perf_counter()

    n_acc = len(acc_rows)
    acc_ids = np.fromiter((r[0] for r in acc_rows), np.int64, n_acc)
    acc_node = np.fromiter((r[1] for r in acc_rows), np.int64, n_acc)
    healthy = np.fromiter((bool(r[3]) for r in acc_rows), bool, n_acc)
    acc_types = [r[2] for r in acc_rows]
    type_names = sorted(set(acc_types))
    type_pos = {name: i for i, name in enumerate(type_names)}
    type_codes = np.fromiter((type_pos[t] for t in acc_types), np.int64, n_acc)
    for type_name in (r[col["accelerator_type"]] for r in job_tuples):
        if type_name not in type_pos:
            type_pos[type_name] = len(type_names)
            type_names.append(type_name)
    node_ids = np.asarray([r[0] for r in nodes], np.int64)
    node_idx = np.searchsorted(node_ids, acc_node).astype(np.int32)
    node_cluster = np.asarray([r[1] for r in nodes], np.int64)
    node_region = np.asarray([r[2] for r in nodes], np.int64)
    cluster_codes, _ = _index(node_cluster.tolist())
    region_codes, region_ids = _index(node_region.tolist())
    rack_codes, _ = _index([(r[1], r[3]) for r in nodes])
    node_status = np.asarray([NODE_STATUS[r[4]] for r in nodes], np.int8)

    holder = np.full(n_acc, -1, np.int32)
    held_count = np.zeros(len(in_tick), np.int64)
    if holder_rows:
        h_dev = np.fromiter((r[0] for r in holder_rows), np.int64, len(holder_rows))
        h_job = np.fromiter((r[1] for r in holder_rows), np.int64, len(holder_rows))
        h_moving = np.fromiter((r[2] in MOVING_STATES for r in holder_rows), bool, len(holder_rows))
        dev_idx = np.searchsorted(acc_ids, h_dev)
        healthy[dev_idx[h_moving]] = False  # busy with a move; nobody else may land here yet
        in_ids = np.fromiter((r[0] for r in in_tick), np.int64, len(in_tick))  # ascending: ordered by id
        running = ~h_moving
        pos = np.searchsorted(in_ids, h_job[running])
        found = (pos < len(in_ids)) & (in_ids[np.minimum(pos, max(len(in_ids) - 1, 0))] == h_job[running]) \
            if len(in_ids) else np.zeros(int(running.sum()), bool)
        # several ranks share a device when spliced: count each (job, device) once
        # (one int64 key per pair: np.unique over a 2-row array sorts rows as records, ~1 s at 100k)
        width = np.int64(len(in_tick) + 1)
        keys = np.unique(dev_idx[running][found].astype(np.int64) * width + pos[found])
        pair_dev, pair_job = keys // width, keys % width
        holder[pair_dev] = pair_job
        held_count = np.bincount(pair_job, minlength=len(in_tick)).astype(np.int64)
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
    jobs = _jobs_columns(in_tick, col, held_count=held_count, team_pos=team_pos, type_pos=type_pos,
                         resized_at=resized_at, approved_since=approved_since)
    snap = scheduler.Snapshot(
        accelerators=scheduler.Accelerators(
            type_id=type_codes, node=node_idx, rack=rack_codes[node_idx] if len(node_idx) else [],
            cluster=cluster_codes[node_idx] if len(node_idx) else [],
            region=region_codes[node_idx] if len(node_idx) else [], healthy=healthy, holder=holder,
            releasing_until=releasing_until),
        jobs=jobs,
        teams=scheduler.Teams(names=[t[1] for t in teams], quota=quota),
        now=now.timestamp(), type_names=type_names, node_status=node_status,
        settings=policy_settings(), node_names=tuple(r[5] for r in nodes),
    )
    t2 = time.perf_counter()
    return SnapshotIndex(
        snapshot=snap, accelerator_ids=acc_ids,
        accelerator_node_ids=acc_node, job_ids=[r[0] for r in in_tick] + moving_ids,
        region_ids=region_ids, hostnames={r[0]: r[5] for r in nodes},
        seconds={"snapshot_queries": t1 - t0, "snapshot_arrays": t2 - t1},
    )


def _jobs_columns(rows: list[tuple], col: dict, *, held_count: np.ndarray, team_pos: dict, type_pos: dict,
                  resized_at: dict, approved_since: dict) -> scheduler.Jobs:
    """Returns the columnar Jobs of the job rows `rows` (tuples; `col`: column name -> position),
    column by column: no per-job object (a JobRow per job cost ~1 s at 30k jobs)."""
    n = len(rows)
    columns = list(zip(*rows)) if rows else [()] * len(col)
    c = lambda name: columns[col[name]]  # noqa: E731
    ids = np.fromiter(c("id"), np.int64, n)
    world = np.fromiter(c("world_size"), np.int64, n)
    min_devices = np.fromiter((m or 0 for m in c("min_devices")), np.int64, n)
    min_devices = np.where(min_devices > 0, min_devices, world)
    running_state = {str(x) for x in RUNNING_STATES}
    running = np.fromiter((s in running_state for s in c("state")), bool, n) & (held_count > 0)
    nan_to = lambda values: np.fromiter((-np.inf if v is None else float(v) for v in values), np.float64, n)  # noqa: E731
    last_start = nan_to(c("last_started_at"))
    approved_at = np.fromiter((approved_since.get(i) or np.nan for i in c("id")), np.float64, n)
    # approved after the job's last start (or never started); NaN (none) compares False
    approved = (approved_at >= last_start) & (approved_at != 0)
    return scheduler.Jobs(
        ids=ids, team=np.fromiter((team_pos[t] for t in c("team_id")), np.int32, n),
        tier=np.fromiter((TIERS[t] for t in c("tier")), np.int8, n),
        type_id=np.fromiter((type_pos[t] for t in c("accelerator_type")), np.int16, n),
        world_size=world, min_devices=min_devices,
        state=np.where(running, scheduler.RUNNING, scheduler.PENDING).astype(np.int8),
        submit_time=np.fromiter(c("submitted_at"), np.float64, n),
        attained_device_seconds=np.fromiter(c("attained_device_seconds"), np.float64, n),
        ideal_device_seconds=np.fromiter(c("ideal_device_seconds"), np.float64, n),
        last_checkpoint_time=nan_to(c("last_checkpoint_at")),
        last_checkpoint_step=np.fromiter((s or 0 for s in c("last_checkpoint_step")), np.int64, n),
        checkpoint_bytes=np.fromiter(c("checkpoint_bytes"), np.int64, n), last_start_time=last_start,
        last_resize_time=nan_to(resized_at.get(i) for i in c("id")),
        preemption_approved=approved,
        # also for W=1: the core shrinks elastic victims on a pinned preemptor's node before it
        # preempts whole jobs
        max_spread=np.full(n, job_max_spread(), np.int8),
        names=[f"#{i} {name}" for i, name in zip(c("id"), c("name"))],
    )


def _devices_being_released(*, now: datetime) -> dict[int, float]:
    """Returns {Accelerator.pk: seconds since the epoch} for the devices moves are giving up: the
    "released_devices" recorded on each moving job's entry into its current moving state, until
    its active Move's current step deadline (the move ends by then, done or timed out). Without
    an active move (it just ended; the job leaves its moving state in the same transaction)
    now + the step timeout. A device two moves give up gets the later time. Two queries.
    """
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
