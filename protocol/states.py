"""The words for states that cross the wire between the control plane and the node agent.

Each is a `StrEnum`: a member equals its word (`CopyState.RUNNING == "running"`), so it goes into
JSON, a JSONField or a log line as the word itself, and a message field typed with one refuses any
other word by name.

  CopyState      what one copy of a job on a node is doing (the agent reports it)
  LaunchState    what a launcher says it is doing (its progress.json, read by the agent)
  DesiredAction  what the control plane tells the agent to do with a job (desired state)
  CutAction      why the launcher took a consistent cut (its checkpoint and resize events)
  JobState       the job's own state as the desired state names it: the values of the
                 database's `jobs.models.Job.State` (a test asserts they are the same words)
  ResumeRefused  what a job's launcher does when the framework engine refuses its resume: the
                 values of `jobs.models.Job.ResumeRefused` (a test asserts the same words) and of
                 meridian-run's --if-resume-refused
"""
from __future__ import annotations

from enum import StrEnum


class CopyState(StrEnum):
    """What one copy (one launcher) of a job on a node is doing, as its agent reports it."""

    STARTING = "starting"  # launched; its ranks have not reported a step yet
    RUNNING = "running"
    STOPPED = "stopped"  # exited after a stop: checkpointed at a consistent cut, resumable
    FINISHED = "finished"  # the script ran to its end
    FAILED = "failed"  # the launcher or a rank failed (or the launcher is gone without saying why)

    @property
    def is_final(self) -> bool:
        """True for the states a copy never leaves (its launcher has exited)."""
        return self in FINAL_COPY_STATES


FINAL_COPY_STATES = frozenset({CopyState.STOPPED, CopyState.FINISHED, CopyState.FAILED})
LIVE_COPY_STATES = frozenset({CopyState.STARTING, CopyState.RUNNING})


class LaunchState(StrEnum):
    """What a launcher says it is doing in its progress.json (the agent derives CopyState from it)."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"  # a stop's cut is being taken
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"


class DesiredAction(StrEnum):
    """What the agent should do with one job of its desired state."""

    RUN = "run"  # launch (restoring restore_from), keep running, resize to `devices`
    WAIT = "wait"  # a migration's new copy before the move's restore step: launch nothing yet
    STOP = "stop"  # a move takes the copy off this node: stop at a consistent cut, checkpoint, exit


class CutAction(StrEnum):
    """Why the launcher took a consistent cut."""

    STOP = "stop"
    CHECKPOINT = "checkpoint"
    RESIZE = "resize"


class JobState(StrEnum):
    """A job's state in the control plane (the same words as `jobs.models.Job.State`)."""

    PENDING = "pending"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    PREEMPTING = "preempting"
    PREEMPTED = "preempted"
    MIGRATING = "migrating"
    RESIZING = "resizing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ResumeRefused(StrEnum):
    """What a job's launcher does when the framework engine refuses its resume because the re-run
    is not the run that was cut (an unseeded script, the script's own snapshot logic...): the
    job's `if_resume_refused`, passed to meridian-run as --if-resume-refused."""

    FAIL = "fail"  # the job fails, naming what differed (nothing is silently lost)
    RESTART = "restart"  # the script starts again from scratch, and the job's events say so


class JobNetwork(StrEnum):
    """The network a job's ranks have on a node (runtime/netns.py): the job's `network`, asked at
    submission, passed to the agent (DesiredJob.network) and by it to the launcher (SandboxSpec.network)."""

    ISOLATED = "isolated"  # a network namespace of the job's own with only loopback: it reaches nothing outside
    HOST = "host"  # the node's network: every address and port the node reaches, its loopback services too
