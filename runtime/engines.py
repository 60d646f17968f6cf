"""The checkpoint engines behind one interface: how ranks start, cut, are dumped, released and restored.

An engine is chosen once per launch (`choose_engine`, from the registry `ENGINES`) or taken from
the checkpoint being resumed, and named in every event. The launcher calls, in this order:

    prepare()                         once, before any rank is started or restored
    spawn(command, env=, log=)        per rank, to start a fresh rank process
    ... at a consistent cut, after every rank reported ...
    dump(launcher, request, step, ...) the ranks reported ready: write the checkpoint into staging
    settle(launcher, request, ...)    the checkpoint was committed, or not (after dump was called)
    abandon(launcher, request_id)     the cut cannot be used: let parked ranks go on
    can_resume(meta)                  before a restore: None, or the reason it must be refused
    restore(launcher, ref, meta)      start the job's ranks again from checkpoint `ref`

and each rank process (runtime/rank.py) calls `start_rank()` before its script runs and
`cut(rank_runtime, request, step)` at a checkpoint or stop cut. A new engine (the CUDA state of
a GPU job, say) is a new subclass added to ENGINES; nothing else switches on an engine's name.

The engines wrap runtime/criu.py (whole-process dumps) and runtime/framework.py (model,
optimizer, RNG and loader state), which hold the mechanisms.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from protocol.cut import CutRequest, ResumeFile
from runtime import criu, criu_cuda, private_dirs, rank_logs
from runtime import spool as spool_files
from runtime.exits import EXIT_USAGE, LaunchError, end_children
from runtime.private_dirs import PrivateDirsError
from runtime.sandbox import SandboxError

if TYPE_CHECKING:  # the launcher imports this module; the engines only call back into it
    from runtime.launcher import Launcher
    from runtime.rank import RankRuntime
    from runtime.store import CheckpointRef

AUTO = "auto"
EXIT_CUT_STOP = 0  # a rank that stopped at a cut exits 0; the launcher knows it asked


class RankProcess:
    """One rank: its host PID, and how to learn that it ended."""

    def __init__(self, rank: int, pid: int, popen: subprocess.Popen | None = None):
        self.rank = rank
        self.pid = pid
        self.popen = popen
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.popen is not None:
            code = self.popen.poll()
            if code is not None:
                self.returncode = code
        else:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Not our child (should not happen: the launcher is a subreaper). Gone means
                # its exit status is unknown, which counts as a failure.
                if os.path.exists(f"/proc/{self.pid}"):
                    return None
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.popen is not None:
            try:
                self.popen.kill()
            except ProcessLookupError:
                pass


class Engine(ABC):
    """One checkpoint engine. Instances hold no state: the launcher and the rank own theirs."""

    name: ClassVar[str]
    label: ClassVar[str]  # how a person names it in an error ("CRIU")
    # True when the ranks themselves write the checkpoint into the staging folder (a sandboxed
    # job's ranks are then given that folder, and the launcher seals it before the commit).
    ranks_write_checkpoint: ClassVar[bool] = False
    # The kinds of consistent cut this engine can take (runtime/cut.py): a job it cannot cut at
    # any of them waits for an optimizer step, or is refused by no_cut_reason.
    cut_kinds: ClassVar[tuple[str, ...]] = ("optimizer-step",)
    # True when on a job spanning hosts each follower's launcher writes its host's part of the
    # checkpoint (dump_part) and its ranks wait at the cut for the leader's outcome (settle).
    dumps_per_host: ClassVar[bool] = False

    # -- choice ----------------------------------------------------------------------------------
    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Returns (True, detail) when this engine works here, else (False, reason to act on)."""
        return True, ""

    @classmethod
    def requested_reason(cls, detail: str) -> str:
        """The reason recorded when `--engine <name>` asked for this engine and it is available."""
        return "requested"

    @classmethod
    def auto_reason(cls, detail: str) -> str | None:
        """What `auto` says when it picks this engine first; None: say why the better ones failed."""
        return None

    # -- the launcher's side -----------------------------------------------------------------
    def prepare(self) -> None:
        """Called once before any rank is started or restored."""

    @abstractmethod
    def spawn(self, command: list[str], *, env: dict[str, str], log: IO[bytes]) -> tuple[int, subprocess.Popen]:
        """Starts one rank process running `command`; returns (its host PID, the Popen)."""

    @abstractmethod
    def dump(self, launcher: Launcher, request: CutRequest, step: int, staging: os.PathLike, *,
             stop: bool, timeout_s: float) -> tuple[str, ...]:
        """Called once every rank reported ready at the cut `request` (after `step`): writes the checkpoint's
        files into `staging` (the launcher commits it). With `stop`, the ranks are gone when this
        returns (or, on a job spanning hosts, wait at the cut until settle()); without, they go on.
        Returns what the checkpoint leaves out of the job's state, one line each with why (the
        launcher records them in the checkpoint's manifest and event); () when nothing.
        Raises LaunchError when no checkpoint was written."""

    def dump_part(self, launcher: Launcher, request: CutRequest, step: int) -> str:
        """Called on a follower of a job spanning hosts (dumps_per_host engines only) once its ranks
        are at the cut: writes this host's part of the checkpoint; returns its manifest's sha256.
        Raises LaunchError when no part was written (the ranks are still at the cut)."""
        raise LaunchError(f"{self.label} does not write a checkpoint per host")

    def settle(self, launcher: Launcher, request: CutRequest, *, committed: bool, stop: bool) -> None:
        """Called on the leader after `dump` once the checkpoint of the cut `request` was committed
        (`committed`), or not: an error after the ranks reported ready. Ranks an engine left waiting
        at the cut go on, or end (a committed stop)."""

    def abandon(self, launcher: Launcher, request_id: int) -> None:
        """Called when the cut `request_id` cannot be used (refused, timed out, split): lets ranks
        that wait at it go on. A rank that reaches it later must go on at once too."""

    def can_resume(self, meta: dict[str, Any]) -> str | None:
        """Returns None when a checkpoint of this engine with manifest `meta` can be restored
        here, else why not (the launcher refuses the resume with it)."""
        return None

    @abstractmethod
    def restore(self, launcher: Launcher, ref: CheckpointRef, meta: dict[str, Any]) -> None:
        """Starts the job's ranks (launcher.ranks) again from the verified checkpoint `ref`."""

    # -- the rank's side -------------------------------------------------------------------------
    def no_cut_reason(self, runtime: RankRuntime) -> str | None:
        """Called in a rank while a checkpoint or stop request waits and no optimizer step was
        ever taken: why this engine cannot cut the job (the request is refused with it at once),
        or None to keep waiting for a step."""
        return None

    def start_rank(self) -> None:
        """Called in a rank process before it sets anything up."""

    @abstractmethod
    def cut(self, runtime: RankRuntime, request: CutRequest, step: int) -> None:
        """Called in every rank at the same step for a checkpoint or stop cut: saves or parks this
        rank and reports to the launcher (runtime.report). Returns when the rank goes on."""


