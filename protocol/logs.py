"""Live logs: the rank output an agent ships to the control plane, and the launcher's log manifest.

  POST /api/agent/logs/   LogBatch -> LogBatchAnswer   (Authorization: Node <token>)

The agent tails each rank's log file (named by the launcher's `<job dir>/logs.json`, a RankLogs)
and sends byte ranges of it as LogChunks. A chunk names its copy (job id, placement generation,
the agent's attempt number on that node) and its place in that copy's rank log (`offset`, the
byte offset where `text` starts, and `length`, its size in bytes), so a chunk sent twice (an
answer lost on the way back) is stored once. `dropped` says how many bytes before `offset` the
agent never sent (its backlog limit was reached while the control plane could not be reached):
the control plane stores a marker saying so.

Bounds: a chunk carries at most MAX_TEXT characters (the agent cuts at MAX_CHUNK_BYTES bytes), a
batch at most MAX_CHUNKS chunks; the agent keeps a batch's JSON under MAX_BATCH_BYTES, below the
control plane's request body limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.message import Message, bounded
from protocol.node import MAX_ERROR, MAX_GENERATION, MAX_ID, MAX_PATH, MAX_WORLD_SIZE, SHA256_HEX

MAX_CHUNK_BYTES = 16_384  # bytes of rank output in one chunk (the agent's cut)
MAX_TEXT = MAX_CHUNK_BYTES  # characters: a chunk decoded from at most MAX_CHUNK_BYTES bytes has no more
MAX_CHUNKS = 64  # chunks in one batch
MAX_BATCH_BYTES = 200_000  # the agent's bound on a batch's JSON (the control plane takes 256 KiB by default)
MAX_OFFSET = 2**62  # a byte offset in a rank log
MAX_ATTEMPT = 2**31 - 1

# Which output a chunk holds: a rank's "stdout" or "stderr" (each a file of its own); "output" is
# both in one file, in the order written (as `2>&1`): what a launcher of before had.
LogStream = Literal["output", "stdout", "stderr"]


@dataclass(frozen=True, kw_only=True)
class LogChunk(Message):
    """A byte range of one rank's log of one copy of a job, decoded as UTF-8 (bad bytes replaced)."""

    job_id: int = bounded(minimum=1, maximum=MAX_ID)
    generation: int | None = bounded(minimum=0, maximum=MAX_GENERATION)  # the copy's placement generation
    attempt: int = bounded(minimum=1, maximum=MAX_ATTEMPT)  # the agent's attempt number of the job on this node
    rank: int = bounded(minimum=0, maximum=MAX_WORLD_SIZE - 1)
    stream: LogStream = "output"
    offset: int = bounded(minimum=0, maximum=MAX_OFFSET)  # byte offset of `text` in this copy's rank log
    length: int = bounded(minimum=0, maximum=MAX_CHUNK_BYTES)  # bytes of the rank log `text` was decoded from
    text: str = bounded(max_length=MAX_TEXT)
    dropped: int = bounded(default=0, minimum=0, maximum=MAX_OFFSET)  # bytes before `offset` never sent
    # The copy's log grant, as the node's desired state gave it (DesiredJob.log_grant): with it, the
    # copy's output is taken after the job released this node's devices. None: an older agent.
    grant: str | None = bounded(default=None, max_length=64, pattern=SHA256_HEX)


@dataclass(frozen=True, kw_only=True)
class LogBatch(Message):
    """POST logs/: chunks of rank output, in the order they were read."""

    chunks: tuple[LogChunk, ...] = bounded(max_length=MAX_CHUNKS)


@dataclass(frozen=True, kw_only=True)
class LogRejection(Message):
    """The chunks of one copy of a job the control plane refused, and why. `fence`: the copy they
    come from is not (or no longer) the job's copy on this node; the agent stops shipping it.
    `generation`: that copy's placement generation (as the control plane took it: the job's own
    when the chunk said none). Another copy of the same job in the same batch (the current one
    next to the tail of an older one) is judged on its own. None (an older control plane): every
    copy of the job in the batch."""

    job_id: int = bounded(minimum=1, maximum=MAX_ID)
    error: str = bounded(max_length=MAX_ERROR)
    fence: bool = False
    generation: int | None = bounded(default=None, minimum=0, maximum=MAX_GENERATION)


@dataclass(frozen=True, kw_only=True)
class LogBatchAnswer(Message):
    """200 to LogBatch: how many chunks were stored, how many it had already (a resend), and the
    jobs whose chunks were refused."""

    stored: int = bounded(minimum=0, maximum=MAX_CHUNKS)
    duplicates: int = bounded(default=0, minimum=0, maximum=MAX_CHUNKS)
    rejected: tuple[LogRejection, ...] = bounded(default=(), max_length=MAX_CHUNKS)


# --- launcher -> agent: where the rank logs are -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RankLog(Message):
    """One rank's log file of this attempt, and the byte offset where this attempt's output starts
    (a CRIU-restored rank's log holds the output of earlier attempts before it)."""

    rank: int = bounded(minimum=0, maximum=MAX_WORLD_SIZE - 1)
    path: str = bounded(max_length=MAX_PATH)
    start: int = bounded(default=0, minimum=0, maximum=MAX_OFFSET)
    stream: LogStream = "output"


@dataclass(frozen=True, kw_only=True)
class RankLogs(Message):
    """<job dir>/logs.json, written by the launcher: every rank's log files, for the job's life."""

    ranks: tuple[RankLog, ...] = bounded(max_length=2 * MAX_WORLD_SIZE)
