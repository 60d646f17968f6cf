"""Moves: preemption, migration and resize as persisted, step-by-step Celery workflows.

    preemption  barrier -> checkpoint -> store -> release
    migration   barrier -> checkpoint -> store -> restore -> release
                (after a lost node: restore -> release; nothing is left to cut on the dead node)
    resize      barrier -> resize -> release                       (in place: one host, same host)
    resize      barrier -> checkpoint -> store -> restore -> release (across hosts, or a GPU job: a
                                                                      new generation, relaunched)

The tick decides a move and creates its Move row (move_create, with the job's state change);
after commit a Celery chain of immutable signatures runs one task per remaining step
(jobs.tasks.move_step). A step task asks `move_step_run`: is my step observed done? If so it
completes it (a conditional UPDATE on the move's step, so only one caller wins; a JobEvent in the
same transaction) and the chain goes on; if not, it retries with a short countdown until its
deadline, when the move is ended (timed_out: the job goes back in line from its last
checkpoint). The agents stay level-triggered: node_desired_state derives each node's orders from
the move's step, and node_report_apply records what they saw on the Move (`observed`, per
placement generation) and enqueues jobs.tasks.move_advance, which completes every step already
observed without waiting for the chain's next poll. A step that is done twice is a no-op.

What completes each step (the runtime's `stop` takes cut, checkpoint and store commit in one
control call; each step checks its own evidence):
  barrier     preemption/migration: the old copy reports its stop's consistent cut (the
              launcher's checkpoint event with action "stop"), or that it stopped with a
              checkpoint. resize: the copy reports the splice's cut onto the new device count.
  checkpoint  a Checkpoint row at the cut's step exists (recorded from the same report).
  store       the checkpoint's MANIFEST.json is visible in the store, or the old copy reported
              "stopped" (its launcher exits only after the commit).
  restore     the new copy (to_generation) reports running (or finished) at a step >= the cut.
  resize      the copy reports running on the new device count.
  release     preemption: the old copy has exited (or its node is lost) -> job preempted.
              migration: the same -> job running. resize: -> job running.

If the old copy fails, or its node (or any host of a job that spans hosts) is lost, before the
cut, the move ends (failed) and the job goes back in line from its last checkpoint; if it
finishes first, the job succeeded.

A lost chain (worker crash) is found by moves_sweep (run by every tick): an active move no
step task looked at for LOST_CHAIN_AFTER is re-enqueued from its current step with a new
chain id (the old chain's tasks, should they wake up, see another chain id and exit); a move
past its deadline is timed out there too.
"""
from __future__ import annotations

import logging
import pathlib
import uuid
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import unquote, urlparse

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from fleet.models import Node
from jobs.models import Checkpoint, Job, JobEvent, Move
from jobs.services import IllegalTransition, job_event_add, job_generation_bump, job_transition
from observability import metrics
from protocol import ProtocolError
from protocol.node import CheckpointReport, CutReport, JobReport
from protocol.states import FINAL_COPY_STATES, CopyState, CutAction

logger = logging.getLogger(__name__)
S = Job.State
K = Move.Kind
St = Move.Step

STEPS = {
    K.PREEMPTION: (St.BARRIER, St.CHECKPOINT, St.STORE, St.RELEASE),
    K.MIGRATION: (St.BARRIER, St.CHECKPOINT, St.STORE, St.RESTORE, St.RELEASE),
    K.RESIZE: (St.BARRIER, St.RESIZE, St.RELEASE),
}
# A resize across hosts (the job spans several before or after it, or changes host): its launchers
# cannot re-splice their ranks onto another set of hosts in place (a host's ranks are processes
# there, and the framework engine has no way to hand one running rank's state to a process on
# another host but a checkpoint), so it is the migration's steps on the same job: a consistent
# cut over every host, one framework checkpoint of all ranks, and a relaunch of the W ranks
# spliced onto the new hosts' devices as a new placement generation. It stays a resize (the job
# is "resizing", then "running" on its new device count); plan_apply bumps the generation.
RELAUNCH_RESIZE_STEPS = STEPS[K.MIGRATION]
MOVING_STATE = {K.PREEMPTION: S.PREEMPTING, K.MIGRATION: S.MIGRATING, K.RESIZE: S.RESIZING}
LOG_KEEP = 50  # entries of Move.log kept (a lost chain re-enqueued many times must not grow it forever)