class CriuEngine(Engine):
    """Whole-process dumps of parked ranks, each the init of its own PID namespace."""

    name = "criu"
    label = "CRIU"
    cut_kinds = ("optimizer-step", "collective-boundary", "any-moment")
    dumps_per_host = True

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return criu.check_available()

    @classmethod
    def requested_reason(cls, detail: str) -> str:
        return f"requested (criu {detail})"

    @classmethod
    def auto_reason(cls, detail: str) -> str | None:
        return f"criu {detail} passed `criu check`"

    def prepare(self) -> None:
        # Restored ranks are detached by `criu restore -d`: they must become our children.
        criu.become_subreaper()

    def spawn(self, command: list[str], *, env: dict[str, str], log: IO[bytes]) -> tuple[int, subprocess.Popen]:
        # A sandboxed rank (started through setpriv as the job's uid) needs a /proc of its own.
        unprivileged = any(os.path.basename(part) == "setpriv" for part in command)
        popen = subprocess.Popen(criu.namespace_command(command, own_proc=unprivileged), env=env,
                                 stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return criu.namespace_init_pid(popen.pid), popen

    def dump(self, launcher: Launcher, request: CutRequest, step: int, staging: os.PathLike, *,
             stop: bool, timeout_s: float) -> tuple[str, ...]:
        if launcher.nodes > 1:
            return self._dump_spanning_hosts(launcher, request, step, staging)
        staging = os.fspath(staging)
        # CRIU restores open files only at the same path and size: carry the logs.
        rank_logs.carry(launcher, os.path.join(staging, "logs"))
        try:
            left_out = dump_host_ranks(launcher, staging, leave_running=not stop)
        except criu_cuda.CudaRefusal as exc:
            launcher.resume_ranks(request.id)  # nothing was dumped nor left moved: the job goes on
            raise LaunchError(f"{request.action} refused at step {step}: {exc}; the job goes on") from None
        except (PrivateDirsError, OSError) as exc:
            if not any(os.path.isdir(os.path.join(staging, f"rank{p.rank}")) for p in launcher.ranks):
                launcher.resume_ranks(request.id)  # no rank was dumped: the job goes on, a stop too
                raise LaunchError(f"{request.action} refused at step {step}: {exc}; the job goes on") from None
            raise self._dump_failed(launcher, request, step, stop, exc) from None
        except (RuntimeError, SandboxError) as exc:
            raise self._dump_failed(launcher, request, step, stop, exc) from None
        if not stop:
            launcher.resume_ranks(request.id)
        # The ranks are gone or running again: deduplicating the pages is no part of the downtime
        # of a checkpoint that goes on, and part of a stop's only until the store has it.
        self.pack_pages(launcher, staging)
        return left_out

    @staticmethod
    def _dump_failed(launcher: Launcher, request: CutRequest, step: int, stop: bool, exc: Exception) -> LaunchError:
        """Returns the error of a dump that failed; a stop's ranks are ended (some may be dumped,
        gone, already: the job cannot go on), a checkpoint's go on."""
        if stop:
            launcher.kill_all()
            return LaunchError(f"stop failed, job ended without a checkpoint: {exc}")
        launcher.resume_ranks(request.id)  # a failed dump leaves the rank running
        return LaunchError(f"checkpoint failed at step {step}: {exc}")

    def _dump_spanning_hosts(self, launcher: Launcher, request: CutRequest, step: int,
                             staging: os.PathLike) -> tuple[str, ...]:
        """Leader of a job spanning hosts: dumps its own part, then checks every host's part
        (runtime/criu_parts.py). Every rank stays parked until settle()."""
        from runtime import criu_parts, multihost
        from runtime.store import CheckpointError
        action = request.action
        peers = launcher.peers
        if peers is None:
            raise LaunchError("internal error: a job spanning hosts without its peers")
        reported: dict[int, str | None] = {}
        try:
            reported[0] = criu_parts.dump_part(launcher, request, step, staging)
        except (RuntimeError, OSError, CheckpointError, PrivateDirsError, SandboxError) as exc:
            raise LaunchError(f"{action} failed at step {step} on node 0: {exc}; no checkpoint was "
                              "committed and the job goes on") from None
        reported.update(multihost.reported_parts(peers, request.id))
        if action != "stop":
            # Every image is written: the ranks go on while the parts are checked and committed
            # (a stop's ranks wait for the commit: without one, the job must go on).
            multihost.announce_outcome(peers, request.id, multihost.OUTCOME_DUMPED)
            launcher.resume_ranks(request.id)
        try:
            verified = criu_parts.verify_parts(staging, blocks=launcher.host_blocks(),
                                               request_id=request.id, step=step, reported=reported)
            launcher.cuda_stage_s = verified.cuda_s  # every host's, not only this one's
            return verified.left_out
        except CheckpointError as exc:
            raise LaunchError(f"{action} refused at step {step}: {exc}; no checkpoint was committed "
                              "and the job goes on") from None

    def dump_part(self, launcher: Launcher, request: CutRequest, step: int) -> str:
        from runtime import criu_parts
        from runtime.store import CheckpointError
        try:
            staging = criu_parts.staging_for_node(launcher.store.root, request.staging_dir or "")
            return criu_parts.dump_part(launcher, request, step, staging)
        except (RuntimeError, OSError, CheckpointError, PrivateDirsError, SandboxError) as exc:
            raise LaunchError(f"node {launcher.node_rank} could not dump its part: {exc}") from None

    def settle(self, launcher: Launcher, request: CutRequest, *, committed: bool, stop: bool) -> None:
        from runtime import multihost
        if launcher.nodes == 1:
            return  # dump() already let the ranks go on, or they are gone (a stop)
        if not committed:
            launcher.abandon_cut(request.id)  # withdraws the cut: every host's ranks go on
        elif stop:
            if launcher.peers is not None:
                multihost.announce_outcome(launcher.peers, request.id, multihost.OUTCOME_COMMITTED)
            launcher.kill_all()
        # A committed checkpoint's ranks went on once every part was dumped.

    @staticmethod
    def pack_pages(launcher: Launcher, staging: os.PathLike | str) -> None:
        """Stores the dump's memory pages once, against the store's base CRIU checkpoint when it
        has one (runtime/criu_pages.py): the store's bytes then follow what the job changed."""
        from runtime import criu_pages
        from runtime.store import CheckpointError
        base = launcher.store.base_candidate(CriuEngine.name)
        try:
            if base is not None and criu_pages.is_packed(base[0]):
                criu_pages.pack(staging, base_dir=base[0], base_name=base[0].name,
                                base_manifest_sha256=base[1])
            else:
                criu_pages.pack(staging)
        except (OSError, ValueError, CheckpointError) as exc:
            if criu_pages.is_packed(staging):
                raise LaunchError(f"checkpoint failed while storing its pages: {exc}") from None
            # The plain dump is whole: store it as CRIU wrote it (bigger, never wrong).
            print(f"meridian-run: pages not deduplicated ({exc}); storing the whole CRIU images",
                  file=sys.stderr)

    def abandon(self, launcher: Launcher, request_id: int) -> None:
        # Parked ranks wait for the resume file; a rank that reaches the cut later finds it.
        launcher.resume_ranks(request_id)

    def can_resume(self, meta: dict[str, Any]) -> str | None:
        ok, detail = criu.check_available()
        return None if ok else f"the checkpoint needs CRIU, which is unavailable: {detail}"

    def restore(self, launcher: Launcher, ref: CheckpointRef, meta: dict[str, Any]) -> None:
        # The store was verified (sha256 of every image, or of every part this host restores from:
        # runtime/criu_parts.py); CRIU only reads the images, so they are restored straight from it
        # (a shared filesystem on a fleet). Put the rank logs back at their paths and sizes, then
        # restore each rank into a new PID namespace. This host's ranks come from the one-host
        # checkpoint or from the parts that hold them, whatever host count dumped it.
        # A checkpoint whose pages are deduplicated (runtime/criu_pages.py; one host's only) is
        # rebuilt into a local folder first, from its own pages and its base's (both verified).
        from runtime import criu_pages, criu_parts
        from runtime.store import CheckpointError, read_manifest
        try:
            plan = criu_parts.restore_sources(ref.path, meta, world_size=launcher.world_size,
                                              ranks=launcher.local_ranks)
        except CheckpointError as exc:
            raise LaunchError(f"--resume: checkpoint {ref.uri}: {exc}", EXIT_USAGE) from None
        refusal = regroup_refusal(launcher, plan)
        if refusal is not None:
            raise LaunchError(f"--resume: checkpoint {ref.uri} was dumped on {plan.dumped} host(s) and this "
                              f"launch spans {launcher.nodes}: {refusal}; restore it onto {plan.dumped} "
                              "host(s), or use the framework engine", EXIT_USAGE)
        images = {source.folder: source.folder for source in plan.sources}
        local = ref.path
        if plan.dumped == 1 and criu_pages.is_packed(local):
            try:
                images[local] = criu_pages.unpack(local, launcher.job_dir / "restore" / "images",
                                                  read_manifest(local), ranks=launcher.local_ranks)
            except (OSError, CheckpointError) as exc:
                raise LaunchError(f"--resume: checkpoint {ref.uri} cannot be rebuilt: {exc}",
                                  EXIT_USAGE) from None
        launcher.restore_at_dumped_spool({"spool": plan.spool})
        launcher.fresh_spool()
        # Linked before any restored rank writes: this attempt starts at the restored size.
        rank_logs.put_back(launcher, *(source.folder / "logs" for source in plan.sources))
        try:
            self._restore_host_ranks(launcher, {rank: images[plan.images_of(rank)] for rank in launcher.local_ranks},
                                     saved=[source.folder for source in plan.sources])
        finally:
            for source, folder in images.items():
                if folder != source:  # the restored ranks no longer need their rebuilt images
                    shutil.rmtree(folder, ignore_errors=True)
        launcher.last_request_id = int(meta["request_id"])
        launcher.resume_ranks(int(meta["request_id"]))

    def _restore_host_ranks(self, launcher: Launcher, images: dict[int, Path], *, saved: list[Path]) -> None:
        """Restores this host's ranks, rank r from images[r]/rank<r>, a job of one host or one host's
        share of a job spanning hosts alike. A sandboxed job's: onto this host's new private /tmp and
        /dev/shm, holding what the `saved` folders (the checkpoint, or the parts) kept of the old
        ones, by criu as the job's uid, each rank left stopped until every one passed
        criu.restored_refusal, then each one's CUDA state (if it had some) put back on the GPU its
        rank is given now (runtime/criu_cuda.py). Raises LaunchError after killing every rank it
        restored."""
        job = _job_credentials(launcher)
        sandboxed = self._sandboxed_restore(launcher, saved, job) if job is not None else None
        try:
            for rank in sorted(images):
                pid = criu.restore(images[rank] / f"rank{rank}", work_dir=launcher.job_dir / "restore",
                                   sandboxed=sandboxed)
                launcher.ranks.append(RankProcess(rank, pid))
            if job is not None:
                self._let_restored_run(launcher, job)
            # Running now (the driver's thread in each process does the work), not yet told to go
            # on: a rank dumped with CUDA state gets it back, on the GPU it is given now.
            launcher.cuda_stage_s = None
            seconds = [criu_cuda.restore_rank(p.rank, p.pid, images[p.rank] / f"rank{p.rank}",
                                              gpu_now=launcher.rank_gpu_uuid(p.rank))
                       for p in launcher.ranks]
            if any(seconds):
                launcher.cuda_stage_s = (None, sum(seconds))
        except RuntimeError as exc:
            for process in launcher.ranks:
                criu.kill_restored(process.pid)
            raise LaunchError(f"--resume: {exc}") from None

    @staticmethod
    def _sandboxed_restore(launcher: Launcher, saved: list[Path], job: criu.JobCredentials) -> criu.SandboxedRestore:
        """Makes this host's new private /tmp and /dev/shm, puts back what the `saved` folders kept
        of the old ones (several: parts merged onto this host, which regroup_refusal let through only
        where none saved one path differently), and returns where criu restores a sandboxed rank
        (criu.SandboxedRestore)."""
        launcher.make_private_dirs()
        dirs = _private_dirs(launcher)
        try:
            for folder in saved:
                dirs.load_from(folder)
        except (OSError, PrivateDirsError) as exc:
            raise LaunchError(f"--resume: the ranks' private /tmp and /dev/shm cannot be put back: {exc}") from None
        return criu.SandboxedRestore(job=job, tmp=str(dirs.tmp), shm=str(dirs.shm),
                                     doors=str(launcher.spool / ".criu-restore"))

    @staticmethod
    def _let_restored_run(launcher: Launcher, job: criu.JobCredentials) -> None:
        """Checks every restored (stopped) rank before any runs; a refusal kills them all."""
        for process in launcher.ranks:
            refusal = criu.restored_refusal(process.pid, job=job)
            if refusal is not None:
                for other in launcher.ranks:
                    criu.kill_restored(other.pid)
                raise LaunchError(f"--resume: refused, a restored rank did not come back as the sandbox's: {refusal}; "
                                  "it was killed before it ran", EXIT_USAGE)
        for process in launcher.ranks:
            criu.resume_restored(process.pid)

    def cut(self, runtime: RankRuntime, request: CutRequest, step: int) -> None:
        from runtime import localreduce, vpg
        # Close every socket, give up the device, and wait to be dumped (and maybe restored
        # elsewhere); then rebuild the inner group on the addresses the launcher gives.
        group = vpg.current_group()
        if group is not None:
            group.close_inner()
        runtime.slot.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Neither a socket nor the shared reduction area may be left for CRIU to dump. CUDA state
        # may: the launcher moves it into the rank's host memory before the dump (runtime/criu_cuda.py),
        # and refuses the cut there, the job going on, where the driver cannot.
        leftovers = vpg.open_socket_fds() + localreduce.shared_mappings()
        runtime.report(request, step, "parked" if not leftovers else "error", open_sockets=tuple(leftovers))
        path = spool_files.resume_path(runtime.spool, request.id)
        while True:
            payload = spool_files.read_json(path)
            if payload is not None:
                break
            time.sleep(0.005)
        resume = ResumeFile.from_dict(payload)
        follow_host_layout(resume, rank=runtime.rank, world_size=runtime.world_size)
        runtime.connection.update(addr=resume.master_addr, port=resume.master_port, prefix=resume.key_prefix)
        runtime.move_to(resume.devices, resume.device_indices)
        runtime.slot.acquire()
        if group is not None:
            group.ensure_inner()
        runtime.resumed()


class FrameworkEngine(Engine):
    """Model, optimizer, RNG and data-loader state saved by each rank; a restore re-runs the script."""

    name = "framework"
    label = "the framework engine"
    ranks_write_checkpoint = True

    def spawn(self, command: list[str], *, env: dict[str, str], log: IO[bytes]) -> tuple[int, subprocess.Popen]:
        # A process group of its own (a terminal's Ctrl-C reaches the launcher, which stops the
        # ranks at a cut) but the launcher's session: with the kernel's autogroup scheduling, a
        # session per rank made ranks that wait on each other every step lose the CPU to
        # unrelated work (+3x step time at load 8 here).
        popen = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, process_group=0)
        return popen.pid, popen

    def dump(self, launcher: Launcher, request: CutRequest, step: int, staging: os.PathLike, *,
             stop: bool, timeout_s: float) -> tuple[str, ...]:
        # The ranks wrote their state into staging before they reported "saved".
        if stop:
            launcher.wait_all_exit(timeout_s)
        return ()

    def restore(self, launcher: Launcher, ref: CheckpointRef, meta: dict[str, Any]) -> None:
        launcher.fresh_spool()
        launcher.spawn_ranks(resume_dir=ref.path)

    def start_rank(self) -> None:
        _die_with_launcher()

    def no_cut_reason(self, runtime: RankRuntime) -> str | None:
        """Asked while a cut request waits and the script has taken no optimizer step: why this
        engine can never cut it (a script without torch.optim), or None to keep waiting."""
        return runtime.tracker.no_cut_reason()

    def cut(self, runtime: RankRuntime, request: CutRequest, step: int) -> None:
        from runtime import vpg
        try:
            runtime.tracker.save(request.staging_dir)
            error = None
        except Exception as exc:  # noqa: BLE001 - UnresumableScript, I/O errors: every failure goes to the peers
            error = f"{type(exc).__name__}: {exc}"
        # Everyone has written before anyone reports "saved" (the launcher commits then),
        # and if one rank could not save, no rank stops.
        (failures,) = vpg.meta_allreduce([1 if error else 0])
        sys.stdout.flush()
        sys.stderr.flush()
        if failures:
            runtime.report(request, step, "error", error=error or f"{failures} other rank(s) could not save")
            return
        seconds, device_bytes = runtime.tracker.last_save
        runtime.report(request, step, "saved", save_s=round(seconds, 4), device_bytes=device_bytes)
        if request.action == "stop":
            group = vpg.current_group()
            if group is not None:
                group.close_inner()
            end_children()
            os._exit(EXIT_CUT_STOP)


