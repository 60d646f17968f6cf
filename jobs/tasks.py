"""Celery tasks of the control loop. Thin: ids in, a service call, a small dict out.

  jobs.tasks.scheduler_tick          beat, every MERIDIAN_TICK_SECONDS: jobs.tick.tick_run
                                     (lost-node sweep, preemption expiry, move timeouts,
                                     snapshot -> plan -> apply, one leader at a time)
  jobs.tasks.accounting             beat, every MERIDIAN_ACCOUNTING_SECONDS: jobs.accounting.accounting_run
  jobs.tasks.node_lost_sweep         the heartbeat-loss sweep alone (also run inside every tick)
  jobs.tasks.preemption_expiry       expires approval requests past their deadline
  jobs.tasks.workflow_timeouts       ends stuck preemptions / migrations / resizes (and lost chains)
  jobs.tasks.move_step               one step of a move (jobs/moves.py), chained per move; retries
                                     with a short countdown until its step is observed or its deadline
  jobs.tasks.move_advance            completes a move's steps already observed (enqueued by reports)
  jobs.tasks.artifacts_gc            beat, every 10 min: jobs.bundles.artifacts_collect (unreferenced bundles,
                                     expired outputs, stores no agent removed; also `manage.py artifacts_gc`)
  jobs.tasks.heartbeats_fold         beat, every MERIDIAN_HEARTBEAT_FOLD_SECONDS: jobs.heartbeat_fold
                                     (queued full heartbeats recorded in batches, until the queue is empty)
"""
import logging

from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.utils import timezone

logger = logging.getLogger(__name__)


@shared_task(name="jobs.tasks.scheduler_tick", ignore_result=True)
def scheduler_tick():
    from jobs.tick import tick_run

    result = tick_run()
    if result.ran:
        counts = {k: v for k, v in result.counts.items() if v}
        if counts:
            logger.info("tick: %s in %.3f s", counts, result.seconds.get("total", 0.0))
    return result.as_dict()


@shared_task(name="jobs.tasks.accounting", ignore_result=True)
def accounting():
    from jobs.accounting import accounting_run

    return accounting_run()


@shared_task(name="jobs.tasks.node_lost_sweep", ignore_result=True)
def node_lost_sweep():
    from jobs.services import node_lost_sweep as sweep

    with transaction.atomic():
        return sweep(now=timezone.now())


@shared_task(name="jobs.tasks.preemption_expiry", ignore_result=True)
def preemption_expiry():
    from jobs.services import preemption_expire_due

    return preemption_expire_due()


@shared_task(name="jobs.tasks.workflow_timeouts", ignore_result=True)
def workflow_timeouts():
    from jobs.moves import moves_sweep
    from jobs.workflows import workflow_timeouts_sweep

    with transaction.atomic():
        return {"moves": moves_sweep(), "stuck_jobs": workflow_timeouts_sweep()}


@shared_task(bind=True, name="jobs.tasks.move_step", ignore_result=True, max_retries=None)
def move_step(self, move_id, step, chain_id):
    """Step `step` of move `move_id`: done -> the chain goes on; not yet -> retry in a moment.
    Unbounded retries: the step's deadline (checked by the service) ends the move."""
    from jobs.moves import WAITING, move_poll_seconds, move_step_run

    outcome = move_step_run(move_id=move_id, step=step, chain_id=chain_id)
    if outcome == WAITING:
        raise self.retry(countdown=move_poll_seconds())
    return outcome


@shared_task(name="jobs.tasks.move_advance", ignore_result=True)
def move_advance(move_id):
    from jobs.moves import move_advance as advance

    return advance(move_id=move_id)


@shared_task(name="jobs.tasks.heartbeats_fold", ignore_result=True)
def heartbeats_fold():
    from jobs.heartbeat_fold import heartbeats_fold_all

    # Bounded so a long backlog does not hold the worker past the next beat's run (which expires).
    result = heartbeats_fold_all(max_seconds=max(5.0, settings.MERIDIAN_HEARTBEAT_FOLD_SECONDS * 5))
    return {"entries": result.entries, "recorded": result.recorded, "coalesced": result.coalesced}


@shared_task(name="jobs.tasks.records_retention", ignore_result=True)
def records_retention():
    from jobs.workflows import checkpoint_rows_prune

    return {"checkpoints_deleted": checkpoint_rows_prune()}


@shared_task(name="jobs.tasks.artifacts_gc", ignore_result=True)
def artifacts_gc():
    from jobs.bundles import artifacts_collect

    deleted = artifacts_collect(now=timezone.now())
    if deleted["bundles"] or deleted["outputs"] or deleted["stores"]:
        logger.info("artifacts gc: %d bundle file(s), outputs of job(s) %s, checkpoint stores of job(s) %s",
                    len(deleted["bundles"]), deleted["outputs"], deleted["stores"])
    return {key: len(value) for key, value in deleted.items()}