# move_step_run outcomes
DONE, WAITING, PASSED, ENDED, SUPERSEDED = "done", "waiting", "passed", "ended", "superseded"


def step_timeout():
    """Returns how long a step may take before the move is ended (settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS)."""
    return timedelta(seconds=settings.MERIDIAN_WORKFLOW_TIMEOUT_SECONDS)


def move_poll_seconds():
    """Returns the countdown of a step task's retry while its step is not observed yet
    (settings.MERIDIAN_MOVE_POLL_SECONDS)."""
    return settings.MERIDIAN_MOVE_POLL_SECONDS


def lost_chain_after():
    """An active move no step task looked at for this long has lost its chain (worker crash)."""
    return timedelta(seconds=max(15.0, 10 * move_poll_seconds()))


def move_relaunches(move) -> bool:
    """True when `move` is a resize that relaunches the job (across hosts, or a GPU job's): a new
    generation, by cut, checkpoint and relaunch."""
    return move.kind == K.RESIZE and move.from_generation != move.to_generation


def move_steps(move) -> tuple:
    """Returns the steps of `move` in order (STEPS of its kind; RELAUNCH_RESIZE_STEPS for a resize
    that relaunches)."""
    return RELAUNCH_RESIZE_STEPS if move_relaunches(move) else STEPS[K(move.kind)]


def generation_key(generation):
    return f"g{int(generation)}"


def _log(move, now, step, note):
    return (list(move.log) + [{"at": now.isoformat(), "step": str(step), "note": note[:300]}])[-LOG_KEEP:]


# --- creating a move (the tick) ------------------------------------------------------------------


def move_create(*, job, kind, reason, now, from_node_id=None, to_node_id=None, from_generation=None,
                to_generation=None, from_devices=0, to_devices=0, first_step=None, cut_step=None, note="",
                from_nodes=()):
    """Returns a new active Move of `job` and enqueues its chain on commit. Call it inside the
    transaction that puts the job into its moving state.

    Any other active move of the job is ended first (failed, "superseded"): one active move per
    job, which the database also enforces (move_one_active_per_job).

    `from_nodes`: every Node.pk the old copy ran on (a job spanning hosts; from_node_id, its
    leader, among them), kept in observed["from_nodes"]: their copies of from_generation are the
    move's too (their reports are accepted, not fenced) and release waits for all of them.
    """
    for old in Move.objects.filter(job_id=job.pk, state=Move.State.ACTIVE):
        Move.objects.filter(pk=old.pk, state=Move.State.ACTIVE).update(
            state=Move.State.FAILED, finished_at=now, log=_log(old, now, old.step, "superseded by a new move"))
    kind = K(kind)
    first = St(first_step or STEPS[kind][0])
    move = Move.objects.create(
        job=job, kind=kind, step=first, reason=reason[:500], from_node_id=from_node_id, to_node_id=to_node_id,
        from_generation=job.generation if from_generation is None else from_generation,
        to_generation=job.generation if to_generation is None else to_generation,
        from_devices=from_devices, to_devices=to_devices, start_step=job.progress_step or 0, cut_step=cut_step,
        created_at=now, step_started_at=now, step_deadline=now + step_timeout(), polled_at=now,
        log=[{"at": now.isoformat(), "step": first, "note": (note or reason)[:300]}],
        observed={FROM_NODES: sorted(set(from_nodes) - {from_node_id})} if from_node_id and len(set(from_nodes)) > 1
        else {},
    )
    job_event_add(job=job, type=JobEvent.Type.MOVE_STEP, reason=f"{kind} started: {reason}"[:500],
                  extra={"move": move.pk, "kind": kind, "step": "started", "next": first,
                         "from_node": from_node_id, "to_node": to_node_id,
                         **({"skipped": note} if note else {})})
    move_chain_enqueue(move=move, now=now)
    return move


