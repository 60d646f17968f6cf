"""Tells leasing agents that their desired state may have changed (fleet/leases.py's serials).

    desired_changed(job_ids=...)   call inside the transaction of a change to those jobs

An agent that only leases (fleet/lease_api.py) learns of a change through its node's
`desired_serial`: it sends a full heartbeat, and gets the new desired state, when the serial differs
from the one it saw before its last full heartbeat. Every change to what a node should run leaves a
JobEvent in the same transaction (STYLE.md: audit every change), so the two places that write
events call this: jobs.services.job_event_add and jobs.services.jobs_transition_bulk. Once the
transaction commits, the nodes each job is on (its replicas' devices, its active moves' old and new
nodes) are looked up in two queries (the job ids bound as one parameter: jobs.bulk.AnyOf), and
fleet.leases.desired_serials_bump bumps those nodes and the ones each job was last signalled on (a
cancelled job's node is told too). The node-lost sweep bumps the nodes it marks lost (their state
is part of their desired state).

Over-signalling costs a full heartbeat (the desired_version cache makes it cheap when nothing
changed); a missed signal (Redis down or restarted, a change that wrote no event) costs latency,
never correctness: every agent sends a full heartbeat at least every
MERIDIAN_AGENT_FULL_HEARTBEAT_SECONDS.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

from django.db import transaction

from fleet.leases import desired_serials_bump

logger = logging.getLogger(__name__)

_pending = threading.local()  # .job_ids: the jobs changed in this thread's open transaction


def desired_changed(*, job_ids: Iterable[int], nodes: Mapping[int, Iterable[int]] | None = None) -> None:
    """Marks the desired state of the nodes of `job_ids` changed once the current transaction
    commits (at once outside a transaction). One on-commit callback per transaction, however many
    calls. `nodes` ({job id: the nodes it is on after this change}) is for a caller that knows
    them (a start's placement): those jobs' replicas are then not looked up again after commit
    (~0.4 s at a placement of 30k jobs); their active moves still are. A later call for the same
    job without `nodes` looks it up after all."""
    ids = {int(i) for i in job_ids}
    if not ids:
        return
    known = {int(job_id): {int(n) for n in on} for job_id, on in (nodes or {}).items() if int(job_id) in ids}
    callbacks = transaction.get_connection().run_on_commit
    if getattr(_pending, "job_ids", None) is not None and _registered(callbacks):
        _pending.job_ids.update(ids)
        for job_id in ids - known.keys():
            _pending.known.pop(job_id, None)
        _pending.known.update(known)
        return
    # First call of this transaction (or its callback went with a rolled-back savepoint). Set
    # before on_commit, which runs _signal at once outside a transaction.
    _pending.job_ids, _pending.known = ids, known
    transaction.on_commit(_signal, robust=True)
    _pending.index = len(callbacks) - 1  # where it sits, while the transaction is open


def _registered(callbacks) -> bool:
    """True when _signal waits among the open transaction's on-commit callbacks: looked up where it
    was put (a tick registers thousands of callbacks), else searched (a savepoint rolled back)."""
    index = getattr(_pending, "index", -1)
    if 0 <= index < len(callbacks) and callbacks[index][1] is _signal:
        return True
    return any(entry[1] is _signal for entry in callbacks)


def job_nodes(job_ids: Iterable[int], *, known: Mapping[int, set[int]] | None = None) -> dict[int, set[int]]:
    """Returns {job id: the nodes it is on now}: its replicas' devices' nodes (or, for a job in
    `known`, those nodes) and its active moves' old and new nodes (an empty set for a job on none)."""
    from jobs.models import Move, Replica

    known = known or {}
    ids = sorted(set(job_ids))
    nodes: dict[int, set[int]] = {job_id: set(known.get(job_id, ())) for job_id in ids}
    lookup = [job_id for job_id in ids if job_id not in known]
    if lookup:
        for job_id, node_id in (Replica.objects.filter(job_id__any_of=lookup, device__isnull=False)
                                .values_list("job_id", "device__node_id").distinct()):
            nodes[job_id].add(node_id)
    for job_id, from_node, to_node in (Move.objects.filter(job_id__any_of=ids, state=Move.State.ACTIVE)
                                       .values_list("job_id", "from_node_id", "to_node_id")):
        nodes[job_id].update(n for n in (from_node, to_node) if n is not None)
    return nodes


def _signal() -> None:
    ids = getattr(_pending, "job_ids", None) or set()
    known = getattr(_pending, "known", None) or {}
    _pending.job_ids, _pending.known = None, None
    if ids:
        desired_serials_bump(job_nodes=job_nodes(ids, known=known))
