"""Ships every rank's output to the control plane, live, without ever holding up a job.

The launcher keeps each rank's stdout and stderr logs in the job directory for the job's life and names the files
in `<job dir>/logs.json` (runtime/rank_logs.py). A LogShipper thread tails them: every poll it
reads what was appended since the last byte the control plane acknowledged, cuts it into
chunks (protocol.logs.LogChunk: at most MAX_CHUNK_BYTES, at a line end where there is one, at
a UTF-8 character boundary always; a partial last line waits one poll for its end, then goes as
it is) and POSTs them (logs/). The job never waits for this: it writes to a file; only the
shipper's reading lags.

The disk buffer is the rank log itself: what the control plane has acknowledged is recorded per
job directory in `logs-shipped.json` (so a restarted agent carries on where it stopped), and
everything after that point is the backlog. While the control plane cannot be reached the
backlog grows; up to `backlog_limit` bytes per rank log nothing is lost. Beyond it the shipper
skips the oldest unsent bytes (keeping the newest `backlog_limit`) and says so: the next chunk
carries `dropped` = the bytes skipped, and the control plane stores a marker "N bytes dropped".

Every chunk carries the copy's log grant (the desired state's `log_grant`, kept in agent.json):
it proves the copy was placed on this node, so the copy's last lines are taken even when they
arrive after the control plane released its devices (jobs/logs.py), however late: an agent frozen
or cut off for the copy's whole life ships all of it after the job ended.

A job directory is done once its launcher is gone and every rank log was sent to its end, or
when the control plane refused its chunks with "fence" (the copy is not the job's copy on this
node: nothing of it will ever be accepted).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
import time
from dataclasses import dataclass, field

from protocol.bundle import is_sha256
from protocol.logs import MAX_BATCH_BYTES, MAX_CHUNK_BYTES, MAX_CHUNKS, LogBatch, LogChunk
from runtime.rank_logs import read_manifest

log = logging.getLogger("agent.logs")
SHIPPED = "logs-shipped.json"
DEFAULT_BACKLOG_LIMIT = 64 * 1024 * 1024  # bytes per rank log
POLL_S = 0.2


def _cursor_key(text: str) -> tuple[int, str]:
    """"3:stderr" -> (3, "stderr"); a bare "3" (one file per rank) -> (3, "output")."""
    rank, _, stream = str(text).partition(":")
    return int(rank), stream or "output"


def utf8_boundary(data: bytes) -> int:
    """Returns the length of the longest prefix of `data` that does not end inside a UTF-8
    character (a character cut by a read completes in the next chunk)."""
    end = len(data)
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte & 0xC0 == 0x80:  # a continuation byte: keep looking for the lead byte
            continue
        if byte & 0x80 == 0:  # ASCII
            return end
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return end if back >= need else end - back
    return end


def cut(data: bytes, *, final: bool) -> bytes:
    """Returns the part of `data` (read from a rank log, at most MAX_CHUNK_BYTES) to send as one
    chunk: up to its last line end; without one, all of it at a character boundary when the
    read was full or `final` (the line will not grow, or cannot wait), else nothing yet."""
    data = data[:MAX_CHUNK_BYTES]
    newline = data.rfind(b"\n")
    if newline >= 0 and not final:
        return data[:newline + 1]
    if final or len(data) == MAX_CHUNK_BYTES:
        kept = utf8_boundary(data)
        return data[:kept] if kept else data
    return b""


@dataclass
class _RankCursor:
    sent: int  # bytes of the log the control plane has (or that were dropped)
    dropped: int = 0  # bytes skipped since the last chunk was sent, not yet said
    last_size: int = -1  # the file's size at the previous poll (a partial line that did not grow goes)


@dataclass
class _Source:
    """One job directory (one attempt of a job on this node)."""

    job_dir: pathlib.Path
    job_id: int
    attempt: int
    cursors: dict[tuple[int, str], _RankCursor] = field(default_factory=dict)  # by (rank, stream)
    done: bool = False


class LogShipper:
    def __init__(self, jobs_dir, client, *, backlog_limit=DEFAULT_BACKLOG_LIMIT, poll_s=POLL_S,
                 launcher_alive=None, token_source=None):
        from agent.node import launcher_pid, pid_alive

        self.jobs_dir = pathlib.Path(jobs_dir)
        self.client = client
        self.backlog_limit = max(MAX_CHUNK_BYTES, int(backlog_limit))
        self.poll_s = poll_s
        self.sources: dict[pathlib.Path, _Source] = {}
        self.failures = 0
        self.dropped_total = 0
        self.token_source = token_source  # the heartbeat's client's token (it re-registers; this follows)
        self._launcher_alive = launcher_alive or (lambda job_dir: pid_alive(launcher_pid(job_dir)))
        self._launcher_pid = launcher_pid

    # --- bookkeeping ---------------------------------------------------------------------------
    def _source(self, job_dir: pathlib.Path) -> _Source | None:
        source = self.sources.get(job_dir)
        if source is not None:
            return source
        job_id, _, attempt = job_dir.name.partition(".")
        if not (job_id.isdigit() and attempt.isdigit()):
            return None
        source = _Source(job_dir=job_dir, job_id=int(job_id), attempt=int(attempt))
        try:
            saved = json.loads((job_dir / SHIPPED).read_text())
            source.done = bool(saved.get("done"))
            sent = saved.get("sent") or {}
            source.cursors = {_cursor_key(key): _RankCursor(sent=int(n)) for key, n in sent.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            pass
        self.sources[job_dir] = source
        return source

    def _save(self, source: _Source) -> None:
        payload = {"done": source.done,
                   "sent": {f"{rank}:{stream}": c.sent for (rank, stream), c in source.cursors.items()}}
        tmp = source.job_dir / f".{SHIPPED}.tmp"
        try:
            tmp.write_text(json.dumps(payload))
            os.replace(tmp, source.job_dir / SHIPPED)
        except OSError as exc:  # the job directory was collected: nothing left to ship
            log.debug("%s: %s", source.job_dir, exc)

    @staticmethod
    def _copy_meta(job_dir: pathlib.Path) -> tuple[int | None, str | None]:
        """(generation, log grant) of the copy, from agent.json; None for what it does not say."""
        try:
            meta = json.loads((job_dir / "agent.json").read_text())
            generation, grant = meta.get("generation"), meta.get("log_grant")
        except (OSError, ValueError, AttributeError):
            return None, None
        return (int(generation) if isinstance(generation, int) else None,
                grant if is_sha256(grant) else None)

    # --- reading -------------------------------------------------------------------------------
    def collect(self) -> tuple[list[LogChunk], dict]:
        """Returns the chunks to send now (at most one batch) and how to advance the cursors once
        they are acknowledged ({(job_dir, rank): new sent offset}). Marks finished directories."""
        chunks: list[LogChunk] = []
        advance: dict = {}
        size = 0
        try:
            job_dirs = sorted(p for p in self.jobs_dir.iterdir() if p.is_dir())
        except OSError:
            return chunks, advance
        for gone in set(self.sources) - set(job_dirs):  # collected by the agent (--job-dir-retention-days)
            del self.sources[gone]
        for job_dir in job_dirs:
            source = self._source(job_dir)
            if source is None or source.done:
                continue
            manifest = read_manifest(job_dir)
            # Read before the launcher's liveness, never after: the agent writes agent.json before it
            # starts the launcher and the pid just after (from its main thread, while this runs in
            # another), and a pid read after a liveness taken without it is a launcher "gone" that
            # never ran (found three times by the chaos soak: a new copy marked done before it ran,
            # none of its output ever shipped).
            recorded = self._launcher_pid(job_dir) is not None
            alive = self._launcher_alive(job_dir)
            if manifest is None:
                if not alive and recorded and (job_dir / "launcher.err").exists():
                    source.done = True  # the launcher ended before it started a rank
                    self._save(source)
                continue
            generation, grant = self._copy_meta(job_dir)
            complete = True
            for rank_log in manifest.ranks:
                key = (rank_log.rank, rank_log.stream)
                cursor = source.cursors.setdefault(key, _RankCursor(sent=rank_log.start))
                offset = advance.get((job_dir, key), cursor.sent)
                try:
                    file_size = os.stat(rank_log.path).st_size
                except OSError:
                    continue  # linked a moment ago, or collected: the manifest is rewritten at exit
                backlog = file_size - offset
                if backlog > self.backlog_limit:
                    skipped = backlog - self.backlog_limit
                    cursor.dropped += skipped
                    self.dropped_total += skipped
                    offset += skipped
                    cursor.sent = offset
                    log.warning("job %s rank %s %s: %d bytes dropped (the control plane was not reachable; at "
                                "most %d bytes per rank log are kept)", source.job_id, rank_log.rank, rank_log.stream,
                                skipped, self.backlog_limit)
                grew = file_size != cursor.last_size
                cursor.last_size = file_size
                while offset < file_size and len(chunks) < MAX_CHUNKS:
                    try:
                        with open(rank_log.path, "rb") as handle:
                            handle.seek(offset)
                            data = handle.read(MAX_CHUNK_BYTES)
                    except OSError:
                        break
                    piece = cut(data, final=not alive or not grew)
                    if not piece:
                        break
                    chunk = LogChunk(job_id=source.job_id, generation=generation, attempt=source.attempt,
                                     rank=rank_log.rank, stream=rank_log.stream, offset=offset, length=len(piece),
                                     text=piece.decode("utf-8", errors="replace"), dropped=cursor.dropped,
                                     grant=grant)
                    encoded = len(json.dumps(chunk.to_dict()))
                    if chunks and size + encoded > MAX_BATCH_BYTES:
                        break
                    size += encoded
                    chunks.append(chunk)
                    cursor.dropped = 0
                    offset += len(piece)
                    advance[(job_dir, key)] = offset
                if offset < file_size:
                    complete = False
            if complete and not alive and all((r.rank, r.stream) in source.cursors for r in manifest.ranks) \
                    and not any(key[0] == job_dir for key in advance):
                source.done = True
                self._save(source)
            if len(chunks) >= MAX_CHUNKS or size >= MAX_BATCH_BYTES:
                break
        return chunks, advance

    # --- sending -------------------------------------------------------------------------------
    def ship_once(self) -> int:
        """Sends one batch; returns the chunks the control plane took (0: nothing to send).
        Raises agent.client.ControlPlaneError when it could not be sent (the backlog stays)."""
        chunks, advance = self.collect()
        if not chunks:
            return 0
        if self.token_source is not None:
            self.client.token = self.token_source()
        dropped = {(c.job_id, c.attempt, (c.rank, c.stream)): c.dropped for c in chunks if c.dropped}
        try:
            answer = self.client.logs(LogBatch(chunks=tuple(chunks)))
        except Exception:
            # Not sent: the dropped counts must go with the next try.
            for (job_id, attempt, key), count in dropped.items():
                for source in self.sources.values():
                    if source.job_id == job_id and source.attempt == attempt:
                        source.cursors[key].dropped += count
            raise
        # A fence ends the copy it names (job, generation), not every copy of the job in the batch:
        # the tail of an older copy refused next to the current one must not silence the current one.
        fenced = {(r.job_id, r.generation) for r in answer.rejected if r.fence}
        sent_as = {(c.job_id, c.attempt): c.generation for c in chunks}  # the generation each copy said
        for rejection in answer.rejected:
            log.warning("control plane refused the logs of job %s (generation %s): %s", rejection.job_id,
                        rejection.generation, rejection.error)
        touched = set()
        for (job_dir, key), offset in advance.items():
            source = self.sources[job_dir]
            source.cursors[key].sent = offset
            touched.add(job_dir)
            generation = sent_as.get((source.job_id, source.attempt))
            # (job, None): a control plane that does not say which copy; a copy that did not say its
            # generation (agent.json unreadable for a moment) is not ended by a guess: it says it next time.
            if (source.job_id, None) in fenced or (generation is not None and (source.job_id, generation) in fenced):
                source.done = True
        for job_dir in touched:
            self._save(self.sources[job_dir])
        return answer.stored + answer.duplicates

    def run(self, stop_event: threading.Event) -> None:
        """The shipper's thread: ship, and back off (up to 10 s) while the control plane cannot be
        reached; never raises."""
        from agent.client import ControlPlaneError, backoff_delay

        while not stop_event.is_set():
            try:
                sent = self.ship_once()
                self.failures = 0
                wait = 0.0 if sent else self.poll_s
            except ControlPlaneError as exc:
                self.failures += 1
                wait = max(self.poll_s, backoff_delay(self.failures, base=0.5, cap=10.0))
                log.info("logs not sent (%s); next try in %.1f s", exc, wait)
            except Exception:  # noqa: BLE001 - a bug here must not end the agent
                log.exception("log shipping failed")
                wait = 5.0
            stop_event.wait(wait)

    def start(self, stop_event: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop_event,), daemon=True, name="log-shipper")
        thread.start()
        return thread


def ship_until_idle(shipper: LogShipper, *, timeout_s: float = 30.0) -> None:
    """Ships until there is nothing left to send (tests, a clean agent exit)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and shipper.ship_once():
        pass
