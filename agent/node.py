"""The reconciler of one real node: drives the runtime (meridian-run) toward the desired state.

Level-triggered: every heartbeat the agent reports what it observes (protocol.node.JobReport)
and receives what it should run (protocol.node.DesiredJob entries); `reconcile(desired)` then
  1. stops (checkpoint at a consistent cut, then exit) every local job that is not desired here,
     is listed with action "stop" (the barrier of a move), or runs an older placement generation
     than the one desired;
  2. resizes a running job whose desired device count differs (replica splicing), telling the
     launcher the node-local device indices too;
  3. launches desired jobs that are not running, once no stop is in progress on the node,
     restoring the newest checkpoint of the job's store when it has one;
  4. checkpoints running jobs every `checkpoint_every_s`;
  5. removes a desired job's store folders of generations older than its newest accepted
     checkpoint's (prune_older_generations).
Slow control calls (stop, checkpoint, resize) run in a thread per job, one at a time per job,
so the heartbeat never blocks on a barrier.

Everything needed to observe a job is on disk, in its job directory under <work dir>/j/:
launcher.json (pid), progress.json (step), events.jsonl (cuts, checkpoints, restores,
stopped/finished/failed), agent.json (the placement generation it runs), control.sock. A
restarted agent re-adopts the launchers still running there.

Fencing: every copy runs one placement generation (the desired state's `generation`, written to
agent.json and given to the launcher as MERIDIAN_GENERATION) and reports it. When the control
plane rejects a report with "fence" (the job was restarted elsewhere after this node was lost),
or when the agent could not heartbeat for longer than the lost-node threshold, `fence()` kills
the copy without a checkpoint: the control plane has restarted it from its last checkpoint, and
a stale copy must not write one over the new copy's.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

from agent import bundles
from agent import sandbox as job_sandbox
from protocol import ProtocolError
from protocol.launch import (
    CheckpointTaken,
    Failed,
    Finished,
    LaunchEvent,
    Progress,
    Resized,
    Restored,
    Started,
    StateApplied,
    event_line,
    parse_events,
)
from protocol.node import MAX_ERROR, CheckpointReport, CutReport, DesiredJob, JobReport, RestoreReport
from protocol.states import FINAL_COPY_STATES, CopyState, CutAction, DesiredAction, LaunchState, ResumeRefused
from runtime import fence, multihost, splice
from runtime import rank as rank_liveness
from runtime.control import JobControl, JobControlError
from runtime.spool import write_json_atomic

log = logging.getLogger("agent.node")
ROOT = pathlib.Path(__file__).resolve().parent.parent
# the launcher's final events (events.jsonl) -> the state of the copy they leave
TERMINAL_EVENTS = {"finished": CopyState.FINISHED, "stopped": CopyState.STOPPED, "failed": CopyState.FAILED}
# Written in a copy's job folder once the control plane accepted its outcome (forget_reported).
REPORTED_FILE = "reported.json"


def read_json(path, default=None):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return default


def read_launch_events(job_dir) -> list[LaunchEvent]:
    """Returns the launcher's events of `job_dir` (events.jsonl), oldest first; [] without a log.
    A torn last line (the launcher is writing it) and records this side does not know are skipped."""
    try:
        text = (pathlib.Path(job_dir) / "events.jsonl").read_text()
    except OSError:
        return []
    return parse_events(text)


def read_progress(job_dir) -> Progress | None:
    """Returns the launcher's progress.json of `job_dir`, or None when there is none yet (or it is
    not a Progress: a launcher of another kind)."""
    try:
        return Progress.from_dict(read_json(pathlib.Path(job_dir) / "progress.json"))
    except ProtocolError:
        return None


def pid_alive(pid):
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as dead
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


class RestoreRefused(ValueError):
    """A checkpoint the desired state names cannot be restored: not a committed checkpoint this node
    can see, or its manifest is not the one the control plane recorded. Nothing of it is loaded."""


def seed_store(store, checkpoint_uri, manifest_sha256):
    """Puts the committed checkpoint `checkpoint_uri` into the (new) store folder `store`, under its
    own name, unless it is there already; returns its path there.

    `manifest_sha256` is the digest of its MANIFEST.json the control plane recorded when the copy
    that wrote it reported it (DesiredJob.restore_sha256): the source's manifest and the seeded
    copy's must both have it, else RestoreRefused says why and nothing is restored (the launcher
    checks it once more, with every file, before loading: --restore-manifest-sha256). A symlinked
    checkpoint folder is refused too.

    Each placement generation has a store folder of its own, so a fenced copy of an older
    generation can never write a checkpoint where the new copy restores from; the new copy starts
    from the checkpoint the control plane accepted. Files are hard-linked (no copy, and pruning
    either store only unlinks its own names), or copied across filesystems; the folder appears
    under its final name at once (rename), as the store's own commits do.
    """
    import uuid

    from runtime.store import CHECKPOINT_DIR_PATTERN, MANIFEST_NAME, CheckpointError, path_from_uri, read_manifest
    from runtime.store import manifest_sha256 as digest_of

    if not manifest_sha256:
        raise RestoreRefused(f"the control plane recorded no manifest digest for {checkpoint_uri}; "
                             "refusing to restore a checkpoint nobody can vouch for")
    source = path_from_uri(checkpoint_uri)
    if not CHECKPOINT_DIR_PATTERN.match(source.name) or source.is_symlink() or not (source / MANIFEST_NAME).is_file():
        raise RestoreRefused(f"{checkpoint_uri} is not a committed checkpoint this node can see")

    def check(folder):
        try:
            found = digest_of(folder)
        except CheckpointError as exc:
            raise RestoreRefused(str(exc)) from None
        if found != manifest_sha256:
            raise RestoreRefused(f"the manifest of {folder} has sha256 {found[:16]}…, the control plane recorded "
                                 f"{manifest_sha256[:16]}…; refusing to restore it")

    check(source)
    # A CRIU checkpoint whose pages are stored against a base (runtime/criu_pages.py) needs that
    # base beside it: each base its manifest pins (by manifest digest, so the control plane's one
    # digest vouches for it) is seeded first, the same way.
    try:
        bases = read_manifest(source).get("bases") or []
    except CheckpointError as exc:
        raise RestoreRefused(str(exc)) from None
    for base in bases:
        name = base.get("name") if isinstance(base, dict) else None
        digest = base.get("manifest_sha256") if isinstance(base, dict) else None
        if not isinstance(name, str) or not CHECKPOINT_DIR_PATTERN.match(name) or not isinstance(digest, str):
            raise RestoreRefused(f"{checkpoint_uri} names a bad base checkpoint {base!r}; refusing to restore it")
        seed_store(store, str(source.parent / name), digest)
    target = pathlib.Path(store) / source.name
    if target.exists():
        check(target)
        return target
    staging = pathlib.Path(store) / f".seed-{uuid.uuid4().hex}"

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    try:
        shutil.copytree(source, staging, copy_function=link_or_copy)
        check(staging)  # what was copied is what will be restored
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            check(target)  # another host of the same job seeded the shared store first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def checkpoint_manifest_sha256(checkpoint_uri) -> str | None:
    """Returns the sha256 of the MANIFEST.json the runtime wrote into the committed checkpoint
    `checkpoint_uri`, or None when it cannot be read (reported without one: the control plane
    then refuses that checkpoint)."""
    from runtime.store import CheckpointError, manifest_sha256, path_from_uri

    try:
        return manifest_sha256(path_from_uri(checkpoint_uri))
    except (CheckpointError, OSError, ValueError) as exc:
        log.warning("cannot read the manifest of %s: %s", checkpoint_uri, exc)
        return None


def pin_accepted(job_dir, checkpoint_uri) -> bool:
    """Names `checkpoint_uri`, the newest checkpoint the control plane accepted of a job, in the
    folder `job_dir` of its local copy (runtime.store.ACCEPTED_FILE, written atomically): the
    launcher's store never prunes it, nor what is newer (a copy cut off from this agent commits on
    until it fences itself, and the control plane restores from the accepted one elsewhere).
    Returns whether it was written."""
    from runtime.store import ACCEPTED_FILE, CHECKPOINT_DIR_PATTERN, path_from_uri

    name = path_from_uri(checkpoint_uri).name
    if not CHECKPOINT_DIR_PATTERN.match(name):
        return False
    job_dir = pathlib.Path(job_dir)
    staging = job_dir / f".{ACCEPTED_FILE}.tmp"
    try:
        staging.write_text(name + "\n", encoding="utf-8")
        os.replace(staging, job_dir / ACCEPTED_FILE)
    except OSError as exc:  # the job folder gone (the copy ended meanwhile): nothing to keep
        log.warning("could not pin the accepted checkpoint %s in %s: %s", name, job_dir, exc)
        return False
    return True


GENERATION_DIR = re.compile(r"g(\d+)")


def prune_older_generations(store, checkpoint_uri):
    """Removes the job's store folders of generations older than the one holding
    `checkpoint_uri`, the newest checkpoint the control plane accepted; returns their paths.

    Every placement generation writes a folder of its own (seed_store), and the store's
    retention prunes only within one folder: without this, every preemption, migration and
    lost node would leave its generation's checkpoints on the shared store for good. What a
    future copy restores is the newest accepted checkpoint, or a newer one, never one in an
    older folder; a fenced copy of an older generation that still writes finds its folder gone
    and fails its commit, as it should. A URI outside this job's generation folders (a store
    without generations) removes nothing.
    """
    from runtime.store import path_from_uri

    store = pathlib.Path(store).absolute()
    job_folder = store.parent
    accepted = path_from_uri(checkpoint_uri).absolute().parent
    here, held = GENERATION_DIR.fullmatch(store.name), GENERATION_DIR.fullmatch(accepted.name)
    if not here or not held or accepted.parent != job_folder or int(held.group(1)) > int(here.group(1)):
        return []
    removed = []
    for folder in sorted(job_folder.iterdir()):
        older = GENERATION_DIR.fullmatch(folder.name)
        if older and int(older.group(1)) < int(held.group(1)) and folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("removed the store folders of older generations: %s (the accepted checkpoint is in %s)",
                 ", ".join(f.name for f in removed), accepted.name)
    return removed


def remove_job_store(store, job_id):
    """Removes the checkpoint store of a job that finished or was cancelled (its folder
    `job-<id>` with every generation, or `store` itself when it has no generation folders);
    returns what it removed.

    Such a job is never resumed (a finished job's result is what the script wrote), and CRIU
    images hold whole processes: a small job leaves about a gigabyte."""
    store = pathlib.Path(store).absolute()
    target = store.parent if (GENERATION_DIR.fullmatch(store.name)
                              and store.parent.name == f"job-{int(job_id)}") else store
    if not target.exists():
        return None
    shutil.rmtree(target, ignore_errors=True)
    log.info("job %s: removed its checkpoint store %s", job_id, target)
    return target


def _in_background(name, function, *args):
    """Runs function(*args) in a daemon thread, logging what it could not do (deleting a large
    store takes a while: never on the heartbeat's thread)."""
    def run():
        try:
            function(*args)
        except (OSError, ValueError) as exc:
            log.warning("%s: %s", name, exc)

    threading.Thread(target=run, daemon=True, name=name).start()


def next_attempt(jobs_dir, job_id):
    """Returns the number of job `job_id`'s next attempt on this node: one past the highest of
    its job directories <jobs_dir>/<job_id>.<attempt> (old ones may have been collected)."""
    attempts = [int(p.suffix[1:]) for p in pathlib.Path(jobs_dir).glob(f"{int(job_id)}.*") if p.suffix[1:].isdigit()]
    return 1 + max(attempts, default=0)


def launcher_processes(jobs_dir) -> dict[pathlib.Path, tuple[int, str | None]]:
    """Returns {job dir: (pid, its --job-id)} of every live meridian-run whose --job-dir is a folder
    of `jobs_dir`, read from /proc by command line: the only trace of a launcher started by an agent
    that died before it recorded the pid (agent.json), or before the launcher wrote launcher.json
    (after its rendezvous, which may take minutes on several hosts)."""
    jobs_dir = pathlib.Path(jobs_dir).absolute()
    found = {}
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            raw = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"runtime.launcher" not in raw or b"--job-dir" not in raw:
            continue
        argv = [a.decode(errors="replace") for a in raw]
        try:
            job_dir = pathlib.Path(argv[argv.index("--job-dir") + 1])
            launcher_id = argv[argv.index("--job-id") + 1] if "--job-id" in argv else None
        except IndexError:
            continue
        if job_dir.parent == jobs_dir and pid_alive(int(proc.name)):
            found[job_dir] = (int(proc.name), launcher_id)
    return found


def shared_launcher_id(entry: DesiredJob) -> str | None:
    """The meridian-run --job-id of `entry`'s copy when it is the same for every attempt on a node
    (a job that spans hosts: one spool per generation, so two launchers of it on one node would
    share it), else None (a one-host copy's id names its attempt and agent)."""
    return f"j{entry.job_id}-g{entry.generation or 0}" if entry.span is not None else None


def launcher_pid(job_dir):
    """Returns the pid of the launcher that ran in `job_dir` (launcher.json, or agent.json
    before the launcher wrote its own), or None."""
    job_dir = pathlib.Path(job_dir)
    info = read_json(job_dir / "launcher.json") or read_json(job_dir / "agent.json") or {}
    return info.get("pid")


class LocalJob:
    """One launcher this agent started or adopted."""

    def __init__(self, job_id, job_dir, *, popen=None, pid=None, devices=0, world_size=0, generation=None,
                 store=None, device_indices: Iterable[int] = (), log_grant=None):
        self.job_id = int(job_id)
        self.generation = generation
        self.log_grant = log_grant  # DesiredJob.log_grant: the log shipper sends it with this copy's output
        self.store = pathlib.Path(store) if store else None  # its checkpoint store folder, when known
        self.job_dir = pathlib.Path(job_dir)
        self.popen = popen
        self.pid = pid or (popen.pid if popen else None)
        self.devices = devices
        self.device_indices = tuple(device_indices)  # the node-local devices it was given, when known
        self.world_size = world_size
        self.control = JobControl(self.job_dir)
        self.busy = None  # name of the control call in flight ("stop", "checkpoint", "resize")
        self.stop_requested = False
        self.last_checkpoint_at = time.monotonic()
        self.error = None
        self.reported_state: CopyState | None = None
        self.manifest_digests: dict[str, str] = {}  # checkpoint URI -> sha256 of its MANIFEST.json
        self.unreadable: set[str] = set()  # checkpoint URIs whose manifest could not be read (warned once)
        self.pinned: str | None = None  # the accepted checkpoint last named in its folder (pin_accepted)
        # A follower host's share of a job that spans hosts: the leader's launcher cuts, stops and
        # checkpoints every host's ranks; this one's launcher ends with them.
        self.follower = False

    def _events(self, events: list[LaunchEvent] | None) -> list[LaunchEvent]:
        """Returns `events` when the caller read them already, else this copy's events.jsonl."""
        return read_launch_events(self.job_dir) if events is None else events

    def alive(self):
        # Popen.poll() also answers None while another thread is in a wait() on the same process
        # (it cannot take the waitpid lock): the kernel's word (pid_alive: gone, or a zombie) decides
        # then. CI saw a launcher that had exited and fenced itself taken for a live one.
        if self.popen is not None and self.popen.poll() is not None:
            return False
        return pid_alive(self.pid)

    def outcome(self, events: list[LaunchEvent] | None = None):
        """Returns None while running, else "finished" / "stopped" / "failed"."""
        if self.alive():
            return None
        for event in reversed(self._events(events)):
            if event.event in TERMINAL_EVENTS:
                return TERMINAL_EVENTS[event.event]
        return "failed"

    def last_checkpoint(self, events: list[LaunchEvent] | None = None) -> CheckpointReport | None:
        """Returns the newest checkpoint the launcher wrote (its checkpoint events) whose manifest
        this node can read, or None.

        One it cannot read (its folder was removed, the store is unreachable) is left out, with a
        warning, and the one before it is reported instead: the control plane refuses a checkpoint
        without its manifest's sha256, and with it the whole report, at every beat (a finished
        copy's end was never heard); a checkpoint without its manifest cannot be restored anyway."""
        for event in reversed(self._events(events)):
            if isinstance(event, CheckpointTaken) and event.checkpoint:
                digest = self.manifest_digests.get(event.checkpoint)
                if digest is None:
                    digest = checkpoint_manifest_sha256(event.checkpoint)
                    if digest is None:
                        if event.checkpoint not in self.unreadable:
                            self.unreadable.add(event.checkpoint)
                            log.warning("job %s: the manifest of checkpoint %s cannot be read; it is left out of "
                                        "the reports", self.job_id, event.checkpoint)
                        continue
                    # A committed manifest never changes: hashed once (the newest few kept).
                    self.manifest_digests = dict([*list(self.manifest_digests.items())[-3:],
                                                  (event.checkpoint, digest)])
                return CheckpointReport(step=event.step, uri=event.checkpoint, bytes=event.bytes,
                                        engine=event.engine or "framework", sha256=digest,
                                        left_out=event.left_out, seconds=event.seconds,
                                        device_bytes=event.device_bytes)
        return None

    def last_cut(self, events: list[LaunchEvent] | None = None) -> CutReport | None:
        """Returns the newest consistent cut the launcher took (its checkpoint and resize events), or None."""
        for event in reversed(self._events(events)):
            if isinstance(event, CheckpointTaken):
                return CutReport(action=CutAction(event.action), step=event.step, kind=event.cut_kind)
            if isinstance(event, Resized):
                return CutReport(action=CutAction.RESIZE, step=event.step, devices=event.devices)
        return None

    def sandbox(self, events: list[LaunchEvent] | None = None) -> str | None:
        """Returns how this copy's launcher confined its ranks (its started or restored event)."""
        for event in reversed(self._events(events)):
            if isinstance(event, (Started, Restored)) and event.sandbox:
                return event.sandbox
        return None

    def restored_step(self, events: list[LaunchEvent] | None = None):
        for event in self._events(events):
            if isinstance(event, Restored):
                return event.step
        return None

    def restore(self, events: list[LaunchEvent] | None = None, *, live: bool) -> RestoreReport | None:
        """Returns how this copy was restored (its launcher's Restored event, and for the framework
        engine its StateApplied), or None: not restored, or the framework ranks of a live copy have
        not put their state back yet (reported once they have: the event is written once)."""
        events = self._events(events)
        restored = next((e for e in events if isinstance(e, Restored)), None)
        if restored is None:
            return None
        applied = next((e for e in events if isinstance(e, StateApplied)), None)
        if applied is None and restored.engine == "framework" and live:
            return None
        return RestoreReport(step=restored.step, engine=restored.engine, seconds=restored.seconds,
                             device_in=restored.device_in,
                             load_s=applied.load_s if applied else None, apply_s=applied.apply_s if applied else None,
                             device_bytes=applied.device_bytes if applied else None)

    def restarted(self, events: list[LaunchEvent] | None = None) -> str | None:
        """Returns why the launcher started the script again from scratch after its resume was
        refused (a started event after the restored one: runtime.launcher's resume_refused, under
        --if-resume-refused restart), or None."""
        restored = False
        for event in self._events(events):
            if isinstance(event, Restored):
                restored = True
            elif isinstance(event, Started) and restored:
                return event.reason
        return None

    def observed(self) -> JobReport:
        """Returns the report on this copy: its state, progress, newest checkpoint and cut."""
        progress = read_progress(self.job_dir)
        events = read_launch_events(self.job_dir)  # once per report: every part below reads them
        outcome = self.outcome(events)
        state = CopyState(outcome) if outcome else (
            CopyState.RUNNING if progress is not None and progress.state == LaunchState.RUNNING else CopyState.STARTING)
        failed = state == CopyState.FAILED
        return JobReport(
            job_id=self.job_id, state=state, generation=self.generation,
            step=progress.step if progress else None, steps_per_s=progress.steps_per_s if progress else None,
            devices=(progress.devices if progress else None) or self.devices,
            engine=progress.engine if progress else None,
            checkpoint=self.last_checkpoint(events), cut=self.last_cut(events),
            restored_step=self.restored_step(events), sandbox=self.sandbox(events), restarted=self.restarted(events),
            restore=self.restore(events, live=state in (CopyState.STARTING, CopyState.RUNNING)),
            note=next((e.note for e in events if isinstance(e, Finished) and e.note), None)
            if state == CopyState.FINISHED else None,
            engine_reason=((progress.engine_reason or "")[:MAX_ERROR] or None) if progress else None,
            error=(self.error or self.failure_text(events))[:MAX_ERROR] if failed else None,
            exit_code=(self.popen.returncode if self.popen is not None else None) if failed else None,
            host_failure=failed and not self.error and self.host_failure(events))

    def host_failure(self, events: list[LaunchEvent] | None = None) -> bool:
        """True when the launcher's last word is that a host of the job failed under it (its failed
        event's host_failure): restarted from its checkpoint, not failed (jobs.workflows)."""
        last = next((e for e in reversed(self._events(events)) if e.event in TERMINAL_EVENTS), None)
        return isinstance(last, Failed) and last.host_failure

    def failure_text(self, events: list[LaunchEvent] | None = None):
        for event in reversed(self._events(events)):
            if isinstance(event, Failed):
                return event.error[:2000]
        try:
            tail = (self.job_dir / "launcher.err").read_text(errors="replace")[-2000:]
        except OSError:
            tail = ""
        return "the launcher exited without saying why" + (f":\n{tail}" if tail else "")


class NodeReconciler:
    def __init__(self, work_dir, *, engine="auto", checkpoint_every_s=60.0, workload_root=None,
                 python=sys.executable, keep_finished_checkpoints=False, workspace_root=None, bundle_fetcher=None,
                 sandbox: job_sandbox.NodeSandbox | None = None, node_addr="127.0.0.1"):
        self.work_dir = pathlib.Path(work_dir).absolute()
        self.node_addr = node_addr  # this host's address for the other hosts of a job that spans hosts
        # How jobs are confined (agent/sandbox.py); a reconciler made without one (tests of other
        # parts) runs them unconfined, saying so, with their own environment only.
        self.sandbox = sandbox or job_sandbox.NodeSandbox(job_sandbox.SandboxPolicy(mode="off"),
                                                          work_dir=self.work_dir, node_devices=None, python=python)
        self.jobs_dir = self.work_dir / "j"
        # The instant this node's jobs fence themselves if the agent is silent (runtime/fence.py):
        # written by the agent after every answered beat, read by every launcher it starts.
        self.fence_file = self.work_dir / fence.FENCE_FILE
        self.spool_root = self.work_dir / "spool"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.spool_root.mkdir(parents=True, exist_ok=True)
        self.sandbox.layout()
        self.engine = engine
        self.checkpoint_every_s = checkpoint_every_s
        self.workload_root = pathlib.Path(workload_root or os.getcwd()).absolute()
        # Each job's workspace (agent/bundles.py): the same root on every node; bundle_fetcher(sha256) -> archive
        # runs in the background, and a job waiting for its bundle is reported with why (self.waiting).
        self.workspace_root = pathlib.Path(workspace_root or os.environ.get(bundles.WORKSPACE_ROOT_ENV)
                                           or self.work_dir / "workspaces").absolute()
        self.bundle_fetches = bundles.BackgroundFetches(bundle_fetcher) if bundle_fetcher else None
        self.waiting: dict[int, JobReport] = {}  # job id -> the report of a launch that waits, saying why
        self.python = python
        self.keep_finished_checkpoints = keep_finished_checkpoints
        self.jobs: dict[int, LocalJob] = {}
        self.lock = threading.Lock()
        self.pruned: dict[int, str] = {}  # job id -> the accepted checkpoint its store was pruned for
        # job id -> the generation whose copy ended here (finished or failed, accepted): never launched
        # again. A follower host of a job that spans hosts ends (and is forgotten) before the leader
        # has reported the job's end, while its desired state still lists the job: found by the chaos
        # soak, it relaunched the finished job's share and recreated its removed store folder.
        self.ended: dict[int, int] = {}
        self.adopt()

    # --- adoption ------------------------------------------------------------------------------
    def adopt(self):
        """Re-adopts launchers still running in job dirs (after an agent restart), and the newest
        copy of a job that ended while this agent was down, unreported: its outcome (and its last
        checkpoint) is reported as if the agent had watched it end (the chaos soak saw such a job
        fail instead). A copy whose outcome the control plane accepted (REPORTED_FILE) is not
        reported again; its generation is remembered as ended, so it is not launched again."""
        newest: dict[int, tuple[int, pathlib.Path]] = {}
        running = launcher_processes(self.jobs_dir)
        for job_dir in sorted(self.jobs_dir.iterdir()):
            job_id, _, attempt = job_dir.name.partition(".")
            if job_id.isdigit() and attempt.isdigit() and job_dir.is_dir() and not job_dir.is_symlink() \
                    and int(attempt) > newest.get(int(job_id), (0, job_dir))[0]:
                newest[int(job_id)] = (int(attempt), job_dir)
            pid = launcher_pid(job_dir)
            if not pid_alive(pid):
                # An agent killed between starting the launcher and recording its pid: the launcher
                # runs on all the same (left alone, it ran beside a second copy of the job).
                pid = running.get(job_dir.absolute(), (None, None))[0]
            if not pid_alive(pid):
                continue
            meta = read_json(job_dir / "agent.json") or {}
            job_id = int(meta.get("job_id", job_dir.name.split(".")[0]))
            self.jobs[job_id] = self._local_job(job_dir, meta, pid)
            if meta and meta.get("pid") != pid and not (job_dir / "launcher.json").exists():
                self._write_meta(self.jobs[job_id])  # the pid found by command line, for every reader
            log.info("re-adopted job %s (pid %s) in %s", job_id, pid, job_dir)
        for job_id, (_, job_dir) in newest.items():
            meta = read_json(job_dir / "agent.json") or {}
            if job_id in self.jobs or not meta or (job_dir / fence.FENCED_FILE).exists():
                continue
            reported = read_json(job_dir / REPORTED_FILE)
            if isinstance(reported, dict):
                if reported.get("state") in (CopyState.FINISHED, CopyState.FAILED) \
                        and isinstance(meta.get("generation"), int):
                    self.ended[job_id] = meta["generation"]
                continue
            if not any(event.event in TERMINAL_EVENTS for event in read_launch_events(job_dir)):
                continue  # killed without an end (with its node, say): nothing it could say is known
            self.jobs[job_id] = job = self._local_job(job_dir, meta, launcher_pid(job_dir))
            log.info("job %s ended while this agent was down (%s, in %s): reporting it", job_id, job.outcome(),
                     job_dir)

    @staticmethod
    def _local_job(job_dir, meta, pid):
        job = LocalJob(int(meta.get("job_id", job_dir.name.split(".")[0])), job_dir, pid=pid,
                       devices=meta.get("devices", 0), world_size=meta.get("world_size", 0),
                       generation=meta.get("generation"), store=meta.get("store"),
                       device_indices=meta.get("device_indices") or (), log_grant=meta.get("log_grant"))
        job.follower = meta.get("follower") is True
        return job

    def collect_old_job_dirs(self, *, older_than_s, now=None):
        """Removes the job directories (launcher logs and events) of attempts this agent no
        longer tracks, whose launcher is gone and that nothing touched for `older_than_s`;
        returns their paths."""
        now = time.time() if now is None else now
        removed = []
        with self.lock:
            tracked = {job.job_dir for job in self.jobs.values()}
            for job_dir in sorted(self.jobs_dir.iterdir()):
                if job_dir in tracked or not job_dir.is_dir() or job_dir.is_symlink():
                    continue
                if pid_alive(launcher_pid(job_dir)):
                    continue
                try:
                    touched = max(p.stat().st_mtime for p in [job_dir, *job_dir.iterdir()])
                except OSError:
                    continue
                if now - touched > older_than_s:
                    shutil.rmtree(job_dir, ignore_errors=True)
                    removed.append(job_dir)
        if removed:
            log.info("removed %d job directories untouched for more than %.0f s", len(removed), older_than_s)
        return removed

    # --- observation ---------------------------------------------------------------------------
    def observed(self) -> list[JobReport]:
        """Returns a report on every local copy. A report the control plane would refuse (a
        launcher that wrote something out of bounds) goes with its state only, so one odd value
        never blocks the node's heartbeats."""
        with self.lock:
            for job_id, job in list(self.jobs.items()):
                # A copy whose launcher fenced itself while this agent was silent (frozen: it could
                # not fence it): forgotten like one the agent fenced, never reported as failed; the
                # job is launched anew here if the control plane still wants it here.
                if (job.job_dir / fence.FENCED_FILE).exists() and not job.alive():
                    del self.jobs[job_id]
                    self.pruned.pop(job_id, None)
                    log.warning("job %s fenced itself while this agent was silent: %s", job_id,
                                (job.job_dir / fence.FENCED_FILE).read_text(errors="replace")[:300])
            reports = [_checked(job.observed()) for job in self.jobs.values()]
            for report in reports:
                self.jobs[report.job_id].reported_state = report.state
            # Jobs whose launch waits (for their code): a copy that is starting, and why.
            reports += [report for job_id, report in self.waiting.items() if job_id not in self.jobs]
            return reports

    def busy_device_indices(self, desired_jobs: Iterable[DesiredJob]) -> list[int]:
        return sorted({i for entry in desired_jobs for i in entry.device_indices if entry.job_id in self.jobs})

    def forget_reported(self, accepted_ids):
        """Drops jobs whose final state the control plane has accepted."""
        with self.lock:
            for job_id in list(self.jobs):
                job = self.jobs[job_id]
                # Only an outcome the control plane has seen: a job that ended after this report
                # was built is still "running" there, and must be reported once more.
                if job_id in accepted_ids and job.reported_state in FINAL_COPY_STATES and job.busy is None:
                    del self.jobs[job_id]
                    try:  # a restarted agent neither reports it again nor relaunches its generation (adopt)
                        write_json_atomic(job.job_dir / REPORTED_FILE, {"state": str(job.reported_state)})
                    except OSError:
                        pass
                    _remove_cgroup_soon(job.job_dir)
                    self.pruned.pop(job_id, None)
                    # A follower host's share ending is not the job's end (the leader speaks for it):
                    # its store goes once the leader's outcome is accepted (the 30-minute soak saw a
                    # follower remove it while the leader's report of the end was still to come).
                    if job.reported_state == CopyState.FINISHED and not self.keep_finished_checkpoints \
                            and not job.follower:
                        self._remove_store_soon(job)
                    if job.reported_state in (CopyState.FINISHED, CopyState.FAILED):
                        bundles.remove_workspace(self.workspace_root, job_id)  # saved as its outputs at the end
                        if job.generation is not None:
                            self.ended[job_id] = int(job.generation)

    # --- reconcile ------------------------------------------------------------------------------
    @staticmethod
    def _outdated(job, entry: DesiredJob | None) -> bool:
        """True when `job` (a local copy) is not what `entry` (its desired entry, or None) wants
        to run: not listed, listed with "stop", or listed with a newer generation."""
        if entry is None or entry.action == DesiredAction.STOP:
            return True
        wanted = entry.generation
        return wanted is not None and job.generation is not None and wanted != int(job.generation)

    def reconcile(self, desired_jobs: Iterable[DesiredJob | dict]) -> None:
        """Drives the local copies toward `desired_jobs` (the desired state's entries; a wire
        dict is decoded first). See the module docstring for the order."""
        entries = [e if isinstance(e, DesiredJob) else DesiredJob.from_dict(e) for e in desired_jobs]
        desired = {e.job_id: e for e in entries}
        with self.lock:
            for job_id in [j for j in self.ended if j not in desired]:
                del self.ended[job_id]  # no longer listed: its end needs remembering no more
            for job_id in list(self.waiting):  # waits no more: launched, or not wanted here now
                if job_id in self.jobs or job_id not in desired or desired[job_id].action != DesiredAction.RUN:
                    self.waiting.pop(job_id, None)
            for job_id, existing in list(self.jobs.items()):
                if existing.outcome() is not None:
                    continue
                if self._outdated(existing, desired.get(job_id)) and not existing.stop_requested \
                        and existing.busy is None:
                    self._call(existing, "stop")
            stopping = any(j.stop_requested and j.outcome() is None for j in self.jobs.values())
            for job_id, entry in desired.items():
                job = self.jobs.get(job_id)
                if entry.action != DesiredAction.RUN:
                    continue
                self._prune_store(entry)
                if job is not None and job.outcome() is None and not self._outdated(job, entry) \
                        and entry.restore_from and job.pinned != entry.restore_from \
                        and pin_accepted(job.job_dir, entry.restore_from):
                    job.pinned = entry.restore_from
                if job is not None and job.outcome() is None:
                    if job.stop_requested or not (job.job_dir / "control.sock").exists():
                        continue  # stopping, or its launcher is not serving commands yet
                    if job.follower:
                        continue  # the leader's launcher cuts and checkpoints every host's ranks
                    if entry.devices != job.devices and job.busy is None and entry.span is None:
                        self._call(job, "resize", entry.devices, entry.device_indices)
                    elif (job.busy is None and self.checkpoint_every_s > 0
                          and time.monotonic() - job.last_checkpoint_at > self.checkpoint_every_s):
                        self._call(job, "checkpoint")
                    continue
                if job is not None and job.outcome() in (CopyState.FINISHED, CopyState.FAILED):
                    continue  # its outcome is reported (and forgotten once accepted) before anything else
                if job is not None and job.outcome() == CopyState.STOPPED and self._outdated(job, entry) \
                        and job.reported_state != CopyState.STOPPED:
                    continue  # an older copy's stop is reported before the new copy starts
                if stopping:
                    continue  # its devices may still be held by a job that is stopping
                if job is None and entry.generation is not None and self.ended.get(job_id) == entry.generation:
                    continue  # this generation's copy ended here; a new placement comes as a new generation
                self.launch(entry)

    def _prune_store(self, entry: DesiredJob) -> None:
        """Removes the store folders of generations older than the accepted checkpoint's (in a
        thread: a large store takes a while to delete), once per accepted checkpoint."""
        job_id, accepted = entry.job_id, entry.restore_from
        if not accepted or not entry.store or self.pruned.get(job_id) == accepted:
            return
        self.pruned[job_id] = accepted
        _in_background(f"job{job_id}-prune", prune_older_generations, entry.store, accepted)

    @staticmethod
    def _remove_store_soon(job):
        if job.store:
            _in_background(f"job{job.job_id}-remove-store", remove_job_store, job.store, job.job_id)

    def fence(self, job_ids=None, *, why="", remove_store=False):
        """Kills the copies of `job_ids` (all when None) without a checkpoint and forgets them;
        returns the job ids killed. For a copy the control plane has replaced (its report was
        rejected with "fence"), or every copy when this node could not heartbeat for longer than
        the lost-node threshold (it has been restarted elsewhere from its last checkpoint); with
        `remove_store`, for a cancelled job, whose checkpoint store goes too."""
        killed = []
        with self.lock:
            for job_id in list(self.jobs):
                if job_ids is not None and job_id not in job_ids:
                    continue
                job = self.jobs.pop(job_id)
                self.pruned.pop(job_id, None)
                if job.alive():
                    self._kill(job)
                    killed.append(job_id)
                if remove_store:
                    self._remove_store_soon(job)
                try:
                    (job.job_dir / fence.FENCED_FILE).write_text(why or "fenced")
                except OSError:
                    pass
        if killed:
            log.warning("fenced job(s) %s: killed without a checkpoint (%s)", killed, why)
        return killed

    def _call(self, job, action, *args):
        if action == "stop" and job.follower:
            # Its launcher refuses commands (the leader's cut stops every host's ranks at one step,
            # and this launcher exits with them); if the leader is gone, the launcher ends on its own.
            job.stop_requested = True
            return
        job.busy = action
        if action == "stop":
            job.stop_requested = True

        def run():
            try:
                if action == "stop":
                    job.control.stop(timeout_s=300)
                elif action == "checkpoint":
                    job.control.checkpoint(timeout_s=300)
                elif action == "resize":
                    devices, device_indices = args
                    answer = job.control.resize(devices, device_indices=device_indices or None, timeout_s=300)
                    job.devices = int(answer["devices"])
                    job.device_indices = tuple(device_indices)
                    self._write_meta(job)
            except (JobControlError, OSError, ValueError) as exc:
                if job.alive():
                    log.warning("job %s: %s failed: %s", job.job_id, action, exc)
                if action == "stop" and job.alive():
                    job.stop_requested = False  # retried on the next reconcile
            finally:
                job.last_checkpoint_at = time.monotonic()
                job.busy = None

        threading.Thread(target=run, daemon=True, name=f"job{job.job_id}-{action}").start()

    def _write_meta(self, job):
        # Atomic: the log shipper reads the pid (launcher_pid) and the generation here while it is
        # rewritten (a resize); a torn file would read as "launcher gone".
        write_json_atomic(job.job_dir / "agent.json", {
            "job_id": job.job_id, "devices": job.devices, "world_size": job.world_size, "pid": job.pid,
            "generation": job.generation, "store": str(job.store) if job.store else None,
            "device_indices": list(job.device_indices), "follower": job.follower, "log_grant": job.log_grant})

    def launch_command(self, entry: DesiredJob, *, job_dir: pathlib.Path, attempt: int, store: pathlib.Path,
                       resume: bool, workspace: pathlib.Path | None = None) -> list[str]:
        """Returns the meridian-run command line of `entry`'s next attempt: straight onto the desired
        device count (W ranks spliced onto d devices from the start), on the node-local devices
        `device_indices` (--device-indices 0,2,5)."""
        entrypoint = pathlib.Path(entry.entrypoint)
        if entry.bundle and workspace is not None:
            entrypoint = workspace / entrypoint  # a path inside the bundle (checked at submission)
        elif not entrypoint.is_absolute():
            entrypoint = self.workload_root / entrypoint
        span = entry.span
        if span is not None:
            # One meridian-run per host (runtime/multihost.py); the job id is the same on every host
            # (its rendezvous folder is the generation's own), the device count the job's in all.
            command = [self.python, "-m", "runtime.launcher", "--ranks", str(entry.world_size),
                       "--devices", str(span.job_devices), "--engine", self.engine, "--job-dir", str(job_dir),
                       "--job-id", f"j{entry.job_id}-g{entry.generation or 0}", "--store", str(store),
                       "--nodes", str(span.nodes), "--node-rank", str(span.node_rank),
                       # this host's block of ranks: unequal when the hosts hold unequal device counts
                       "--first-rank", str(span.first_rank), "--host-ranks", str(span.ranks),
                       "--node-addr", self.node_addr, "--rendezvous", span.rendezvous]
        else:
            command = [self.python, "-m", "runtime.launcher", "--ranks", str(entry.world_size),
                       "--devices", str(entry.devices), "--engine", self.engine, "--job-dir", str(job_dir),
                       "--job-id", f"j{entry.job_id}-{attempt}-{os.getpid()}", "--store", str(store)]
        command += ["--fence-file", str(self.fence_file)]
        if entry.device_indices:
            # On several hosts, this host's own indices (its share of span.job_devices): the launcher
            # pins this host's ranks to the cores behind exactly them (CUDA_VISIBLE_DEVICES on a GPU node).
            if len(entry.device_indices) == entry.devices:
                command += ["--device-indices", ",".join(str(i) for i in entry.device_indices)]
            else:
                log.warning("job %s: %d device indices for %d devices; launching without them",
                            entry.job_id, len(entry.device_indices), entry.devices)
        if resume:
            command.append("--resume")
            if entry.restore_sha256:
                command += ["--restore-manifest-sha256", entry.restore_sha256]
        if entry.if_resume_refused == ResumeRefused.RESTART:
            # Also for a job spanning hosts: its launcher refuses to restart one host alone and fails
            # the job saying so, rather than the policy vanishing here unsaid.
            command += ["--if-resume-refused", str(ResumeRefused.RESTART)]
        if workspace is not None:
            command += bundles.launch_arguments(entry, workspace)
        command += ["--sandbox", str(job_dir / job_sandbox.SANDBOX_FILE)]
        return command + [str(entrypoint)] + [str(a) for a in entry.args]

    def launch(self, entry: DesiredJob) -> None:
        job_id = entry.job_id
        if entry.store is None:  # the control plane names a store for every job it runs
            log.error("job %s: the desired state names no store folder; not launching", job_id)
            return
        store = pathlib.Path(entry.store)
        store.mkdir(parents=True, exist_ok=True)
        if entry.restore_from:
            try:
                seed_store(store, entry.restore_from, entry.restore_sha256)
            except RestoreRefused as exc:
                # Never loaded, and never started afresh instead (that would silently lose the
                # job's progress): the copy fails, saying why.
                self._restore_refused(entry, store, str(exc))
                return
            except (OSError, ValueError) as exc:
                # The store may be unreachable for a moment: wait (the move's restore step times out
                # and the control plane decides again).
                log.error("job %s: cannot restore %s into %s: %s; not launching", job_id, entry.restore_from,
                          store, exc)
                return
        # Only what the control plane recorded is restored (pinned to its manifest digest): a
        # checkpoint in the store that it does not name is never resumed from.
        resume = bool(entry.restore_from)
        span_problem = multihost_span_problem(entry)
        if span_problem:
            self._launch_refused_new_attempt(entry, span_problem)
            return
        if self._previous_launcher_kept(entry):
            return
        try:
            workspace = bundles.workspace_for_launch(self, entry, resume=resume, fetches=self.bundle_fetches)
        except bundles.BundleRefused as exc:
            self.waiting.pop(job_id, None)
            self._launch_refused_new_attempt(entry, f"the job's code bundle cannot be had: {exc}")
            return
        if workspace is None:
            return
        attempt = next_attempt(self.jobs_dir, job_id)
        job_dir = self.jobs_dir / f"{job_id}.{attempt}"
        job_dir.mkdir(parents=True)
        generation = entry.generation
        pinned = entry.restore_from if entry.restore_from and pin_accepted(job_dir, entry.restore_from) else None
        if self._sandbox_uid_taken(job_id):
            return  # tried again at the next reconcile, once the other job is gone
        try:
            self.sandbox.prepare(job_id=job_id, job_dir=job_dir, device_indices=entry.device_indices,
                                 devices=entry.devices, env=entry.env, store=store, workspace=workspace,
                                 network=entry.network, span_nodes=entry.span.nodes if entry.span else 1)
        except (job_sandbox.SandboxError, OSError) as exc:
            self._launch_refused(entry, job_dir, f"the job's sandbox could not be set up on this node: {exc}")
            return
        command = self.launch_command(entry, job_dir=job_dir, attempt=attempt, store=store, resume=resume,
                                      workspace=workspace)
        # A clean environment: the agent's (its tokens, the control plane's settings) stays here. The
        # job's own environment reaches its ranks through sandbox.json, not through the launcher's.
        env = {"PATH": os.environ.get("PATH") or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "LANG": "C.UTF-8", "HOME": str(job_dir)}
        env["MERIDIAN_SPOOL_ROOT"] = str(self.spool_root)
        env["MERIDIAN_JOB_ID"] = str(job_id)
        if generation is not None:
            env["MERIDIAN_GENERATION"] = str(generation)
        env["PYTHONPATH"] = str(ROOT)
        job = LocalJob(job_id, job_dir, devices=entry.devices, world_size=entry.world_size,
                       generation=generation, store=store, device_indices=entry.device_indices,
                       log_grant=entry.log_grant)
        job.follower = entry.span is not None and entry.span.node_rank > 0
        job.pinned = pinned
        # Written before the launcher starts (its pid follows): an agent killed in between leaves a
        # job folder that says what runs there, and the restarted agent finds the launcher by its
        # command line (adopt).
        self._write_meta(job)
        with open(job_dir / "launcher.err", "wb") as err:
            # A session of its own: the job outlives an agent restart (and is re-adopted).
            job.popen = subprocess.Popen(command, cwd=str(self.workload_root), env=env, stdin=subprocess.DEVNULL,
                                         stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        job.pid = job.popen.pid
        self._write_meta(job)
        self.jobs[job_id] = job
        span = entry.span
        where = f" as host {span.node_rank} of {span.nodes} (leader {span.leader})" if span else ""
        log.info("job %s: launched %s on %s device(s)%s%s", job_id, pathlib.Path(entry.entrypoint).name, entry.devices,
                 where, " (restoring its newest checkpoint)" if resume else "")

    def _previous_launcher_kept(self, entry: DesiredJob) -> bool:
        """For a copy whose launcher id is the same at every attempt on this node (a job spanning
        hosts): returns True when a launcher of that id still runs here, so nothing is launched. One
        that is not fenced runs exactly this copy and is adopted; one that is ending (fenced, or only
        its spool lock is left, held by a dying launcher) is waited for, the copy reported as
        starting and why. Launched over it, the new launcher found the spool locked and failed the
        job (the chaos soak, after an agent's restart under a partition)."""
        launcher_id = shared_launcher_id(entry)
        if launcher_id is None:
            return False
        running = launcher_processes(self.jobs_dir)
        for job_dir, (pid, running_id) in sorted(running.items()):
            if running_id != launcher_id or not job_dir.name.startswith(f"{entry.job_id}."):
                continue
            meta = read_json(job_dir / "agent.json") or {}
            if (job_dir / fence.FENCED_FILE).exists() or meta.get("generation") != entry.generation:
                break  # ending: waited for below
            self.jobs[entry.job_id] = self._local_job(job_dir, meta, pid)
            self.waiting.pop(entry.job_id, None)
            log.warning("job %s: its launcher for generation %s (pid %s, in %s) runs on untracked: adopted, "
                        "not launched again", entry.job_id, entry.generation, pid, job_dir)
            return True
        lock = rank_liveness.launcher_lock_path(self.spool_root / launcher_id)
        if not rank_liveness.launcher_alive(self.spool_root / launcher_id) \
                and not any(i == launcher_id for _, i in running.values()):
            return False
        why = f"waiting for this node's previous launcher of generation {entry.generation} to end (it holds {lock})"
        if self.waiting.get(entry.job_id) is None or self.waiting[entry.job_id].waiting != why:
            log.warning("job %s: %s", entry.job_id, why)
        self.waiting[entry.job_id] = JobReport(job_id=entry.job_id, state=CopyState.STARTING,
                                               generation=entry.generation, waiting=why[:MAX_ERROR])
        return True

    def _sandbox_uid_taken(self, job_id) -> bool:
        """True (and logged) when another live job here runs as the uid job `job_id` would get (their
        ids differ by a multiple of the uid range): the two must never share one."""
        if not self.sandbox.enforced:
            return False
        uid = self.sandbox.identity(job_id).uid
        for other in self.jobs.values():
            spec = job_sandbox.spec_of(other.job_dir)
            if other.job_id != job_id and spec is not None and spec.uid == uid and other.alive():
                log.error("job %s: not launched while job %s, which has the same sandbox uid %d, runs here "
                          "(widen the uid range: --sandbox-uid-count)", job_id, other.job_id, uid)
                return True
        return False

    def _launch_refused_new_attempt(self, entry: DesiredJob, error: str) -> None:
        """_launch_refused in the job directory of a new attempt (nothing was prepared yet)."""
        job_dir = self.jobs_dir / f"{entry.job_id}.{next_attempt(self.jobs_dir, entry.job_id)}"
        job_dir.mkdir(parents=True)
        self._launch_refused(entry, job_dir, error)

    def _launch_refused(self, entry: DesiredJob, job_dir: pathlib.Path, error: str) -> None:
        """Records a launch that could not start as a failed copy (its error is the job's failure
        reason in the control plane), rather than retrying it for ever in silence."""
        log.error("job %s: %s", entry.job_id, error)
        with open(job_dir / "events.jsonl", "a") as handle:
            handle.write(event_line(Failed(time_unix=time.time(), error=error)))
        job = LocalJob(entry.job_id, job_dir, devices=entry.devices, world_size=entry.world_size,
                       generation=entry.generation, store=entry.store, device_indices=entry.device_indices,
                       log_grant=entry.log_grant)
        self._write_meta(job)
        self.jobs[entry.job_id] = job

    def _restore_refused(self, entry: DesiredJob, store: pathlib.Path, why: str) -> None:
        """Records a copy of `entry` that failed before it started: the checkpoint to restore was
        refused (RestoreRefused). Its job directory holds a "failed" event with the reason, so the
        next report says it (and the control plane fails the job, or ends its move)."""
        job_id = entry.job_id
        job_dir = self.jobs_dir / f"{job_id}.{next_attempt(self.jobs_dir, job_id)}"
        job_dir.mkdir(parents=True)
        error = f"restore refused: {why}"[:MAX_ERROR]
        (job_dir / "events.jsonl").write_text(event_line(Failed(time_unix=time.time(), error=error)))
        job = LocalJob(job_id, job_dir, devices=entry.devices, world_size=entry.world_size,
                       generation=entry.generation, store=store, device_indices=entry.device_indices,
                       log_grant=entry.log_grant)
        self._write_meta(job)
        self.jobs[job_id] = job
        log.error("job %s: %s; not launching", job_id, error)

    @staticmethod
    def _kill(job):
        """SIGKILLs the whole job at once through its cgroup (launcher, ranks, criu, whatever they
        forked), then the launcher and the ranks by pid (an unconfined job), and reaps the launcher."""
        import signal

        job_sandbox.kill_job(job.job_dir)
        progress = read_json(job.job_dir / "progress.json", {}) or {}
        for pid in [job.pid] + list(progress.get("rank_pids") or []):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, TypeError, ValueError):
                pass
        if job.popen is not None:
            job.popen.wait(timeout=10)
        job_sandbox.remove_private_dirs(job.job_dir)  # a killed launcher could not
        _remove_cgroup_soon(job.job_dir)

    def kill_all(self):
        """Kills every launcher and rank this agent runs (by pid): for an embedded run whose
        Ctrl-C must not leave training processes behind. A real node's agent leaves its jobs
        running instead, for the next agent to re-adopt."""
        with self.lock:
            for job in self.jobs.values():
                self._kill(job)


def multihost_span_problem(entry: DesiredJob) -> str | None:
    """Returns why `entry`'s share of a job that spans hosts cannot run as the launcher would run
    it, or None (it can, or one host). The launcher runs the span's block of ranks [first_rank,
    first_rank + ranks) on this host's devices, W/d ranks on each (d: the job's devices in all), so
    hosts may hold unequal shares (2 + 1 devices); what must hold is that the block is the one its
    devices run (ranks = W/d x this host's devices, starting at a device's edge) and lies inside
    the job's ranks in host order (runtime/multihost.host_block). Whether the hosts' blocks tile
    the job is checked where every block is known: by the job's leader, at its start."""
    span = entry.span
    if span is None:
        return None
    try:
        block = multihost.host_block(world_size=entry.world_size, nodes=span.nodes, node_rank=span.node_rank,
                                     first_rank=span.first_rank, ranks=span.ranks)
        devices = splice.host_devices(world_size=entry.world_size, devices=span.job_devices, ranks=block)
    except ValueError as exc:
        return f"the job spans {span.nodes} hosts but this host's share cannot run: {exc}"
    if len(devices) != entry.devices:
        return (f"this host holds {entry.devices} of the job's {span.job_devices} devices but ranks "
                f"{block.start}..{block.stop - 1}, which run on {len(devices)} of them "
                f"({entry.world_size // span.job_devices} ranks per device): its ranks are pinned to its own devices")
    return None


def _remove_cgroup_soon(job_dir, wait_s=2.0):
    """Removes the cgroup of the job that ran in `job_dir` once it is empty (its last zombies are
    reaped within moments); a cgroup still busy after `wait_s` is left for the next launch of the
    job, which reuses it."""
    deadline = time.monotonic() + wait_s
    while not job_sandbox.remove_cgroup(job_dir) and time.monotonic() < deadline:
        time.sleep(0.02)


def _checked(report: JobReport) -> JobReport:
    """Returns `report` when the control plane will accept its shape, else the same report with
    its state only (and logs what was wrong)."""
    try:
        return JobReport.from_dict(report.to_dict())
    except ProtocolError as exc:
        log.warning("job %s: its report is malformed (%s); reporting its state only", report.job_id, exc)
        return JobReport(job_id=report.job_id, state=report.state, generation=report.generation)
