"""When an agent leases and when it sends a full heartbeat (a real agent and a hollow node alike).

Every liveness period the agent beats once:
  * a full heartbeat (POST heartbeat/: telemetry, a report on every copy, the desired state) when
      - it has never sent one, or the control plane has no lease endpoint (404) or its lease
        failed (a 503 while Redis is down, a timeout): the full heartbeat is the fallback;
      - a report changed since the last full heartbeat in anything but its progress (a copy's
        state, a new checkpoint, a cut, an error...), or the last answer deferred a report;
      - the lease's `desired_serial` differs from the one it saw before its last full heartbeat
        (the control plane may have changed its desired state: jobs/desired_signal.py);
      - its last full heartbeat is `full_heartbeat_seconds` old (the lease answer says how long;
        MERIDIAN_AGENT_FULL_HEARTBEAT_SECONDS, 30 s by default): telemetry and progress;
  * else a lease (POST lease/: liveness only, answered before Django: fleet/lease_api.py).

A lease the control plane answered proves the node alive there exactly as a heartbeat does, so it
resets the agent's self-fencing clock too.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.client import ControlPlaneClient, ControlPlaneError, TokenRejected
from protocol.node import PROGRESS_FIELDS, HeartbeatAnswer, JobReport, LeaseAnswer

log = logging.getLogger("agent.liveness")

DEFAULT_FULL_HEARTBEAT_SECONDS = 30.0


def reports_key(reports: Sequence[JobReport]) -> tuple:
    """Returns what a heartbeat's reports say, less their progress (equal keys: nothing to report)."""
    def one(report: JobReport):
        wire = report.to_dict()
        return tuple(sorted((k, repr(v)) for k, v in wire.items() if k not in PROGRESS_FIELDS))
    return tuple(sorted(one(r) for r in reports))


@dataclass
class BeatPlanner:
    """The agent's memory of its last full heartbeat and lease: which one is due next."""

    full_heartbeat_seconds: float = DEFAULT_FULL_HEARTBEAT_SECONDS
    leases_supported: bool = True
    synced_serial: int | None = None  # the serial seen (by a lease) before the last full heartbeat
    last_full_at: float | None = None
    last_reports: tuple | None = None
    deferred: bool = False
    counts: dict = field(default_factory=lambda: {"leases": 0, "full": 0, "lease_failures": 0})

    def full_due(self, reports: Sequence[JobReport], now: float) -> str | None:
        """Returns why a full heartbeat is due now regardless of the lease, or None."""
        if self.last_full_at is None:
            return "first heartbeat"
        if not self.leases_supported:
            return "no lease endpoint"
        if self.deferred:
            return "a report was deferred"
        if reports_key(reports) != self.last_reports:
            return "a report changed"
        if now - self.last_full_at >= self.full_heartbeat_seconds:
            return "telemetry due"
        return None

    def lease_answered(self, lease: LeaseAnswer) -> bool:
        """Records a lease answer; returns True when it suffices (no full heartbeat needed)."""
        self.counts["leases"] += 1
        if lease.full_heartbeat_seconds:
            self.full_heartbeat_seconds = lease.full_heartbeat_seconds
        return lease.desired_serial == self.synced_serial

    def lease_failed(self, status: int | None) -> None:
        self.counts["lease_failures"] += 1
        if status in (404, 405):
            self.leases_supported = False  # an older control plane: full heartbeats only

    def full_sent(self, *, reports: Sequence[JobReport], answer: HeartbeatAnswer, began: float,
                  lease: LeaseAnswer | None) -> None:
        """Records a full heartbeat answered. The serial it synced: the answer's own (the control
        plane read it before building the desired state), else that of `lease`, this beat's lease
        answered before the heartbeat began, else the serial stays as it was."""
        self.counts["full"] += 1
        self.last_full_at = began
        self.last_reports = reports_key(reports)
        self.deferred = bool(answer.deferred)
        if answer.desired_serial is not None:  # read before its desired state was built
            self.synced_serial = answer.desired_serial
        elif lease is not None:
            self.synced_serial = lease.desired_serial


def beat_once(*, client: ControlPlaneClient, planner: BeatPlanner, reports: Sequence[JobReport],
              full_heartbeat: Callable[[], HeartbeatAnswer], alive: Callable[[float], None],
              now: float | None = None) -> HeartbeatAnswer | None:
    """Beats once (see the module doc): returns the full heartbeat's answer, or None when a lease
    sufficed. `full_heartbeat` sends the full heartbeat of `reports` (and handles a rejected token);
    `alive(sent)` records that the control plane counted the node alive as of `sent` (monotonic).
    Raises what `full_heartbeat` raises."""
    now = time.monotonic() if now is None else now
    reason = planner.full_due(reports, now)
    lease = None
    if reason is None:
        try:
            lease = client.lease()
        except TokenRejected:
            reason = "the lease's token was rejected"  # the full heartbeat re-registers
        except ControlPlaneError as exc:
            planner.lease_failed(exc.status)
            reason = f"the lease failed ({exc})"
        else:
            alive(now)
            if planner.lease_answered(lease):
                return None
            reason = "the desired state changed"
    log.debug("full heartbeat: %s", reason)
    answer = full_heartbeat()
    alive(now)
    planner.full_sent(reports=reports, answer=answer, began=now, lease=lease)
    return answer