def follow_host_layout(resume: ResumeFile, *, rank: int, world_size: int) -> None:
    """Sets this (resumed) rank's os.environ to the host it runs on now, as the resume file says: gloo's
    bind address (MERIDIAN_NODE_ADDR, read at every rebuild of the inner group) and the torchrun
    names LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and GROUP_RANK. A CRIU-restored rank may have been
    dumped on another host, or with another number of hosts (runtime/criu_parts.py). What the
    script copied from them before the cut keeps the old values: Meridian cannot reach its memory."""
    if resume.node_addr:
        os.environ["MERIDIAN_NODE_ADDR"] = resume.node_addr
    from runtime import cudagroup, splice
    if resume.gpu_uuids is not None and str(rank) in resume.devices.ranks:
        # The GPU the rank computes on now: a CRIU restore may have mapped its CUDA state onto
        # another (runtime/criu_cuda.py) under the device number it keeps.
        os.environ[cudagroup.CUDA_GPU_ENV] = resume.gpu_uuids[splice.device_ordinal(resume.devices, rank)]
    if resume.nodes is None or resume.node_rank is None:
        return
    if resume.first_rank is not None and resume.host_ranks is not None:
        first, host_ranks = resume.first_rank, resume.host_ranks  # this host's block (unequal shares too)
    else:  # a resume file that names no block: the equal W/N one
        host_ranks = world_size // resume.nodes
        first = resume.node_rank * host_ranks
    os.environ.update({"NODE_RANK": str(resume.node_rank), "GROUP_RANK": str(resume.node_rank)})
    if cudagroup.given_device() is None:
        os.environ.update({"LOCAL_RANK": str(rank - first), "LOCAL_WORLD_SIZE": str(host_ranks)})
    # else a GPU job's rank: its LOCAL_RANK names its CUDA device (runtime/launcher.py rank_env),
    # which it keeps until it is relaunched: a CRIU restore maps the GPU under it, not the number


