"""Device-time accounting: attained and ideal device-seconds of every unfinished job.

    accounting_run(now=None) -> rows written, or None   what the Celery beat task calls
    accounting_accrue(since=..., now=...) -> rows       the accrual itself (three UPDATEs)

Its own Celery beat task (jobs.tasks.accounting), off the tick's path, at most every
settings.MERIDIAN_ACCOUNTING_SECONDS, under its own lease (jobs.lease.ACCOUNTING_LEASE).
"""
from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from jobs.lease import ACCOUNTING_LEASE, HOLDER, tick_lease_claim, tick_lease_release
from jobs.models import ControlLoopLease, Job
from jobs.snapshot import epoch_sql


def accounting_period() -> timedelta:
    """Device-time is accrued at most this often (settings.MERIDIAN_ACCOUNTING_SECONDS): two
    UPDATEs over every unfinished job are the tick's biggest write at scale."""
    return timedelta(seconds=float(settings.MERIDIAN_ACCOUNTING_SECONDS))


def accounting_accrue(*, since: datetime | None, now: datetime) -> int:
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
    seconds_since_submit = f"(%s - {epoch_sql('submitted_at')})"
    sql = (f"UPDATE {Job._meta.db_table} SET ideal_device_seconds = ideal_device_seconds + world_size * "
           f"CASE WHEN {seconds_since_submit} > 0 THEN {seconds_since_submit} ELSE 0 END "
           f"WHERE state NOT IN ({', '.join(['%s'] * len(terminal))})")
    params = [now.timestamp(), now.timestamp(), *terminal]
    if since is not None:
        sql += f" AND {epoch_sql('submitted_at')} > %s"
        params.append(since.timestamp())
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows += max(cursor.rowcount, 0)
    return rows


def accounting_run(*, now: datetime | None = None, holder: str = HOLDER) -> int | None:
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