def move_chain_enqueue(*, move, now):
    """Starts a Celery chain over the move's remaining steps, after commit; returns its chain id.

    A new chain id supersedes any earlier chain of the move: its tasks exit when they wake up.
    """
    from celery import chain

    from jobs.tasks import move_step

    chain_id = uuid.uuid4().hex[:16]
    Move.objects.filter(pk=move.pk).update(chain_id=chain_id, polled_at=now)
    move.chain_id = chain_id
    steps = move_steps(move)
    remaining = steps[steps.index(St(move.step)):] if move.step in steps else ()
    if remaining:
        move_id = move.pk
        signatures = [move_step.si(move_id, str(step), chain_id) for step in remaining]
        # robust: a broker hiccup must not fail the caller (the sweep re-enqueues a lost chain)
        transaction.on_commit(lambda: chain(*signatures).apply_async(), robust=True)
    return chain_id


# --- observations (node_report_apply) -------------------------------------------------------------


def move_active(*, job_id):
    return Move.objects.filter(job_id=job_id, state=Move.State.ACTIVE).first()


OBSERVED_FIELDS = ("state", "step", "devices", "cut", "checkpoint", "restored_step", "error", "restarted")


FROM_NODES = Move.FROM_NODES  # Move.observed key: the old copy's follower hosts (move_create)


def move_follower_nodes(move) -> list[int]:
    """Returns the Node.pks besides from_node that ran the old copy (a job that spans hosts)."""
    return [int(pk) for pk in move.observed.get(FROM_NODES) or ()]


def _follower_key(generation, node_id):
    return f"{generation_key(generation)}@{int(node_id)}"


def move_observe(*, move, generation, node, entry: JobReport, now):
    """Records one agent report on a copy of the moving job (its `generation`) on the move, and
    enqueues jobs.tasks.move_advance after commit. Returns nothing. The leader of a job that
    spans hosts speaks for the copy; a follower host's report is kept under its own key (only
    release reads it: the move is done once every host's share has exited)."""
    record = {"node": node.pk, "hostname": node.hostname, "at": now.isoformat()}
    wire = entry.to_dict()
    for key in OBSERVED_FIELDS:
        if wire.get(key) is not None:
            record[key] = wire[key]
    observed = dict(move.observed)
    follower = generation == move.from_generation and node.pk in move_follower_nodes(move)
    observed[_follower_key(generation, node.pk) if follower else generation_key(generation)] = record
    Move.objects.filter(pk=move.pk).update(observed=observed)
    move.observed = observed
    move_id = move.pk

    def enqueue():
        from jobs.tasks import move_advance

        move_advance.delay(move_id)

    transaction.on_commit(enqueue, robust=True)  # the chain's own polls catch up if this is lost


# --- the steps ------------------------------------------------------------------------------------


class _Outcome:
    """What a step check found: done (with a note and event extras), failed, finished, or nothing."""

    def __init__(self, kind, note="", extra=None, **changes):
        self.kind, self.note, self.extra, self.changes = kind, note, extra or {}, changes


@dataclass(frozen=True)
class _Seen:
    """The last report the move recorded on one copy (move_observe), or an empty one."""

    report: JobReport | None = None
    hostname: str | None = None

    @property
    def state(self) -> CopyState | None:
        return self.report.state if self.report else None

    @property
    def step(self) -> int | None:
        return self.report.step if self.report else None

    @property
    def devices(self) -> int:
        return (self.report.devices or 0) if self.report else 0

    @property
    def cut(self) -> CutReport | None:
        return self.report.cut if self.report else None

    @property
    def checkpoint(self) -> CheckpointReport | None:
        return self.report.checkpoint if self.report else None

    @property
    def error(self) -> str:
        return (self.report.error or "") if self.report else ""

    @property
    def restarted(self) -> str | None:
        """Why the copy started again from scratch after its resume was refused, or None."""
        return self.report.restarted if self.report else None


def _seen(move, generation) -> _Seen:
    record = move.observed.get(generation_key(generation))
    if not record:
        return _Seen()
    try:
        report = JobReport.from_dict({"job_id": move.job_id, **record})
    except ProtocolError as exc:  # written by move_observe from a decoded report: never, unless edited
        logger.warning("move %s: the record of generation %s is unreadable (%s); treated as not seen",
                       move.pk, generation, exc)
        return _Seen()
    return _Seen(report=report, hostname=record.get("hostname"))


