"""The full heartbeat's one service: record the agent's report, answer with its desired state.

    node_heartbeat_answer(node=..., heartbeat=...) -> HeartbeatAnswer

Both entry points call it: the DRF view (jobs.agent_apis.NodeHeartbeatApi) and the path answered
before Django (jobs/heartbeat_api.py).
"""
from __future__ import annotations

from django.conf import settings

from fleet.leases import desired_serial_of
from jobs.desired_version import node_desired_answer
from jobs.workflows import node_report_record
from protocol.node import Heartbeat, HeartbeatAnswer


def node_heartbeat_answer(*, node, heartbeat: Heartbeat) -> HeartbeatAnswer:
    """Returns the answer to `node`'s (authenticated) heartbeat once its report is recorded
    (jobs.workflows.node_report_record, which keeps `node` up to date: state, last heartbeat): what
    became of each job report, the desired state (None while the heartbeat's desired_version is
    current: jobs/desired_version.py), and the node's desired serial."""
    outcome = node_report_record(node=node, heartbeat=heartbeat)
    # Read before the desired state is built: every change bumps the serial after it commits, so
    # the state built next includes every change this serial counts (the report's own included:
    # its bump ran on commit, above). None while Redis is down: the agent keeps the lease's.
    serial = desired_serial_of(node_id=node.pk)
    desired, version = node_desired_answer(node=node, held_version=heartbeat.desired_version)
    return HeartbeatAnswer(desired=desired, desired_version=version, accepted=outcome.accepted,
                           rejected=outcome.rejected, deferred=outcome.deferred,
                           heartbeat_seconds=settings.MERIDIAN_AGENT_HEARTBEAT_SECONDS, desired_serial=serial)
