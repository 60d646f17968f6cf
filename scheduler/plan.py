"""The output of one tick: ordered decisions, each with a reason, and why every pending job waits.

Decisions are meant to be applied in order (`scheduler.apply_plan` does exactly that): the
releases (shrinks, preemptions, moves off lost nodes) come before the starts that use the
freed devices, so a device is never held by two jobs at any point of the sequence.

`job` is the job's index in `Snapshot.jobs`; `job_id` is the caller's id (`Jobs.ids[job]`).
`devices` are accelerator indices into `Snapshot.accelerators`, ascending. For Migrate and
Resize they are the job's complete new device set, not a difference.

`code` is a plugin's REASON_* constant (stable, for machines: metrics, tests, filters);
`reason` is the sentence a person reads ("needs 8 H100-80GB in one region; at most 5 free
together").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Union

from protocol.layout import rank_devices


@dataclass(frozen=True)
class Start:
    """Run a pending job on `devices` (restoring its last checkpoint if it has one)."""

    job: int  # index into Snapshot.jobs
    job_id: int  # caller's id
    devices: tuple  # accelerator indices, ascending; len(devices) is one of its allowed counts
    code: str  # REASON_* constant of the plugin that decided
    reason: str  # human-readable why
    borrowed: int = 0  # how many of these devices are over the team's quota (first reclaimed)
    starts_at: float | None = None  # s; when the last of the devices is free (Accelerators.
    # releasing_until; later than Snapshot.now when a previous holder is still checkpointing).
    # Devices released by a Preempt/Resize of this same plan are free only once that stop ends.
    kind = "start"


@dataclass(frozen=True)
class Preempt:
    """Checkpoint the job at a consistent cut, release all its devices, put it back in line.

    needs_approval=True means the preemption would break an SLA (a Premium job, or a Standard
    job below its attained-fraction floor): the control loop files a PreemptionRequest and
    nothing happens to the job until a capacity manager approves (the next snapshot then
    carries Jobs.preemption_approved). `apply_plan` skips such decisions.

    code "node lost, requeued" is not a checkpoint: the job's node or device died, its
    processes are gone, and it restarts from its last checkpoint when it is placed again.
    """

    job: int
    job_id: int
    code: str
    reason: str
    needs_approval: bool = False
    released: tuple = ()  # the devices it held (empty when needs_approval; nothing is released)
    for_job: int = -1  # index of the job the devices are taken for; -1 = none (lost node)
    for_job_id: int = -1  # that job's caller id (what a PreemptionRequest records)
    kind = "preempt"


@dataclass(frozen=True)
class Migrate:
    """Move the job to `devices` (its complete new set; W unchanged).

    from_checkpoint=True: its old processes are gone (lost node) and it restarts from its last
    checkpoint (`restart_step`); False: checkpoint at a consistent cut, restore on the new
    devices, release the old ones.

    kept > 0: a partial move. Only the devices on a leaving node (draining, lost) or failed are
    replaced; `devices` still lists the complete new set, `kept` of them held before. Applying it
    releases and re-acquires those kept devices in the same step (the job's new generation runs
    on them once its old one stopped there).
    """

    job: int
    job_id: int
    devices: tuple  # complete new device set, ascending
    code: str
    reason: str
    from_checkpoint: bool = False
    restart_step: int = 0  # Jobs.last_checkpoint_step when from_checkpoint
    kept: int = 0  # how many of `devices` it holds already (a partial move off a draining/lost node)
    kind = "migrate"


@dataclass(frozen=True)
class Resize:
    """Change how many devices run the job's W ranks (splicing); `devices` is the new set.

    A shrink keeps a subset of the current devices; a grow keeps all current devices and adds
    more. Either way the new count divides W.
    """

    job: int
    job_id: int
    devices: tuple  # complete new device set, ascending
    code: str
    reason: str
    borrowed: int = 0  # devices of the new set over the team's quota (grows only)
    for_job: int = -1  # shrinks: index of the job the devices are taken for; -1 for grows
    for_job_id: int = -1  # that job's caller id
    kind = "resize"


Decision = Union[Start, Preempt, Migrate, Resize]


@dataclass(frozen=True)
class WaitReason:
    """Why a job stays pending after this tick, and where it stands in line (1 = next)."""

    job: int
    job_id: int
    place: int  # 1-based position among all pending jobs in this tick's order
    code: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """The result of `scheduler.schedule`: ordered decisions and the waiting line."""

    decisions: tuple = ()  # Start / Preempt / Migrate / Resize, in the order to apply them
    waiting: tuple = ()  # WaitReason for every job still pending, ordered by place
    phase_seconds: dict = field(default_factory=dict)  # phase name -> seconds, if a timer was given

    def of_kind(self, kind: type) -> list:
        """Returns the decisions of one class (Start, Preempt, Migrate or Resize), in order."""
        return [d for d in self.decisions if isinstance(d, kind)]

    def wait_reason(self, job: int) -> WaitReason | None:
        """Returns the WaitReason of job index `job`, or None if it is not left pending."""
        for w in self.waiting:
            if w.job == job:
                return w
        return None

    def as_records(self) -> list[dict]:
        """Returns the decisions then the wait reasons as plain dicts (JSON-ready: ints, strings,
        lists), e.g. for JobEvent.extra_data or a log line. Each has "kind" and "job_id"."""
        records = []
        for d in self.decisions:
            record = {"kind": d.kind}
            for name, value in vars(d).items():
                record[name] = list(value) if isinstance(value, tuple) else value
            records.append(record)
        for w in self.waiting:
            records.append({"kind": "wait", "job": w.job, "job_id": w.job_id, "place": w.place,
                            "code": w.code, "reason": w.reason})
        return records

    def summary(self) -> dict:
        """Returns counts per decision kind plus "waiting" (for logs and the bench)."""
        counts = {"start": 0, "preempt": 0, "migrate": 0, "resize": 0, "approval": 0}
        for d in self.decisions:
            if isinstance(d, Preempt) and d.needs_approval:
                counts["approval"] += 1
            else:
                counts[d.kind] += 1
        counts["waiting"] = len(self.waiting)
        return counts


def rank_layout(devices: Iterable[int], world_size: int) -> tuple[int, ...]:
    """Returns, for each of the W ranks, the device it runs on.

    Ranks go in contiguous blocks of W/d, so ranks sharing a device (splicing) are
    neighbours: rank r runs on devices[r * d // W] (protocol.layout.rank_devices). Raises
    protocol.layout.LayoutError (a ValueError) if d does not divide W.
    """
    devices = tuple(int(x) for x in devices)
    return tuple(devices[k] for k in rank_devices(world_size, len(devices)))