def _old(move) -> _Seen:
    return _seen(move, move.from_generation)


def _new(move) -> _Seen:
    return _seen(move, move.to_generation)


def _node_lost(node_id):
    return node_id in _lost_nodes([node_id])


def _lost_nodes(node_ids) -> dict[int, str]:
    """Returns {Node.pk: hostname} of the nodes among `node_ids` that are lost. One query."""
    ids = [node_id for node_id in node_ids if node_id is not None]
    return dict(Node.objects.filter(pk__in=ids, state=Node.State.LOST).values_list("pk", "hostname")) if ids else {}


def _checkpoint_visible(uri):
    """True when `uri` (file:// or a path) names a committed checkpoint this machine can see."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        return False
    return (pathlib.Path(unquote(parsed.path)) / "MANIFEST.json").exists()


def _check_barrier(move, job):
    if move.kind == K.RESIZE and not move_relaunches(move):
        seen = _new(move)
        cut = seen.cut
        if cut is not None and cut.action == CutAction.RESIZE and (cut.devices or 0) == move.to_devices \
                and cut.step >= move.start_step:
            return _Outcome(DONE, f"cut at step {cut.step} for the splice onto {move.to_devices} device(s)",
                            {"cut_step": cut.step}, cut_step=cut.step)
        if seen.state in (CopyState.RUNNING, CopyState.FINISHED) and seen.devices == move.to_devices:
            return _Outcome(DONE, f"runs on {move.to_devices} device(s) at step {seen.step}",
                            {"cut_step": seen.step}, cut_step=seen.step or 0)
        return None
    seen = _old(move)
    cut = seen.cut
    checkpoint = seen.checkpoint
    if cut is not None and cut.action == CutAction.STOP:
        kind = f" ({cut.kind})" if cut.kind else ""
        return _Outcome(DONE, f"consistent cut at step {cut.step}{kind}",
                        {"cut_step": cut.step, "cut_kind": cut.kind}, cut_step=cut.step)
    if seen.state == CopyState.STOPPED and checkpoint is not None and checkpoint.step is not None:
        return _Outcome(DONE, f"stopped at a consistent cut at step {checkpoint.step}",
                        {"cut_step": checkpoint.step}, cut_step=checkpoint.step)
    if seen.state == CopyState.FINISHED:
        return _Outcome("finished", f"the job finished on {seen.hostname} before the cut")
    if seen.state == CopyState.FAILED:
        return _Outcome("failed", f"the old copy failed before the cut: {seen.error[:200]}")
    followers = move_follower_nodes(move)
    lost = _lost_nodes([move.from_node_id, *followers])
    if move.from_node_id in lost:
        return _Outcome("failed", "its node was lost before the cut")
    if lost:
        # A cut spans every host of the job: with one of them gone it can never be taken (the leader
        # would only find out at its own lost-host limit, or later), so the job goes back in line now.
        return _Outcome("failed", f"its host {lost[next(n for n in followers if n in lost)]} was lost before the cut")
    return None


def _check_checkpoint(move, job):
    row = Checkpoint.objects.filter(job_id=job.pk, step=move.cut_step, retired_at__isnull=True).order_by("-id").first()
    if row is None:
        return None
    return _Outcome(DONE, f"checkpoint at step {row.step} ({row.engine}, {row.bytes} bytes)",
                    {"checkpoint_step": row.step, "engine": row.engine, "bytes": row.bytes, "uri": row.uri},
                    checkpoint_uri=row.uri)


def _check_store(move, job):
    if _checkpoint_visible(move.checkpoint_uri):
        return _Outcome(DONE, f"step {move.cut_step} committed in the store", {"checkpoint_step": move.cut_step,
                                                                                  "uri": move.checkpoint_uri})
    if _old(move).state == CopyState.STOPPED:
        return _Outcome(DONE, f"step {move.cut_step} committed (the old copy exited after its commit)",
                        {"checkpoint_step": move.cut_step, "uri": move.checkpoint_uri})
    return None


def _check_restore(move, job):
    seen = _new(move)
    if seen.state in (CopyState.RUNNING, CopyState.FINISHED) and seen.restarted:
        # The framework engine refused the resume and the job asked to start again from scratch
        # (if_resume_refused "restart"): its step starts at 0 and would not reach the cut's before
        # the step's deadline, yet the move is done all the same.
        return _Outcome(DONE, f"running on {seen.hostname}, restarted from scratch at step {seen.step}: the resume "
                              f"of checkpoint step {move.cut_step} was refused",
                        {"checkpoint_step": move.cut_step, "running_step": seen.step, "restarted": seen.restarted})
    if seen.state in (CopyState.RUNNING, CopyState.FINISHED) and (seen.step or 0) >= (move.cut_step or 0):
        return _Outcome(DONE, f"running on {seen.hostname} at step {seen.step} "
                              f"(restored checkpoint step {move.cut_step})",
                        {"checkpoint_step": move.cut_step, "running_step": seen.step})
    if seen.state == CopyState.FAILED:
        return _Outcome("failed", f"the restore failed: {seen.error[:200]}")
    return None


def _check_resize(move, job):
    seen = _new(move)
    if seen.state in (CopyState.RUNNING, CopyState.FINISHED) and seen.devices == move.to_devices:
        return _Outcome(DONE, f"{job.world_size} rank(s) on {move.to_devices} device(s) at step {seen.step}",
                        {"devices": move.to_devices, "checkpoint_step": job.last_checkpoint_step,
                         "running_step": seen.step})
    return None


def _check_release(move, job):
    if move.kind == K.RESIZE and not move_relaunches(move):
        return _Outcome(DONE, f"devices {move.from_devices} -> {move.to_devices} confirmed")
    gone = _old(move).state in FINAL_COPY_STATES
    if move.from_node_id is None:
        return _Outcome(DONE, "the old copy is fenced (its node was lost)", {"checkpoint_step": move.cut_step})
    still = _followers_running(move)
    if still:
        return None  # a host's share of the old copy has not exited yet: its devices are not free
    if gone or _node_lost(move.from_node_id):
        why = "the old copy exited" if gone else "its node is lost"
        return _Outcome(DONE, f"{why}; its devices are free", {"checkpoint_step": move.cut_step})
    return None


def _followers_running(move) -> list[str]:
    """Returns the hostnames of the old copy's follower hosts whose share last reported alive
    (a host never heard from during the move, or lost, is not waited for)."""
    followers = move_follower_nodes(move)
    lost = _lost_nodes(followers)
    running = []
    for node_id in followers:
        record = move.observed.get(_follower_key(move.from_generation, node_id)) or {}
        state = record.get("state")
        if state and CopyState(state) not in FINAL_COPY_STATES and node_id not in lost:
            running.append(record.get("hostname") or str(node_id))
    return running


CHECKS = {St.BARRIER: _check_barrier, St.CHECKPOINT: _check_checkpoint, St.STORE: _check_store,
          St.RESTORE: _check_restore, St.RESIZE: _check_resize, St.RELEASE: _check_release}


def _node_name(node_id):
    if node_id is None:
        return None
    return Node.objects.filter(pk=node_id).values_list("hostname", flat=True).first()


def _complete(*, move, job, outcome, now):
    """Completes the move's current step (conditional on it still being current); returns True
    if this caller did. The job's transition at release happens here, in the same transaction."""
    steps = move_steps(move)
    step = St(move.step)
    following = steps[steps.index(step) + 1] if steps.index(step) + 1 < len(steps) else St.DONE
    with transaction.atomic():
        changes = {"step": following, "step_started_at": now, "step_deadline": now + step_timeout(),
                   "log": _log(move, now, step, outcome.note), **outcome.changes}
        if following == St.DONE:
            changes.update(state=Move.State.DONE, finished_at=now)
        updated = Move.objects.filter(pk=move.pk, state=Move.State.ACTIVE, step=step).update(**changes)
        if updated != 1:
            return False
        metrics.move_step_observed(kind=move.kind, step=step, seconds=(now - move.step_started_at).total_seconds(), last=following == St.DONE)  # noqa: E501
        for field, value in changes.items():
            setattr(move, field, value)
        node_id = move.to_node_id if step in (St.RESTORE, St.RESIZE) or move.kind == K.RESIZE else move.from_node_id
        job_event_add(job=job, type=JobEvent.Type.MOVE_STEP, reason=f"{move.kind}: {step} done: {outcome.note}"[:500],
                      extra={"move": move.pk, "kind": move.kind, "step": step, "node": _node_name(node_id),
                             "checkpoint_step": move.cut_step, **outcome.extra})
        if following == St.DONE:
            _release_job(move=move, job=job, now=now)
    return True