def dump_host_ranks(launcher: Launcher, folder: os.PathLike | str, *, leave_running: bool) -> tuple[str, ...]:
    """Dumps this host's ranks, parked at a cut, into folder/rank<r> (serially: parallel dumps race
    inside CRIU), for a job of one host (folder: the staging folder) and for one host's part of a
    job spanning hosts (runtime/criu_parts.py) alike; returns what the private folders' copy left
    out (PrivateDirs.save_into), () for an unsandboxed job.

    A sandboxed job's: every process of every rank's tree is stopped (SIGSTOP) while criu, as the
    job's uid (criu.JobCredentials), writes images that uid could write: a rank parked at the cut
    still runs (its threads, its poll for the resume file) and could otherwise edit another rank's
    images before they are sealed. First, before any rank is dumped, the private /tmp and /dev/shm
    are saved into `folder` (what cannot travel raises PrivateDirsError then, with no rank dumped);
    each rank's images are sealed (root's) as soon as written, `folder` last (criu's logs). criu
    dumps a stopped task as stopped; a restore leaves every task stopped until it is checked
    (criu.restored_refusal); what was stopped here runs on once this returns or raises.
    A GPU job's: before anything is stopped, every rank process holding a GPU has its CUDA state
    moved into its host memory (runtime/criu_cuda.py; the driver needs the process running), which
    its images then hold; a checkpoint the job goes on from, or a dump that failed, gets it back on
    its GPUs before the ranks go on. `launcher.cuda_stage_s` says how long each way took.
    Raises CudaRefusal (nothing dumped, nothing left moved), PrivateDirsError, OSError, RuntimeError
    (criu) or SandboxError (a seal)."""
    launcher.cuda_stage_s = None
    cuda = criu_cuda.checkpoint_ranks(launcher.ranks)
    job = _job_credentials(launcher)
    failed = True
    try:
        stopped_tasks = _stop_all(launcher) if job is not None else []
        try:
            left_out: tuple[str, ...] = ()
            if job is not None:
                left_out = _private_dirs(launcher).save_into(
                    folder, uid=job.uid, held_sockets=private_dirs.bound_unix_sockets(stopped_tasks))
            for process in launcher.ranks:
                image_dir = os.path.join(folder, f"rank{process.rank}")
                criu.dump(process.pid, image_dir, leave_running=leave_running, job=job)
                cuda.record(process.rank, image_dir)
                if job is not None:  # the job's uid wrote it: root's before anything of the job runs again
                    launcher.sandbox.seal_staging(image_dir)
            if job is not None:
                launcher.sandbox.seal_staging(folder)  # criu's logs were the job's uid's too
            failed = False
            return left_out
        finally:
            _continue(stopped_tasks)  # those still there: a checkpoint's ranks, or a failed stop's
    finally:
        if not cuda.empty:
            # A stop's processes were killed by criu once dumped: only those still there come back.
            problems = cuda.release() if (leave_running or failed) else []
            launcher.cuda_stage_s = (cuda.out_s, cuda.in_s)
            if problems and not failed:
                raise RuntimeError(f"the ranks' CUDA state did not come back after the dump: {'; '.join(problems)}")


