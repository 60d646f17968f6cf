"""The full heartbeat's one service: record the agent's report, answer with its desired state.

    node_heartbeat_answer(node=..., heartbeat=..., wire=..., body=...) -> HeartbeatAnswer

Both entry points call it: the DRF view (jobs.agent_apis.NodeHeartbeatApi) and the path answered
before Django (jobs/heartbeat_api.py). MERIDIAN_HEARTBEAT_FOLD says whether the report is recorded
here ("sync") or queued for the heartbeat folder ("async": jobs/heartbeat_fold.py).
"""
from __future__ import annotations

from django.conf import settings

from fleet.leases import desired_serial_of
from fleet.models import Node
from jobs.desired_version import node_desired_answer
from jobs.heartbeat_fold import heartbeat_enqueue, heartbeat_outcomes_remember
from jobs.workflows import node_report_record
from protocol.node import Heartbeat, HeartbeatAnswer


def node_heartbeat_answer(*, node, heartbeat: Heartbeat, wire: dict | None = None,
                          body: bytes | None = None) -> HeartbeatAnswer:
    """Returns the answer to `node`'s (authenticated) heartbeat: what became of each job report,
    the desired state (None while the heartbeat's desired_version is current:
    jobs/desired_version.py), and the node's desired serial.

    "sync", or "async" without `wire` (the heartbeat's decoded JSON; `body`: its bytes): the report
    is recorded first (jobs.workflows.node_report_record, which keeps `node` up to date: state,
    last heartbeat). "async": when the agent holds the current desired state, the heartbeat is
    queued and its reports answered as far as the folder decided them, "deferred" otherwise
    (jobs/heartbeat_fold.py). It is recorded here after all when the desired state changed since the
    agent's (the rejections that come with a change, "fence" and "cancel", must reach the agent in
    the same answer as the desired state without the job: from that alone it would stop the copy at
    a cut, checkpointing a copy it must kill), when it cannot be queued (Redis unreachable, the
    backlog full), and for a node marked lost (its return to ready is part of the desired state)."""
    if settings.MERIDIAN_HEARTBEAT_FOLD == "async" and wire is not None and node.state != Node.State.LOST:
        # Read before the desired state is built (see below).
        serial = desired_serial_of(node_id=node.pk)
        desired, version = node_desired_answer(node=node, held_version=heartbeat.desired_version)
        if desired is None:
            outcome = heartbeat_enqueue(node_id=node.pk, token_digest=node.agent_token_hash, wire=wire, body=body)
            if outcome is not None:
                return heartbeat_answer_of(outcome, desired=None, version=version, serial=serial)
        outcome = node_report_record(node=node, heartbeat=heartbeat)
        heartbeat_outcomes_remember(node_id=node.pk, wire=wire, outcome=outcome)
    else:
        outcome = node_report_record(node=node, heartbeat=heartbeat)
    # Read before the desired state is built: every change bumps the serial after it commits, so
    # the state built next includes every change this serial counts (the report's own included: its
    # bump ran on commit, above). None while Redis is down: the agent keeps the lease's.
    serial = desired_serial_of(node_id=node.pk)
    desired, version = node_desired_answer(node=node, held_version=heartbeat.desired_version)
    return heartbeat_answer_of(outcome, desired=desired, version=version, serial=serial)


def heartbeat_answer_of(outcome, *, desired, version, serial) -> HeartbeatAnswer:
    """Returns the HeartbeatAnswer of a report's `outcome` (also jobs/heartbeat_api.py's queued answer)."""
    return HeartbeatAnswer(desired=desired, desired_version=version, accepted=outcome.accepted,
                           rejected=outcome.rejected, deferred=outcome.deferred,
                           heartbeat_seconds=settings.MERIDIAN_AGENT_HEARTBEAT_SECONDS, desired_serial=serial)