def _release_job(*, move, job, now):
    target = S.PREEMPTED if move.kind == K.PREEMPTION else S.RUNNING
    if job.state != MOVING_STATE[K(move.kind)]:
        return
    restored = ("restarted from scratch (its resume was refused)" if _new(move).restarted
                else f"restored from checkpoint step {move.cut_step}")
    reason = {K.PREEMPTION: f"checkpointed at step {move.cut_step} and released; back in line",
              K.MIGRATION: f"{restored} on {_node_name(move.to_node_id)}",
              K.RESIZE: f"resized to {move.to_devices} device(s)" + (
                  f" by a relaunch: {restored}, leader {_node_name(move.to_node_id)}" if move_relaunches(move) else "")
              }[K(move.kind)]
    try:
        job_transition(job=job, to=target, reason=reason, now=now, extra={"move": move.pk})
    except IllegalTransition as exc:  # cancelled meanwhile: the move is done all the same
        logger.info("move %s: %s", move.pk, exc)


def move_end(*, move, job, state, reason, now, requeue=True):
    """Ends an active move early (failed / timed_out): the job goes back in line (preempted) from
    its last checkpoint, with a MOVE_ENDED event naming the step, and its generation is bumped so
    whatever copy is left (slow, or cut off) is fenced. Returns True if this call did.
    requeue=False leaves the job's state (and generation) to the caller."""
    with transaction.atomic():
        updated = Move.objects.filter(pk=move.pk, state=Move.State.ACTIVE).update(
            state=state, finished_at=now, log=_log(move, now, move.step, reason))
        if updated != 1:
            return False
        move.state = state
        metrics.move_ended(kind=move.kind, outcome=state)
        job_event_add(
            job=job, type=JobEvent.Type.MOVE_ENDED, reason=f"{move.kind} {state} at {move.step}: {reason}"[:500],
            extra={"move": move.pk, "kind": move.kind, "step": move.step, "state": state,
                   "checkpoint_step": job.last_checkpoint_step},
        )
        if requeue and job.state == MOVING_STATE[K(move.kind)]:
            job_generation_bump(job)
            try:
                job_transition(job=job, to=S.PREEMPTED, now=now, extra={"move": move.pk, "timed_out": move.step}
                               if state == Move.State.TIMED_OUT else {"move": move.pk},
                               reason=f"{move.kind} {state.replace('_', ' ')} at step {move.step}; back in line, "
                                      f"resuming from checkpoint step {job.last_checkpoint_step}")
            except IllegalTransition as exc:
                logger.info("move %s: %s", move.pk, exc)
    return True


