"""Celery tasks of the fleet. Thin: a service call, a small dict out.

  fleet.tasks.telemetry_rollup   beat, every minute: fleet.services.telemetry_rollup
                                 (node minutes → cluster minutes, hours; retention)
  fleet.tasks.leases_flush       beat, every MERIDIAN_LEASE_FLUSH_SECONDS: fleet.leases.leases_flush
                                 (the agents' liveness leases → Node.last_heartbeat, one batch)
"""
import logging

from celery import shared_task
from django.utils import timezone

logger = logging.getLogger(__name__)


@shared_task(name="fleet.tasks.telemetry_rollup", ignore_result=True)
def telemetry_rollup():
    from fleet.services import telemetry_rollup as rollup

    result = rollup(now=timezone.now())
    if any(result.deleted.values()):
        logger.info("telemetry rollup: wrote %s, deleted %s in %.2f s", result.written, result.deleted, result.seconds)
    return {"written": result.written, "deleted": result.deleted, "seconds": round(result.seconds, 3)}


@shared_task(name="fleet.tasks.leases_flush", ignore_result=True)
def leases_flush():
    """Beat, every MERIDIAN_LEASE_FLUSH_SECONDS: the leases in Redis -> Node.last_heartbeat (one batch)."""
    from fleet.leases import leases_flush as flush

    return {"updated": flush(now=timezone.now())}
