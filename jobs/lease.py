"""Leases on ControlLoopLease rows: one leader per periodic control-loop task at a time.

    tick_lease_claim(now=..., holder=..., seconds=..., name=...) -> bool
    tick_lease_release(holder=..., name=...)

Rows: TICK_LEASE (jobs.tick.tick_run) and ACCOUNTING_LEASE (jobs.accounting.accounting_run).
"""
from __future__ import annotations

import os
import socket
import uuid
from datetime import datetime, timedelta

from django.db.models import Q

from jobs.models import ControlLoopLease

TICK_LEASE = "scheduler-tick"
TICK_LEASE_SECONDS = 60.0
ACCOUNTING_LEASE = "accounting"
# This process's name on the lease rows: unique per process, readable in the admin.
HOLDER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def tick_lease_claim(*, now: datetime, holder: str = HOLDER, seconds: float = TICK_LEASE_SECONDS,
                     name: str = TICK_LEASE) -> bool:
    """Returns True when `holder` now leads `name` (until now + seconds), False if another does.

    A conditional UPDATE that only one caller can win (healthchecks' sendalerts): the row is
    free when its lease expired or the same holder renews it.
    """
    ControlLoopLease.objects.get_or_create(name=name)
    updated = ControlLoopLease.objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__lt=now) | Q(holder=holder), name=name
    ).update(holder=holder, expires_at=now + timedelta(seconds=seconds))
    return updated == 1


def tick_lease_release(*, holder: str = HOLDER, name: str = TICK_LEASE) -> None:
    ControlLoopLease.objects.filter(name=name, holder=holder).update(holder="", expires_at=None)