def _finish_job(*, move, job, note, now, state=Move.State.DONE):
    """A copy of the job finished during the move (the old one before the cut; or the new one,
    restored, while the old one's exit was never confirmed: `state` TIMED_OUT): the move ends
    with `state` and the job succeeds."""
    with transaction.atomic():
        if not move_end(move=move, job=job, state=state, reason=note, now=now, requeue=False):
            return False
        if job.state in (S.PREEMPTING, S.MIGRATING, S.RESIZING):
            job = job_transition(job=job, to=S.RUNNING, reason=note, now=now, extra={"move": move.pk})
        if job.state == S.RUNNING:
            Job.objects.filter(pk=job.pk).update(exit_code=0)
            job_transition(job=job, to=S.SUCCEEDED, reason=note, now=now)
    return True


def move_step_run(*, move_id, step, chain_id=None, now=None):
    """Runs step `step` of a move once; returns DONE (completed now), PASSED (already past it),
    WAITING (not observed yet, deadline ahead: retry), ENDED (the move is over, or was ended
    now: failed / timed out / the job finished) or SUPERSEDED (another chain runs this move)."""
    now = now or timezone.now()
    move = Move.objects.filter(pk=move_id).first()
    if move is None or move.state != Move.State.ACTIVE:
        return ENDED
    if chain_id is not None:
        if move.chain_id != chain_id:
            return SUPERSEDED
        Move.objects.filter(pk=move.pk).update(polled_at=now)  # the chain is alive (moves_sweep)
    steps = move_steps(move)
    step = St(step)
    if St(move.step) not in steps or steps.index(St(move.step)) > steps.index(step):
        return PASSED
    if move.step != step:
        return WAITING  # an earlier step is still in progress (a re-enqueued chain)
    job = Job.objects.get(pk=move.job_id)
    if job.state != MOVING_STATE[K(move.kind)]:
        # cancelled, or moved on by someone else: nothing left to do for this move
        Move.objects.filter(pk=move.pk, state=Move.State.ACTIVE).update(
            state=Move.State.DONE if job.state == S.SUCCEEDED else Move.State.FAILED, finished_at=now,
            log=_log(move, now, move.step, f"the job is {job.state}"))
        return ENDED
    outcome = CHECKS[step](move, job)
    if outcome is None:
        if now >= move.step_deadline:
            why = f"{step} not done within {(now - move.step_started_at).total_seconds():.0f} s"
            finished = _new(move) if step == St.RELEASE and move.to_generation == job.generation else _Seen()
            if finished.state == CopyState.FINISHED:
                # The restored copy ran to its end; only the old copy's exit went unconfirmed. Its
                # generation is fenced (its reports are refused, its agent kills it), so the result
                # stands: requeued, the job would run its last steps again for nothing (found by the
                # chaos soak, a follower host that never reported its share's exit).
                _finish_job(move=move, job=job, state=Move.State.TIMED_OUT, now=now,
                            note=f"finished on {finished.hostname} at step {finished.step}; {why} (the old "
                                 "copy's exit was never confirmed: its generation is fenced)")
            else:
                move_end(move=move, job=job, state=Move.State.TIMED_OUT, now=now, reason=why)
            return ENDED
        return WAITING
    if outcome.kind == "finished":
        _finish_job(move=move, job=job, note=outcome.note, now=now)
        return ENDED
    if outcome.kind == "failed":
        move_end(move=move, job=job, state=Move.State.FAILED, reason=outcome.note, now=now)
        return ENDED
    return DONE if _complete(move=move, job=job, outcome=outcome, now=now) else PASSED