def regroup_refusal(launcher: Launcher, plan: Any) -> str | None:
    """Returns why this host cannot restore its ranks of a CRIU checkpoint as `plan`
    (criu_parts.RestoreSources) regroups them, or None: nothing is regrouped (the host count is
    the one that dumped it), or the regrouping is exact (runtime/criu_parts.py says what binds a
    restored rank to its old layout and what does not).

    Refused: a GPU job (each rank's CUDA device number was picked by its old LOCAL_RANK; the GPU map
    of runtime/criu_cuda.py is made, and kept unproven, for restores onto as many hosts only); a
    sandboxed job whose parts merged onto this host saved one path of their private /tmp or
    /dev/shm differently (one host's folders cannot hold both). A part split over hosts
    gives each host a copy of what its ranks shared (said in docs/status.md)."""
    if not plan.regrouped:
        return None
    sandbox = launcher.sandbox
    if sandbox is not None and sandbox.spec.device_kind == "gpu":
        return ("a GPU job's restored rank keeps the CUDA device number its old LOCAL_RANK picked, and "
                "this engine maps GPUs only for a job restored onto as many hosts as dumped it")
    if _job_credentials(launcher) is not None and len(plan.sources) > 1:
        conflicts = private_dirs.saved_conflicts([source.folder for source in plan.sources])
        if conflicts:
            return (f"the hosts merged here left different files at the same path of their private /tmp "
                    f"or /dev/shm, which one host's cannot hold both of: {conflicts[:5]}")
    return None


