"""Live pushes to browsers through the Channels layer.

Group names: "fleet" (anything on the fleet page), "job.<id>", "team.<id>",
"approvals" (capacity managers' page). Message types are prefixed with their app,
e.g. "jobs.job_updated" (handled by a consumer method `jobs_job_updated`).

Call `events_publish` inside the transaction that made the change: the message goes
out only after the commit, so a browser never sees a change that was rolled back.
Publishing is best effort: when no channel layer is configured, or Redis is down,
the change still commits and a warning is logged (the page catches up on reload).
"""
import contextlib
import logging
import threading

from asgiref.sync import async_to_sync
from django.db import transaction

logger = logging.getLogger(__name__)

_held = threading.local()  # .messages: [(groups, message)] while pushes_batched() holds them

GROUP_FLEET = "fleet"
GROUP_APPROVALS = "approvals"


def group_for_job(job_id):
    return f"job.{job_id}"


def group_for_team(team_id):
    return f"team.{team_id}"


def events_publish(*, groups, type, payload):
    """Sends {"type": type, **payload} to each group once the current transaction commits.

    Returns nothing; outside a transaction it sends at once. `payload` must be JSON-able.
    """
    if "." not in type:
        raise ValueError(f"channel message type {type!r} needs an app prefix, e.g. 'jobs.job_updated'")
    message = {"type": type, **payload}
    groups = list(groups)
    transaction.on_commit(lambda: events_publish_now(groups=groups, message=message))


def events_publish_now(*, groups, message):
    """Sends `message` to `groups` now. Returns the number of groups it reached."""
    from channels.layers import get_channel_layer

    try:
        layer = get_channel_layer()
    except Exception:  # a misconfigured layer must not break the write path
        logger.warning("channel layer unavailable; live update %s dropped", message.get("type"), exc_info=True)
        return 0
    if layer is None:
        return 0
    held = getattr(_held, "messages", None)
    if held is not None:  # sent with the others when pushes_batched() ends
        held.append((list(groups), message))
        return len(groups)
    # One hop to the event loop for all the groups (a job's push goes to two or three): each
    # async_to_sync costs a thread handoff, and a heartbeat that records checkpoints pushes per job.
    return async_to_sync(_groups_send)(layer, [(groups, message)])


@contextlib.contextmanager
def pushes_batched():
    """Holds the pushes sent inside it (those of the transactions that commit inside it: their
    on-commit callbacks run here) and sends them all in one hop to the event loop when it ends,
    in their order: a batch of heartbeats (jobs/heartbeat_fold.py) pushes one update per job it
    changed, and each hop costs a thread handoff (~4 ms of CPU each, measured). Nested: the
    outermost one sends."""
    if getattr(_held, "messages", None) is not None:
        yield
        return
    _held.messages = []
    try:
        yield
    finally:
        held, _held.messages = _held.messages, None
        if held:
            from channels.layers import get_channel_layer

            async_to_sync(_groups_send)(get_channel_layer(), held)


async def _groups_send(layer, pushes) -> int:
    sent = 0
    for groups, message in pushes:
        for group in groups:
            try:
                await layer.group_send(group, message)
                sent += 1
            except Exception:
                logger.warning("could not publish %s to %s", message.get("type"), group, exc_info=True)
    return sent