def move_advance(*, move_id, now=None):
    """Completes every step of the move that is already observed done (what a report enqueues);
    returns the steps completed. Never waits, never times out (the chain and the sweep do)."""
    done = []
    for _ in range(len(St)):
        move = Move.objects.filter(pk=move_id, state=Move.State.ACTIVE).only("step").first()
        if move is None:
            break
        outcome = move_step_run(move_id=move_id, step=move.step, now=now)
        if outcome != DONE:
            break
        done.append(move.step)
    return done


def moves_sweep(*, now=None):
    """Times out active moves past their step deadline and re-enqueues the chains of moves no
    step task looked at for lost_chain_after() (a crashed worker). Returns {"timed_out", "requeued"}."""
    now = now or timezone.now()
    timed_out = requeued = 0
    for move in Move.objects.filter(state=Move.State.ACTIVE).order_by("id"):
        if now >= move.step_deadline:
            if move_step_run(move_id=move.pk, step=move.step, now=now) == ENDED \
                    and Move.objects.filter(pk=move.pk, state=Move.State.TIMED_OUT).exists():
                timed_out += 1
            continue
        if move.polled_at is None or now - move.polled_at >= lost_chain_after():
            Move.objects.filter(pk=move.pk).update(log=_log(move, now, move.step, "chain lost; re-enqueued"))
            move_chain_enqueue(move=move, now=now)
            requeued += 1
    return {"timed_out": timed_out, "requeued": requeued}