def _private_dirs(launcher: Launcher):
    """Returns the sandboxed ranks' private /tmp and /dev/shm (runtime/private_dirs.py PrivateDirs)."""
    dirs = launcher.sandbox.private_dirs if launcher.sandbox is not None else None
    if dirs is None:
        raise LaunchError("internal error: a sandboxed CRIU checkpoint without the ranks' private folders")
    return dirs


def _stop_all(launcher: Launcher) -> list[int]:
    """SIGSTOPs every process of every rank's tree (a PID-namespace init gets SIGSTOP from outside);
    returns their pids, and waits until each is stopped."""
    stopped: list[int] = []
    for process in launcher.ranks:
        try:
            tree = criu.restored_tasks(process.pid)
        except OSError:
            continue  # gone: its dump fails and says so
        for pid in tree:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for pid in stopped:
        while time.monotonic() < deadline and _task_state(pid) not in ("T", None):
            time.sleep(0.002)
    return stopped


def _task_state(pid: int) -> str | None:
    """Returns the state letter of /proc/<pid>/stat ("T": stopped), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _continue(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _job_credentials(launcher: Launcher) -> criu.JobCredentials | None:
    """Returns the credentials criu runs as for a sandboxed job's ranks (runtime/criu.py), None
    when they run unconfined (root's criu dumps them)."""
    sandbox = launcher.sandbox
    if sandbox is None or sandbox.identity is None:
        return None
    return criu.JobCredentials(uid=sandbox.identity.uid, gid=sandbox.identity.gid)


def _die_with_launcher() -> None:
    """A rank whose launcher died can never be checkpointed or stopped: end with it at once
    (the LauncherWatch, for both engines, is the slower mechanism that also survives CRIU).

    Not for CRIU ranks: CRIU restores the parent-death signal, and a restored rank's first parent
    is the criu process that exits right after restoring it."""
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    launcher_pid = os.environ.get("MERIDIAN_LAUNCHER_PID")
    if launcher_pid and os.getppid() != int(launcher_pid):
        os._exit(1)  # the launcher died before the prctl took effect


# The registry, in `auto`'s order of preference (the first available engine wins).
ENGINES: dict[str, type[Engine]] = {CriuEngine.name: CriuEngine, FrameworkEngine.name: FrameworkEngine}


def choose_engine(requested: str) -> tuple[str, str]:
    """Returns (engine name, why it was chosen). `auto` picks the first available engine of
    ENGINES and says why; an explicitly requested engine that is unavailable raises LaunchError
    (no silent fallback); an unknown name too."""
    if requested != AUTO and requested not in ENGINES:
        raise LaunchError(f"unknown engine {requested!r}; choose one of {', '.join([*ENGINES, AUTO])}",
                          EXIT_USAGE)
    if requested != AUTO:
        engine = ENGINES[requested]
        ok, detail = engine.available()
        if not ok:
            raise LaunchError(f"--engine {requested}: {engine.label} is unavailable: {detail}. "
                              f"Use --engine framework or --engine auto.", EXIT_USAGE)
        return requested, engine.requested_reason(detail)
    refusals: list[str] = []
    for name, engine in ENGINES.items():
        ok, detail = engine.available()
        if ok:
            return name, "auto: " + (engine.auto_reason(detail) or "; ".join(refusals))
        refusals.append(f"{engine.label} unusable ({detail})")
    raise LaunchError("auto: no checkpoint engine is available: " + "; ".join(refusals), EXIT_USAGE)


def engine_named(name: str) -> Engine:
    """Returns the engine registered as `name`; raises LaunchError for a name nobody registered
    (a checkpoint of a newer runtime's engine, say)."""
    engine = ENGINES.get(name)
    if engine is None:
        raise LaunchError(f"no checkpoint engine is named {name!r} here; this runtime has "
                          f"{', '.join(ENGINES)}", EXIT_USAGE)
    return engine()
