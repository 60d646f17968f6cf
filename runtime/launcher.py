"""meridian-run: runs an unmodified PyTorch script as W rank processes, preemptible and resizable.

    meridian-run --ranks W [--devices d] [--device-indices i,j,...] [--engine criu|framework|auto]
                 [--fold] [--job-dir DIR] [--job-id ID] [--store URI] [--keep K]
                 [--resume [--restore-manifest-sha256 HEX]] script.py args...

The launcher hosts the job's rendezvous store (ranks are store clients only), starts every rank
through runtime/rank.py, serves the control socket (runtime/control.py) and carries out the
agent's commands: checkpoint, stop, resize, progress.

Job directory (node-local):
    control.sock     the control socket (JobControl(job_dir))
    launcher.json    job id, engine and why it was chosen, world size, spool, store, pid
    progress.json    step, steps/s, engine, devices, device map, state (refreshed ~0.5 s):
                     protocol.launch.Progress
    events.jsonl     one JSON object per event: started, restored, checkpoint, resize, stopped,
                     finished, failed (each names the engine): protocol.launch's LaunchEvents
    logs/rank<r>.log the ranks' stdout for the job's life (rank<r>.err: stderr): hard links to the
                     spool's rank<r>/out.log and err.log (copies made at exit where the two are on
                     different filesystems)
    logs.json        where each rank's log is and where this attempt's output starts in it
                     (protocol.logs.RankLogs; the agent tails them: runtime/rank_logs.py)
Checkpoints go to --store (default <job-dir>/checkpoints): one folder per checkpoint with a
MANIFEST.json that names the engine and the step (runtime/store.py).

Exit codes: 0 the script finished; 75 stopped after a checkpoint (resume with --resume);
1 a rank or a checkpoint failed; 2 bad arguments or the requested engine is unavailable.
"""
import argparse
import contextlib
import functools
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import sys
import threading
import time
import uuid

from protocol import ProtocolError
from protocol.cut import (
    MAX_BYTES,
    CutReport,
    CutRequest,
    DeviceMap,
    RankProgress,
    ResumeFile,
    StateLoaded,
    check_device_indices,
)
from protocol.launch import (
    CheckpointAnswer,
    CheckpointRequest,
    CheckpointSeconds,
    CheckpointTaken,
    CommandFailed,
    ControlFailure,
    ControlRequest,
    Failed,
    Finished,
    LastCheckpoint,
    LaunchEvent,
    Progress,
    ProgressRequest,
    ResizeAnswer,
    Resized,
    ResizeRequest,
    Restored,
    Started,
    StateApplied,
    Stopped,
    StopRequest,
    event_line,
    left_out_lines,
)
from protocol.node import SHA256_HEX
from protocol.states import LaunchState
from runtime import control, criu_parts, engines, fence, multihost, netns, rank_logs, splice
from runtime import rank as rank_liveness
from runtime import sandbox as job_sandbox
from runtime import spool as spool_files
from runtime import workspace as job_workspace
from runtime.engines import RankProcess, choose_engine
from runtime.exits import (
    EXIT_FENCED,
    EXIT_FINISHED,
    EXIT_RESUME_REFUSED,
    EXIT_STOPPED,
    EXIT_USAGE,
    REFUSED_FILE,
    LaunchError,
)
from runtime.store import ACCEPTED_FILE, CheckpointError

ENGINES = (*engines.ENGINES, engines.AUTO)
POLL_S = 0.01
DEFAULT_TIMEOUT_S = 600.0
DEVICE_INDICES_ENV = "MERIDIAN_DEVICE_INDICES"
# A live resize re-pins ranks to cores; a GPU rank's CUDA_VISIBLE_DEVICES, LOCAL_RANK and tensors
# were fixed when it started (jobs/plan_apply.py resizes a GPU job by a relaunch instead).
GPU_RESIZE_REFUSAL = ("a GPU job is not resized in place: its ranks' GPUs (CUDA_VISIBLE_DEVICES, LOCAL_RANK and "
                      "the tensors on them) were fixed when they started; it is resized by a cut, a checkpoint "
                      "and a relaunch on the new GPUs")
FOLD_ENV = "MERIDIAN_VPG_FOLD"  # runtime/vpg.FOLD_VARIABLE (the launcher never imports torch)
CUDA_DEVICE_ENV = "MERIDIAN_CUDA_DEVICE"  # runtime/cudagroup.CUDA_DEVICE_ENV (the same reason)
CUDA_GPU_ENV = "MERIDIAN_CUDA_GPU"  # runtime/cudagroup.CUDA_GPU_ENV (the same reason)


def _rounded(seconds: float | None) -> float | None:
    """Seconds as an event carries them (4 decimals), None kept."""
    return None if seconds is None else round(seconds, 4)


def _sha256_hex(text):
    """argparse type of --restore-manifest-sha256: 64 lowercase hex digits."""
    if not re.fullmatch(SHA256_HEX, text or ""):
        raise argparse.ArgumentTypeError(f"{text!r} is not a sha256 (64 lowercase hex digits)")
    return text


def parse_device_indices(text):
    """Returns the node-local device indices of `--device-indices 0,2,5` as a tuple; raises
    argparse.ArgumentTypeError for anything else."""
    try:
        indices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of device indices "
                                         "(e.g. 0,2,5)") from None
    try:
        check_device_indices(indices, len(indices), field="--device-indices")
    except ProtocolError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return indices


NO_STEPS_NOTE = ("the script ended without a single optimizer step: it trained nothing through "
                 "torch.optim (an empty dataset, a wrong data path, a loop that never ran?); a "
                 "script that updates its parameters by hand also counts 0 steps")


class Launcher:
    def __init__(self, options):
        from runtime.store import CheckpointStore
        self.options = options
        self.world_size = options.ranks
        self.device_indices = options.device_indices  # node-local (this host's), when the agent gave them
        if options.ranks < 1:
            raise LaunchError("--ranks must be at least 1", EXIT_USAGE)
        # One node of a multi-host job runs its block of ranks only (runtime/multihost.py): the
        # control plane's share (--first-rank/--host-ranks: W/d ranks per device this host holds,
        # so hosts with unequal device counts run unequal blocks), else the equal W/N block.
        try:
            self.local_ranks = multihost.host_block(world_size=options.ranks, nodes=options.nodes,
                                                    node_rank=options.node_rank, first_rank=options.first_rank,
                                                    ranks=options.host_ranks)
        except ValueError as exc:
            raise LaunchError(f"--nodes/--node-rank/--first-rank/--host-ranks: {exc}", EXIT_USAGE) from None
        # On several hosts --devices is the job's count in all, --device-indices this host's share:
        # the devices of its block (W/d ranks each).
        host_ranks = len(self.local_ranks)
        if options.devices is None and self.device_indices is not None:
            self.devices = max(1, len(self.device_indices) * options.ranks // host_ranks)
        else:
            self.devices = options.devices or options.ranks
        try:
            host_devices = len(splice.host_devices(world_size=options.ranks, devices=self.devices,
                                                   ranks=self.local_ranks))
        except ValueError as exc:
            raise LaunchError(str(exc), EXIT_USAGE) from None
        if self.device_indices is not None and host_devices != len(self.device_indices):
            share = (f"this host runs {host_devices} (its {host_ranks} of {options.ranks} ranks on --devices "
                     f"{self.devices})" if options.nodes > 1 else f"--devices is {self.devices}")
            raise LaunchError(f"--device-indices lists {len(self.device_indices)} device(s) "
                              f"({','.join(map(str, self.device_indices))}) but {share}; give as many indices "
                              "as devices (this host's)", EXIT_USAGE)
        # First of all: join the job's cgroup and enter its network namespace (everything started
        # from here on inherits both: the rendezvous store's thread, the ranks, criu).
        self.sandbox = None
        if options.sandbox:
            try:
                self.sandbox = job_sandbox.LaunchSandbox.from_file(options.sandbox)
                self.sandbox.enter(nodes=options.nodes, node_rank=options.node_rank)
            except (OSError, ValueError, job_sandbox.SandboxError) as exc:
                raise LaunchError(f"--sandbox {options.sandbox}: the job's sandbox cannot be set up: {exc}",
                                  EXIT_USAGE) from None
        self.job_dir = pathlib.Path(options.job_dir).absolute()
        self.job_id = options.job_id or self.job_dir.name
        self.spool = spool_files.spool_dir_for(self.job_id).absolute()
        self.script = os.path.abspath(options.script)
        if not os.path.isfile(self.script):
            raise LaunchError(f"script {options.script} does not exist", EXIT_USAGE)
        # This node's block of ranks runs on the cores behind this host's own devices (its map
        # lists only them: splice.device_map).
        self.nodes, self.node_rank = options.nodes, options.node_rank
        try:
            self.device_map = DeviceMap.from_dict(splice.device_map(
                world_size=self.world_size, devices=self.devices, ranks=self.local_ranks,
                device_cores=self.sandbox.device_cores(self.device_indices) if self.sandbox else None))
        except (ValueError, job_sandbox.SandboxError) as exc:
            raise LaunchError(str(exc), EXIT_USAGE) from None
        self.host_addr = options.node_addr  # this host's own address (the other hosts route to it)
        # The address its ranks and the rendezvous bind to: the host's, or, in a job network spanning
        # hosts (runtime/netns.py JobNetworkPart), this host's part's address in it. One host:
        # loopback, whatever --node-addr says (every peer and the store are local, and a sandboxed
        # job's network is loopback only); a CRIU checkpoint of several hosts restored onto one
        # host binds there too (runtime/criu_parts.py).
        job_address = self.sandbox.job_address if self.sandbox is not None else None
        self.node_addr = (job_address or options.node_addr) if self.nodes > 1 else "127.0.0.1"
        if self.nodes > 1 and not options.rendezvous:
            raise LaunchError("--nodes > 1 needs --rendezvous DIR, a folder of the store every "
                              "node of the job shares", EXIT_USAGE)
        self.peers: multihost.JobPeers | None = None
        self.master_addr, self.master_port = "127.0.0.1", 0
        self.job_dir.mkdir(parents=True, exist_ok=True)
        self.store = CheckpointStore(options.store or (self.job_dir / "checkpoints"),
                                     keep=options.keep, accepted_file=self.job_dir / ACCEPTED_FILE)
        # Each host checks the parts of a CRIU checkpoint it restores from, and what all share: which
        # parts those are depends on how many hosts dumped the checkpoint (runtime/criu_parts.py).
        self.store.skip_parts_of = functools.partial(criu_parts.unread_parts, world_size=self.world_size,
                                                     ranks=self.local_ranks)
        self.workspace = job_workspace.from_options(options, self.job_dir)  # None: no --workspace
        self._quota_checked_at = 0.0
        self.nonce = uuid.uuid4().hex[:10]
        self.ranks = []
        self.state = LaunchState.STARTING
        self.last_checkpoint = None
        self.commands = queue.Queue()
        self._stop_answered = threading.Event()
        self.rendezvous = None
        self.engine = None  # the name of self.checkpoints' engine, once chosen
        self._checkpoints: engines.Engine | None = None
        self.engine_reason = None
        self.last_request_id = 0
        self._spool_lock = None  # fd of <spool>/launcher.lock, held until this process exits
        self.restarted = False  # a refused framework resume was started again from scratch
        # (device -> host, host -> device) seconds of the CUDA state of the last CRIU dump or restore
        # (runtime/engines.py dump_host_ranks); None where no rank held any
        self.cuda_stage_s: tuple[float | None, float | None] | None = None
        self.applying: set[int] = set()  # framework-resumed ranks of this host not yet put back

    # -- bookkeeping --------------------------------------------------------------------------
    def event(self, event_type: type[LaunchEvent], **fields) -> None:
        """Appends one event of `event_type` to events.jsonl, stamped with the time and the engine."""
        event = event_type(time_unix=time.time(), engine=self.engine, **fields)
        with open(self.job_dir / "events.jsonl", "a") as handle:
            handle.write(event_line(event))

    def ranks_progress(self) -> RankProgress | None:
        """Returns what rank 0 last wrote to the spool's progress.json, or None (none yet)."""
        try:
            return RankProgress.from_dict(spool_files.read_json(self.spool / "progress.json"))
        except (ProtocolError, ValueError):
            return None

    def progress(self) -> Progress:
        ranks_view = self.ranks_progress()
        return Progress(
            job_id=self.job_id, state=self.state, engine=self.engine, engine_reason=self.engine_reason,
            step=ranks_view.step if ranks_view else 0, steps_per_s=ranks_view.steps_per_s if ranks_view else None,
            world_size=self.world_size, devices=self.devices, device_map=self.device_map,
            device_indices=self.device_indices, last_checkpoint=self.last_checkpoint,
            updated_unix=time.time(), rank_pids=tuple(r.pid for r in self.ranks), spool=str(self.spool))

    def write_progress(self) -> None:
        spool_files.write_json_atomic(self.job_dir / "progress.json", self.progress().to_dict())

    # -- rendezvous -----------------------------------------------------------------------------
    def start_rendezvous(self):
        import torch.distributed as dist
        # The store server lives in the launcher, which is never dumped, so the ranks hold only
        # client connections that the virtual group closes at a cut.
        if self.nodes > 1:
            if self.sandbox is not None and self.sandbox.job_address is not None:
                self.link_job_network()
            self.rendezvous, self.master_addr, self.master_port, self.peers = \
                multihost.join_job(self, self.options.rendezvous)
            return
        self.rendezvous = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                        wait_for_workers=False)
        self.master_port = self.rendezvous.port

    def link_job_network(self):
        """Publishes this host's address in the job's rendezvous folder, waits for every other
        host's (up to --rendezvous-timeout) and routes their parts of the job's network through
        them (runtime/netns.py). Raises LaunchError when a host never says or the node refuses."""
        from protocol.rendezvous import NodeAddress
        from runtime import rendezvous
        folder = rendezvous.FolderRendezvous(self.options.rendezvous, self.job_id)
        try:
            folder.publish_node(NodeAddress(job_id=self.job_id, node_rank=self.node_rank, addr=self.host_addr))
            found = netns.wait_peer_node_addresses(lambda: folder.read_nodes(job_id=self.job_id, nodes=self.nodes),
                                                   nodes=self.nodes, timeout_s=self.options.rendezvous_timeout)
            self.sandbox.link_peers(found, own_node_addr=self.host_addr)
        except (ProtocolError, netns.NetworkNamespaceError, job_sandbox.SandboxError) as exc:
            raise LaunchError(f"the job's network across hosts: {exc}") from None

    def leave_job_network(self):
        """Removes this host's routes and link of the job's network (the ranks are gone here)."""
        if self.sandbox is not None:
            self.sandbox.leave_network()

    @property
    def gpu_ranks(self) -> bool:
        """True when the ranks run on GPUs an agent gave the job (its sandbox spec says GPU, and the
        ranks see exactly those, as CUDA_VISIBLE_DEVICES: runtime/sandbox.py)."""
        return (self.sandbox is not None and self.sandbox.spec.device_kind == "gpu"
                and self.device_indices is not None)

    def gpu_uuids(self) -> tuple[str, ...] | None:
        """The UUIDs of the job's GPUs on this host, in the order of its device indices (the order the
        ranks see them in), or None: not a GPU job under an agent, or a GPU the driver does not list."""
        from runtime import criu_cuda
        if not self.gpu_ranks:
            return None
        gpus = criu_cuda.node_gpus()
        if any(not 0 <= index < len(gpus) for index in self.device_indices):
            return None
        return tuple(gpus[index].uuid for index in self.device_indices)

    def rank_gpu_uuid(self, rank) -> str | None:
        """The UUID of the GPU `rank` is given on this host, or None (gpu_uuids)."""
        uuids = self.gpu_uuids()
        return None if uuids is None else uuids[splice.device_ordinal(self.device_map, rank)]

    def rank_env(self, rank, resume_dir=None):
        root = self.runtime_root
        local_rank, local_world = rank - self.local_ranks.start, len(self.local_ranks)
        cuda = {}
        if self.gpu_ranks:
            # A GPU script picks its GPU by LOCAL_RANK (cuda:LOCAL_RANK, set_device(LOCAL_RANK)), as
            # under torchrun, which starts one process per GPU. Spliced (d < W), one process per GPU
            # would be wrong: LOCAL_RANK is the index of the rank's GPU among the job's GPUs on this
            # host, which the ranks of one GPU share, and LOCAL_WORLD_SIZE how many those are
            # (unspliced, both are torchrun's). A resize or move relaunches the ranks with the new ones.
            local_rank, local_world = splice.device_ordinal(self.device_map, rank), len(self.device_indices)
            cuda = {CUDA_DEVICE_ENV: str(local_rank)}
            uuid = self.rank_gpu_uuid(rank)
            if uuid is not None:  # the fold's key of the rank's GPU, which a CRIU restore may change
                cuda[CUDA_GPU_ENV] = uuid
        runtime_env = {
            "RANK": str(rank), "WORLD_SIZE": str(self.world_size), **cuda,
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(self.node_rank), "NODE_RANK": str(self.node_rank),
            "MERIDIAN_NODE_ADDR": self.node_addr,
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            "MERIDIAN_JOB_DIR": str(self.job_dir), "MERIDIAN_JOB_ID": self.job_id,
            "MERIDIAN_ENGINE": self.engine, "MERIDIAN_NONCE": self.nonce,
            "OMP_NUM_THREADS": "1", "MERIDIAN_LAUNCHER_PID": str(os.getpid()),
        }
        if getattr(self.options, "fold", False):
            runtime_env[FOLD_ENV] = "1"
        if self.device_indices is not None:
            runtime_env[DEVICE_INDICES_ENV] = ",".join(map(str, self.device_indices))
        if resume_dir is not None:
            runtime_env["MERIDIAN_RESUME"] = str(resume_dir)
        if self.workspace is not None:
            runtime_env[job_workspace.WORKSPACE_ENV] = str(self.workspace.path)
        if self.sandbox is not None:
            # Only the job's own environment and the runtime's: never the launcher's (nor, through
            # it, the agent's: tokens, database URLs, keys). HOME is the workspace when there is one.
            home = self.workspace.path if self.workspace is not None else spool_files.rank_dir(self.spool, rank)
            return self.sandbox.environment(runtime_env, home=str(home), device_indices=self.device_indices,
                                            pythonpath=root)
        # A launcher started by hand passes its environment on, as torchrun does.
        env = dict(os.environ)
        env.pop("MERIDIAN_RESUME", None)
        env.pop(DEVICE_INDICES_ENV, None)
        env.pop(CUDA_DEVICE_ENV, None)  # only a GPU job under an agent is given its GPU
        env.pop(CUDA_GPU_ENV, None)
        env.pop(job_workspace.WORKSPACE_ENV, None)
        env.update(runtime_env)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def hold_spool(self):
        """Takes <spool>/launcher.lock for this launcher's whole life (the ranks' liveness
        probe, runtime/rank.py): before any rank is started or restored. Another live launcher
        of the same job id holds it already: refused rather than wiping its spool."""
        if self._spool_lock is not None:
            return
        try:
            self._spool_lock = rank_liveness.hold_launcher_lock(self.spool)
        except BlockingIOError:
            # Not the job's fault: under an agent (which waits for a previous launcher of the same
            # id before it starts one) the job is restarted from its checkpoint, never failed.
            raise LaunchError(f"another meridian-run is running job {self.job_id!r} on this "
                              f"node (it holds {rank_liveness.launcher_lock_path(self.spool)}); "
                              f"stop it or use another --job-id", EXIT_USAGE, host_failure=True) from None

    def fresh_spool(self):
        self.hold_spool()
        for entry in self.spool.iterdir():  # everything but the lock this launcher holds
            if entry.name == rank_liveness.LAUNCHER_LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for rank in self.local_ranks:
            spool_files.rank_dir(self.spool, rank).mkdir(parents=True)
        if self.sandbox is not None:
            self.sandbox.give_spool(self.spool, [spool_files.rank_dir(self.spool, r) for r in self.local_ranks])
        spool_files.write_json_atomic(self.spool / "devices.json", self.device_map.to_dict())

    def give_workspace(self):
        """Makes the workspace the job's own (its uid) after the launcher (root) put files there."""
        if self.sandbox is not None and self.workspace is not None:
            self.sandbox.give_workspace(self.workspace.path)

    def spawn_ranks(self, resume_dir=None):
        self.give_workspace()
        rank_logs.link(self)
        self.make_private_dirs()
        for rank in self.local_ranks:
            command = [sys.executable, "-m", "runtime.rank", "--spool", str(self.spool),
                       self.script] + list(self.options.args)
            if self.sandbox is not None:
                command = self.sandbox.command(command)
            with open(spool_files.rank_dir(self.spool, rank) / "launch.log", "ab") as launch_log:
                pid, popen = self.checkpoints.spawn(command, env=self.rank_env(rank, resume_dir),
                                                    log=launch_log)
            self.ranks.append(RankProcess(rank, pid, popen))

    def make_private_dirs(self):
        """Gives a sandboxed job's ranks their own /tmp and /dev/shm on this host (once per
        launcher: every rank it starts shares them; runtime/private_dirs.py). The paths the ranks
        need are named, so that those under the node's /tmp or /dev/shm stay reachable."""
        if self.sandbox is None:
            return
        keep = [self.spool, os.path.dirname(self.script), self.runtime_root,
                os.path.dirname(os.path.realpath(sys.executable)), sys.prefix, sys.base_prefix]
        if self.checkpoints.ranks_write_checkpoint:
            # Only ranks that write (and, resumed, read) their checkpoint need the store. A CRIU
            # rank never does, and a bind kept in its mount namespace would be recreated at every
            # restore: the store folder of its first generation, removed once a newer generation
            # holds the job's checkpoint (agent/node.py), failed the second move's restore.
            keep.append(self.store.root)
        if self.workspace is not None:
            keep.append(self.workspace.path)
        if self.options.rendezvous:
            keep.append(self.options.rendezvous)
        try:
            self.sandbox.make_private_dirs(job_dir=self.job_dir, job_id=self.job_id, keep=keep)
        except job_sandbox.SandboxError as exc:
            raise LaunchError(f"--sandbox: {exc}") from None

    @property
    def runtime_root(self):
        """The folder that holds runtime/ (the ranks' PYTHONPATH starts with it)."""
        return str(pathlib.Path(__file__).resolve().parent.parent)

    def remove_private_dirs(self):
        """Removes the ranks' private /tmp and /dev/shm: their ranks are gone on this host (what
        they held there is in no checkpoint: the workspace is what follows a job)."""
        if self.sandbox is not None:
            self.sandbox.remove_private_dirs()

    # -- rank health ----------------------------------------------------------------------------
    def check_ranks(self):
        """Returns True when every rank finished with 0; raises LaunchError if one failed."""
        codes = [r.poll() for r in self.ranks]
        failed = [(r.rank, c) for r, c in zip(self.ranks, codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            if code == EXIT_RESUME_REFUSED:
                return self.resume_refused(rank)
            if self.peers is not None and (behind := self.peers.failure_behind()) is not None:
                # Found by the multi-host agents test under load: a host killed under the job made this
                # host's collectives fail before anyone found it silent, and the job failed as if its
                # code had; a host failure restarts the job from its checkpoint instead.
                raise LaunchError(f"rank {rank} exited with code {code} after another host of the job failed "
                                  f"({behind}); this node's ranks are ended", host_failure=self.peers.host_failed)
            tail = self.log_tail(rank)
            raise LaunchError(f"rank {rank} exited with code {code}; the job fails.\n"
                              f"--- last lines of rank {rank}'s output ---\n{tail}")
        return all(c == 0 for c in codes)

    def resume_refused(self, rank):
        """The framework engine refused the resume in rank `rank` (the re-run is not the run that
        was cut). The job's policy (--if-resume-refused) decides: fail with the reason, or start
        the script again from scratch (a script with its own snapshot then resumes itself). A job
        spanning hosts only fails (its hosts would have to restart together)."""
        try:
            raw = job_sandbox.read_job_file(spool_files.rank_dir(self.spool, rank) / REFUSED_FILE, limit=16384)
            reason = str(json.loads(raw).get("reason"))[:4000]
        except (OSError, ValueError, AttributeError):
            reason = "(no reason recorded)"
        if self.options.if_resume_refused == "restart" and self.peers is not None and not self.restarted:
            # Said first, so that it survives the control plane's cut of a long reason: the job asked
            # for a restart, and the owner must learn why it failed instead.
            raise LaunchError(f"resume refused by the framework engine (rank {rank}); --if-resume-refused restart "
                              f"is not applied to a job spanning hosts (its hosts would have to start again "
                              f"together), so the job fails: {reason}")
        if self.options.if_resume_refused != "restart" or self.restarted or self.peers is not None:
            raise LaunchError(f"resume refused by the framework engine (rank {rank}): {reason}")
        self.kill_all()
        self.ranks = []
        self.restarted = True
        self.fresh_spool()
        self.spawn_ranks()
        self.engine_reason = f"restarted from scratch (--if-resume-refused restart): the resume was refused: {reason}"
        self.event(Started, world_size=self.world_size, devices=self.devices,
                   reason=self.engine_reason[:2000], device_indices=self.device_indices,
                   sandbox=self.sandbox.describe() if self.sandbox else None)
        return False

    def log_tail(self, rank, lines=20):
        rank_dir = spool_files.rank_dir(self.spool, rank)
        text = ""
        for path in (rank_dir / "launch.log", rank_dir / "out.log", rank_dir / "err.log"):
            try:  # the rank's own file: never through a link it put there
                tail = job_sandbox.read_job_file(path, limit=64 * 1024).decode(errors="replace")
                text += "".join(tail.splitlines(True)[-lines:])
            except OSError:
                pass
        return text

    def kill_all(self):
        for rank in self.ranks:
            rank.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(r.poll() is None for r in self.ranks):
            time.sleep(POLL_S)

    # -- the cut --------------------------------------------------------------------------------
    def next_request_id(self):
        # Milliseconds since the epoch: ids keep growing across launchers, so a restored rank
        # (which remembers the last id it handled) never mistakes a new request for an old one.
        return max(int(time.time() * 1000), self.last_request_id + 1)

    def request_cut(self, action, *, at_step=None, timeout_s=DEFAULT_TIMEOUT_S, **fields):
        """Asks every rank for a cut (a CutRequest with `fields`) and waits for all their reports;
        returns (request, step, reports, errors: the reports that refuse the cut, by rank)."""
        request_id = self.next_request_id()
        self.last_request_id = request_id
        request = CutRequest(id=request_id, action=action, at_step=at_step, **fields)
        if self.peers is not None:  # every host holds the request before any rank may see it
            multihost.hand_out_cut(self.peers, request)
        return self.await_cut(request, timeout_s)

    def await_cut(self, request, timeout_s):
        """Puts `request` in this node's spool and waits for this node's ranks (and, on a
        multi-host job's leader, every other node's); returns as request_cut does."""
        request_id, action = request.id, request.action
        spool_files.write_json_atomic(self.spool / "request.json", request.to_dict())
        deadline = time.monotonic() + timeout_s
        reports: dict[int, CutReport] = {}
        while len(reports) < len(self.local_ranks):
            for rank in self.local_ranks:
                if rank not in reports:
                    report = spool_files.read_json(
                        spool_files.cut_report_path(self.spool, rank, request_id))
                    if report is not None:
                        reports[rank] = CutReport.from_dict(report)
            if len(reports) == len(self.local_ranks):
                break
            if self.check_ranks():
                raise LaunchError(f"the job finished before reaching the cut for {action}")
            self.check_peers_in_cut(request)
            if time.monotonic() > deadline:
                self.abandon_cut(request_id)
                if self.peers is not None:
                    self.peers.withdraw_cut(request_id)
                raise LaunchError(f"{action}: ranks {sorted(set(self.local_ranks) - set(reports))} "
                                  f"did not reach a consistent cut within {timeout_s} s; the job goes on")
            time.sleep(POLL_S)
        steps = {r.step for r in reports.values()}
        if self.peers is not None and self.node_rank == 0:
            steps |= multihost.gather_cut_reports(self, request, deadline)
        if len(steps) != 1:
            self.abandon_cut(request_id)
            raise LaunchError(f"{action}: ranks cut at different steps {sorted(steps)} (its ranks share no "
                              f"collective per step, so no one step holds for all); the job goes on")
        errors = {rank: r for rank, r in reports.items() if r.status == "error"}
        return request, steps.pop(), reports, errors

    def check_peers_in_cut(self, request):
        """While this node waits inside the cut `request` (its ranks' reports; on the leader, the
        followers'): raises LaunchError (host_failure) when another host of the job failed, the
        leader is unreachable, or (leader) a follower fell silent, after letting this node's ranks
        go on from the cut; without it a host killed between the cut's "go" and its report kept the
        leader inside the cut until the cut's deadline. A follower dumping its ranks' processes
        (CRIU) beats from a thread meanwhile (JobPeers.beating): its silence is a lost host too."""
        if self.peers is None:
            return
        failure = self.peers.check()
        if failure:
            self.abandon_cut(request.id)
            raise LaunchError(f"{request.action}: the job failed on another host during the cut ({failure}); "
                              "this node's ranks are ended", host_failure=self.peers.host_failed)

    def abandon_cut(self, request_id):
        """Lets the ranks go on after a cut that cannot be used (the engine knows how); the leader
        of a job spanning hosts also withdraws it, so that the followers' ranks go on too."""
        if self.peers is not None and self.node_rank == 0:
            self.peers.withdraw_cut(request_id)
        self.checkpoints.abandon(self, request_id)

    def host_blocks(self) -> list[range]:
        """Returns each host's block of ranks, in node order ([all W] on one host). Every node
        published its block when it joined (multihost.join_job), and a cut needs every rank, so
        at a cut every block is known."""
        if self.nodes == 1 or self.peers is None:
            return [range(self.world_size)]
        blocks = self.peers.blocks()
        if blocks is None:
            raise LaunchError("internal error: a cut of a job spanning hosts before every host said its ranks")
        return [block for _node, block in sorted(blocks.items())]

    def blocks_meta(self) -> dict:
        """The checkpoint meta that says which ranks each host ran (a CRIU part holds its host's:
        runtime/criu_parts.py): {"blocks": [[first rank, ranks], ...] in node order} on several
        hosts, {} on one."""
        if self.nodes == 1:
            return {}
        return {"blocks": [[block.start, len(block)] for block in self.host_blocks()]}

    def resume_ranks(self, request_id):
        # The host's address and the job's host layout every time: a CRIU-restored rank may have
        # been dumped on another host, or with another number of hosts (runtime/criu_parts.py).
        resume = ResumeFile(master_addr=self.master_addr, master_port=self.master_port,
                            key_prefix=f"{self.nonce}/{request_id}", devices=self.device_map,
                            device_indices=self.device_indices, node_addr=self.node_addr,
                            nodes=self.nodes, node_rank=self.node_rank,
                            first_rank=self.local_ranks.start, host_ranks=len(self.local_ranks),
                            gpu_uuids=self.gpu_uuids())
        spool_files.write_json_atomic(spool_files.resume_path(self.spool, request_id), resume.to_dict())

    def do_checkpoint(self, *, stop, at_step=None, timeout_s=DEFAULT_TIMEOUT_S) -> CheckpointAnswer:
        action = "stop" if stop else "checkpoint"
        began = time.monotonic()
        staging = self.store.staging_dir()
        with self.store.keep_alive(staging):  # no sweep takes it for abandoned meanwhile
            return self._checkpoint_into(staging, stop=stop, at_step=at_step, timeout_s=timeout_s,
                                         action=action, began=began)

    def _checkpoint_into(self, staging, *, stop, at_step, timeout_s, action, began) -> CheckpointAnswer:
        request = None
        try:
            if self.sandbox is not None and self.checkpoints.ranks_write_checkpoint:
                self.sandbox.give_staging(staging)  # the ranks write their state there
            request, step, reports, errors = self.request_cut(
                action, at_step=at_step, timeout_s=timeout_s, staging_dir=str(staging))
            cut_s = time.monotonic() - began
            if errors:
                self.abandon_cut(request.id)
                raise LaunchError(f"{action} refused at step {step}: "
                                  + "; ".join(f"rank {k}: {v.problem()}" for k, v in errors.items()))
            dump_began = time.monotonic()
            left_out = self.checkpoints.dump(self, request, step, staging, stop=stop, timeout_s=timeout_s)
            dump_s = time.monotonic() - dump_began
            if self.sandbox is not None and self.checkpoints.ranks_write_checkpoint:
                self.sandbox.seal_staging(staging)
            # The workspace part goes into the checkpoint (listed in its MANIFEST.json) before it is committed.
            saved = job_workspace.persist_at_checkpoint(self.workspace, staging)
            commit_began = time.monotonic()
            ref = self.store.commit(staging, step, self.engine, meta={
                "job_id": self.job_id, "spool": str(self.spool), "world_size": self.world_size,
                "request_id": request.id, "nodes": self.nodes, **self.blocks_meta(),
                "devices": self.devices, "device_map": self.device_map.plain(),
                "device_indices": list(self.device_indices) if self.device_indices is not None else None,
                "action": action, "script": self.script, "args": list(self.options.args),
                "workspace": str(self.workspace.path) if self.workspace else None,
                # What the checkpoint could not carry (stale socket files of the private /tmp):
                # kept with it, said in its event (and so in the job's events), never dropped unsaid.
                "left_out": list(left_out)})
            commit_s = time.monotonic() - commit_began
            job_workspace.point_latest(self.workspace, saved, step=step, checkpoint=ref.uri)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if request is not None:
                self.checkpoints.settle(self, request, committed=False, stop=stop)
            raise
        self.checkpoints.settle(self, request, committed=True, stop=stop)
        self.last_checkpoint = LastCheckpoint(step=step, uri=ref.uri, engine=ref.engine, bytes=ref.bytes)
        saves = [report.save_s for report in reports.values() if report.save_s is not None]
        on_devices = [report.device_bytes for report in reports.values() if report.device_bytes is not None]
        device_out, device_in = self.cuda_stage_s or (None, None)
        seconds = CheckpointSeconds(cut=round(cut_s, 4), dump=round(dump_s, 4), commit=round(commit_s, 4),
                                    total=round(time.monotonic() - began, 4),
                                    save=round(max(saves), 4) if saves else None,
                                    device_out=_rounded(device_out), device_in=_rounded(device_in))
        kinds = {report.cut_kind for report in reports.values()}
        self.event(CheckpointTaken, step=step, checkpoint=ref.uri, bytes=ref.bytes, action=action,
                   seconds=seconds, cut_kind=kinds.pop() if len(kinds) == 1 else None, base=ref.base,
                   left_out=left_out_lines(left_out), device_bytes=sum(on_devices) if on_devices else None)
        return CheckpointAnswer(step=step, engine=self.engine, checkpoint=ref.uri, bytes=ref.bytes,
                                seconds=seconds)

    def wait_all_exit(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while any(r.poll() is None for r in self.ranks):
            if time.monotonic() > deadline:
                raise LaunchError("ranks did not exit after a stop")
            time.sleep(POLL_S)

    def do_resize(self, request: ResizeRequest) -> ResizeAnswer | ControlFailure:
        if self.gpu_ranks:
            return ControlFailure(error=GPU_RESIZE_REFUSAL)
        try:
            new_cores = self.sandbox.device_cores(request.device_indices) if self.sandbox else None
            mapping = DeviceMap.from_dict(splice.device_map(world_size=self.world_size, devices=request.devices,
                                                            device_cores=new_cores))
        except (ValueError, job_sandbox.SandboxError) as exc:
            return ControlFailure(error=str(exc))
        if new_cores is not None and self.sandbox is not None:
            # Both the old and the new cores while the ranks move; only the new ones after.
            old_cores = [c for cores in self.device_map.plain()["devices"].values() for c in cores]
            self.sandbox.move_cores(old_cores + [c for cores in new_cores for c in cores])
        began = time.monotonic()
        _, step, reports, errors = self.request_cut(
            "resize", at_step=request.at_step, timeout_s=request.timeout_s or DEFAULT_TIMEOUT_S,
            devices=mapping, device_indices=request.device_indices)
        if errors:
            raise LaunchError("resize failed: " + "; ".join(f"rank {k}: {v.problem()}" for k, v in errors.items()))
        if new_cores is not None and self.sandbox is not None:
            self.sandbox.move_cores(c for cores in new_cores for c in cores)
        self.devices = request.devices
        self.device_map = mapping
        # Indices the agent did not give are unknown now: the old ones describe the old devices.
        self.device_indices = request.device_indices
        spool_files.write_json_atomic(self.spool / "devices.json", mapping.to_dict())
        seconds = round(time.monotonic() - began, 4)
        self.event(Resized, step=step, devices=self.devices, device_map=mapping, seconds=seconds,
                   device_indices=self.device_indices)
        return ResizeAnswer(step=step, devices=self.devices, device_map=mapping,
                            device_indices=self.device_indices, seconds=seconds)

    def choose_engine(self) -> tuple[str, str]:
        """Returns (engine, why) for --engine; a sandboxed job whose ranks CRIU cannot dump here
        (runtime/sandbox.py criu_refusal_for_sandbox: no setpriv) gets the framework engine under
        auto, and --engine criu is refused with the reason; otherwise CRIU dumps them as the job's
        uid (runtime/criu.py), on one host or each host's part (runtime/criu_parts.py), and auto
        picks it as for an unsandboxed job. A job spanning hosts gets the framework engine under
        auto, sandboxed or not, although every move of an unconfined one works with CRIU through the
        control loop (tests/hosts/test_multihost_agents.py): each host's part is stored whole (no page
        deduplication across hosts: every checkpoint writes every rank's full image, where one host
        writes only the pages that changed); after a restore onto another host count a script that
        acts on a LOCAL_RANK it copied before the cut acts on the old layout, undetected (a relaunch
        gives it the new one); and such a restore refuses what the framework engine resizes (a GPU
        job; a sandboxed job whose merged parts saved one private path differently), which ends that
        resize refused, by name. `--engine criu` asks for it."""
        refusal = (job_sandbox.criu_refusal_for_sandbox()
                   if self.sandbox and self.sandbox.identity else None)
        if refusal and self.options.engine == "criu":
            raise LaunchError(f"--engine criu: {refusal}; use --engine framework or auto", EXIT_USAGE)
        if refusal and self.options.engine == engines.AUTO:
            name, _ = choose_engine("framework")
            return name, f"auto: {refusal}"
        if self.nodes > 1 and self.options.engine == engines.AUTO:
            name, _ = choose_engine("framework")
            return name, (f"auto: a job spanning {self.nodes} hosts; CRIU would store every rank's full image at "
                          "each checkpoint (no page deduplication across hosts yet) and refuses some restores onto "
                          "another host count (ask --engine criu for it)")
        return choose_engine(self.options.engine)

    def use_engine(self, name: str) -> None:
        """Makes `name` this launch's engine (once: chosen, or the resumed checkpoint's)."""
        self._checkpoints = engines.engine_named(name)
        self.engine = name

    @property
    def checkpoints(self) -> engines.Engine:
        """This launch's checkpoint engine; only used once use_engine has named it."""
        if self._checkpoints is None:
            raise LaunchError("internal error: no checkpoint engine was chosen yet")
        return self._checkpoints

    # -- restore --------------------------------------------------------------------------------
    def restore_latest(self):
        """Resumes from the newest good checkpoint of the store (either engine), or with
        --restore-manifest-sha256 from exactly the checkpoint whose MANIFEST.json has that digest
        (what the control plane recorded), checked before anything is loaded."""
        pinned = self.options.restore_manifest_sha256
        if pinned:
            try:
                ref = self.store.pinned(pinned)
            except CheckpointError as exc:
                raise LaunchError(f"--resume: {exc}", EXIT_USAGE) from None
        else:
            ref = self.store.latest_good()
        if self.peers is not None:  # every node resumes from the leader's choice
            ref = multihost.agree_on_checkpoint(self, ref)
        if ref is None:
            raise LaunchError(f"--resume: no usable checkpoint in {self.store.root}", EXIT_USAGE)
        if self.options.engine not in ("auto", ref.engine):
            raise LaunchError(f"--resume: the newest checkpoint ({ref.uri}) was made by the "
                              f"{ref.engine} engine, but --engine {self.options.engine} was asked",
                              EXIT_USAGE)
        try:
            manifest = self.store.verify(ref, expect_manifest_sha256=pinned or None)
        except CheckpointError as exc:
            raise LaunchError(f"--resume: {exc}", EXIT_USAGE) from None
        meta = manifest.get("meta", {})
        if int(meta.get("world_size", self.world_size)) != self.world_size:
            raise LaunchError(f"--resume: checkpoint has world size {meta.get('world_size')}, "
                              f"--ranks is {self.world_size}", EXIT_USAGE)
        self.use_engine(ref.engine)
        refusal = self.checkpoints.can_resume(meta)
        if refusal is None and ref.engine == "criu" and self.sandbox and self.sandbox.identity:
            refusal = job_sandbox.criu_refusal_for_sandbox()
        if refusal is not None:
            raise LaunchError(f"--resume: {refusal}", EXIT_USAGE)
        self.checkpoints.prepare()
        job_workspace.restore_for_resume(self.workspace, ref.path, meta)
        self.give_workspace()
        self.engine_reason = f"resume: the checkpoint {ref.uri} was made by {ref.engine}"
        began = time.monotonic()
        # A long restore (CRIU) would otherwise be a silence the leader takes for a lost host.
        with self.peers.beating() if self.peers is not None else contextlib.nullcontext():
            self.checkpoints.restore(self, ref, meta)
        self.event(Restored, step=ref.step, checkpoint=ref.uri, spool=str(self.spool),
                   seconds=round(time.monotonic() - began, 4), device_indices=self.device_indices,
                   sandbox=self.sandbox.describe() if self.sandbox else None,
                   device_in=_rounded((self.cuda_stage_s or (None, None))[1]))
        if self.checkpoints.ranks_write_checkpoint:  # they read it back too, at their first epoch
            self.applying = set(self.local_ranks)
        return ref

    def check_applied(self):
        """Emits StateApplied once every framework-resumed rank of this host said how its state came
        back (its StateLoaded). What a rank wrote is the job's: one that does not read as a
        StateLoaded of its own rank is left out, said once, and no event follows."""
        loaded = []
        for rank in sorted(self.applying):
            path = spool_files.loaded_path(self.spool, rank)
            try:
                payload = spool_files.read_json(path)
                if payload is None:
                    continue
                state = StateLoaded.from_dict(payload)
                if state.rank != rank:
                    raise ProtocolError("rank", f"{state.rank} in rank {rank}'s file")
            except (OSError, ValueError, ProtocolError) as exc:
                print(f"meridian-run: {path} is not a rank's StateLoaded ({exc}); its restore stages are "
                      "not reported", file=sys.stderr)
                self.applying = set()
                return
            loaded.append(state)
        if len(loaded) < len(self.applying):
            return
        self.applying = set()
        self.event(StateApplied, step=max(state.step for state in loaded),
                   load_s=max(state.load_s for state in loaded), apply_s=max(state.apply_s for state in loaded),
                   device_bytes=min(sum(state.device_bytes for state in loaded), MAX_BYTES))

    def restore_at_dumped_spool(self, meta):
        """A CRIU-restored rank goes on using the spool path it had when it was dumped (its open
        log, the launcher lock it probes, its cut files), so the restore happens there, whatever
        this launcher's own --job-id names: a node agent names each attempt anew."""
        dumped = meta.get("spool")
        if dumped:
            self.spool = pathlib.Path(dumped)

    # -- main loop ------------------------------------------------------------------------------
    def handle(self, request: ControlRequest) -> Progress | CheckpointAnswer | ResizeAnswer | ControlFailure:
        """Runs in the control thread: hands the command to the main loop, waits for its answer."""
        if isinstance(request, ProgressRequest):
            return self.progress()
        answer: queue.Queue[Progress | CheckpointAnswer | ResizeAnswer | ControlFailure] = queue.Queue(maxsize=1)
        self.commands.put((request, answer))
        return answer.get()

    def _answer_sent(self, request, answer):
        if isinstance(request, StopRequest):
            self._stop_answered.set()

    def execute(self, request: ControlRequest) -> CheckpointAnswer | ResizeAnswer | ControlFailure:
        refusal = multihost.refusal(self, request)  # what a job spanning hosts cannot do yet
        if refusal is not None:
            return ControlFailure(error=refusal)
        if isinstance(request, CheckpointRequest):
            return self.do_checkpoint(stop=False, at_step=request.at_step,
                                      timeout_s=request.timeout_s or DEFAULT_TIMEOUT_S)
        if isinstance(request, StopRequest):
            self.state = LaunchState.STOPPING
            return self.do_checkpoint(stop=True, at_step=request.at_step,
                                      timeout_s=request.timeout_s or DEFAULT_TIMEOUT_S)
        if isinstance(request, ResizeRequest):
            return self.do_resize(request)
        return ControlFailure(error=f"command {request.cmd!r} is not carried out by the main loop")

    def run(self):
        if self.options.resume:
            self.start_rendezvous()
            self.restore_latest()
        else:
            name, self.engine_reason = self.choose_engine()
            self.use_engine(name)
            self.start_rendezvous()
            self.checkpoints.prepare()
            self.fresh_spool()
            self.spawn_ranks()
            self.event(Started, world_size=self.world_size, devices=self.devices,
                       reason=self.engine_reason, device_indices=self.device_indices,
                       sandbox=self.sandbox.describe() if self.sandbox else None)
        spool_files.write_json_atomic(self.job_dir / "launcher.json", {
            "job_id": self.job_id, "pid": os.getpid(), "engine": self.engine,
            "engine_reason": self.engine_reason, "world_size": self.world_size,
            "spool": str(self.spool), "store": self.store.uri, "script": self.script,
            "args": list(self.options.args), **self.private_dirs_paths()})
        server, serve_loop = control.serve(self.job_dir, self.handle, on_sent=self._answer_sent)
        threading.Thread(target=serve_loop, daemon=True, name="meridian-control").start()
        if self.node_rank == 0:  # the store's one committer sweeps what killed writers left in it
            threading.Thread(target=self.store.sweep_abandoned, daemon=True, name="meridian-sweep").start()
        self.state = LaunchState.RUNNING
        try:
            return self.loop()
        finally:
            server.close()
            self.finish()

    def private_dirs_paths(self):
        """Returns {"private_tmp": ..., "private_shm": ...} (node paths) once made, else {}."""
        dirs = self.sandbox.private_dirs if self.sandbox is not None else None
        return {"private_tmp": str(dirs.tmp), "private_shm": str(dirs.shm)} if dirs is not None else {}

    def loop(self):
        progress_at = fence_at = 0.0
        while True:
            try:
                request, answer = self.commands.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                try:
                    result = self.execute(request)
                except Exception as exc:  # noqa: BLE001 - the client must always get an answer
                    # A refused or failed checkpoint/resize is an answer, not the job's end,
                    # unless a rank is gone.
                    error = str(exc) if isinstance(exc, LaunchError) else f"{type(exc).__name__}: {exc}"
                    result = ControlFailure(error=error)
                    self.event(CommandFailed, event=f"{request.cmd}_failed", error=error)
                    if any(r.poll() not in (None, 0) for r in self.ranks):
                        answer.put(result)
                        raise LaunchError(f"{request.cmd} failed and the job cannot go on: {error}",
                                          host_failure=getattr(exc, "host_failure", False)) from None
                answer.put(result)
                if isinstance(request, StopRequest) and isinstance(result, CheckpointAnswer):
                    self.state = LaunchState.STOPPED
                    self.event(Stopped, step=result.step, checkpoint=result.checkpoint)
                    # Exiting kills the control thread: let it deliver the answer first.
                    self._stop_answered.wait(timeout=30)
                    return EXIT_STOPPED
                if isinstance(request, StopRequest):
                    self.state = LaunchState.RUNNING
            if self.peers is not None:
                if failure := self.peers.check():
                    raise LaunchError(f"the job failed on another host ({failure}); this node's "
                                      "ranks are ended", host_failure=self.peers.host_failed)
                if self.node_rank > 0 and multihost.follow_cut(self) == "stopped":
                    self.state = LaunchState.STOPPED
                    return EXIT_STOPPED
            if self.check_ranks():
                if self.peers is not None:
                    multihost.finish_node(self.peers)
                if self.applying:  # a short resumed run: its ranks' files are there by now
                    self.check_applied()
                self.state = LaunchState.FINISHED
                ranks_view = self.ranks_progress()
                step = ranks_view.step if ranks_view else None
                self.event(Finished, step=step, note=None if step else NO_STEPS_NOTE)
                return EXIT_FINISHED
            if self.options.fence_file and time.monotonic() - fence_at > 1.0:
                fence_at = time.monotonic()
                if why := fence.fence_due(self.options.fence_file):
                    (self.job_dir / fence.FENCED_FILE).write_text(why)
                    raise LaunchError(why, EXIT_FENCED)  # the ranks are ended by finish()
            if time.monotonic() - progress_at > 0.5:
                progress_at = time.monotonic()
                self.write_progress()
                if self.applying:
                    self.check_applied()
                dirs = self.sandbox.private_dirs if self.sandbox is not None else None
                job_workspace.check_quota_now(self.workspace, self, tmp=dirs.tmp if dirs is not None else None)

    def finish(self):
        if any(r.poll() is None for r in self.ranks):
            self.kill_all()
        self.remove_private_dirs()
        self.leave_job_network()
        job_workspace.persist_at_end(self.workspace, self.state)
        rank_logs.keep(self)
        self.write_progress()
        if self._spool_lock is not None:
            # Ours, and nothing in it is needed any more (the ranks are gone, their logs copied,
            # a CRIU image carries its own): the spool root is often a tmpfs (/run/meridian).
            shutil.rmtree(self.spool, ignore_errors=True)
        # Drain commands that arrived while we were finishing, so no client hangs.
        while True:
            try:
                _, answer = self.commands.get_nowait()
            except queue.Empty:
                break
            answer.put(ControlFailure(error=f"the job is {self.state}"))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="meridian-run",
        description="Run an unmodified PyTorch script as a preemptible, resizable Meridian job.",
        # Everything after the script is the script's: without this, a script option that is a
        # prefix of ours (`--device` of --devices/--device-indices) was taken for ours and
        # failed the launch as ambiguous (found by bench/gpu_checks.py --device cpu).
        allow_abbrev=False)
    parser.add_argument("--ranks", type=int, required=True, help="world size W (fixed for the job)")
    parser.add_argument("--devices", type=int, default=None,
                        help="devices to map the W ranks onto (must divide W; default W, or the "
                             "number of --device-indices)")
    parser.add_argument("--device-indices", type=parse_device_indices, default=None,
                        help="comma-separated node-local indices of the devices given to the job "
                             "(e.g. 0,2,5; as many as --devices, or with --nodes N this host's share, "
                             "the devices of its block of ranks): its ranks are pinned to the cores behind "
                             f"them, and they are passed to the ranks as {DEVICE_INDICES_ENV} "
                             "(CUDA_VISIBLE_DEVICES on a GPU node)")
    parser.add_argument("--fold", action="store_true",
                        help="fold the ranks that share a device into one member of the communicator "
                             "between devices, as GPU (NCCL) jobs always do, on CPU devices too "
                             f"(tests, CI; sets {FOLD_ENV}=1 for the ranks: runtime/fold.py)")
    parser.add_argument("--engine", default="auto", choices=ENGINES,
                        help="checkpoint engine (auto: CRIU when `criu check` passes, else framework)")
    parser.add_argument("--job-dir", default=None,
                        help="job directory on this node (default ./meridian-jobs/<job-id>)")
    parser.add_argument("--job-id", default=None,
                        help="job id (default: the job directory's name); names the spool "
                             "$MERIDIAN_SPOOL_ROOT/<job-id> (default root /run/meridian)")
    parser.add_argument("--store", default=None,
                        help="checkpoint store URI or path (default <job-dir>/checkpoints)")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to retain")
    parser.add_argument("--fence-file", default=None, metavar="FILE",
                        help="the node agent's fence deadline (runtime/fence.py): past it, the ranks are "
                             "ended and the launcher exits 78 (the job runs on elsewhere)")
    parser.add_argument("--sandbox", default=None, metavar="FILE",
                        help="the job's sandbox (protocol.launch.SandboxSpec as JSON, written by the node agent): "
                             "the ranks run as its uid, in its cgroup, on the cores behind their devices, with "
                             "its environment only (runtime/sandbox.py)")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the newest good checkpoint in the store")
    parser.add_argument("--if-resume-refused", choices=("fail", "restart"), default="fail",
                        help="when the framework engine refuses a resume because the re-run is not the run "
                             "that was cut (unseeded, the script's own snapshot...): fail with the reason "
                             "(default), or start the script again from scratch")
    parser.add_argument("--nodes", type=int, default=1,
                        help="hosts the job spans (one meridian-run on each; must divide --ranks unless "
                             "--first-rank/--host-ranks give this host's block)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this host's place among --nodes (0 leads: it hosts the rendezvous)")
    parser.add_argument("--first-rank", type=int, default=None,
                        help="with --nodes > 1 and --host-ranks: the first rank of this host's block (the "
                             "control plane's share: W/d ranks per device this host holds; default: the "
                             "equal block node-rank*W/nodes)")
    parser.add_argument("--host-ranks", type=int, default=None,
                        help="with --first-rank: how many ranks this host runs, from --first-rank on "
                             "(whole devices: a multiple of W/d; the hosts' blocks tile 0..W-1 in node order)")
    parser.add_argument("--node-addr", default=os.environ.get("MERIDIAN_NODE_ADDR", "127.0.0.1"),
                        help="this host's address the other hosts reach (default $MERIDIAN_NODE_ADDR "
                             "or 127.0.0.1); its ranks bind gloo to it")
    parser.add_argument("--rendezvous", default=None,
                        help="with --nodes > 1: a folder of the store all hosts share, where the "
                             "leader publishes its address and run-time port")
    parser.add_argument("--rendezvous-timeout", type=float, default=300.0,
                        help="seconds a follower waits for the leader before it fails")
    parser.add_argument("--restore-manifest-sha256", default=None, type=_sha256_hex,
                        help="with --resume: restore only the checkpoint whose MANIFEST.json has this sha256 "
                             "(the node agent passes the digest the control plane recorded)")
    job_workspace.add_arguments(parser)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if options.job_dir is None:
        options.job_dir = os.path.join("meridian-jobs", options.job_id or uuid.uuid4().hex[:12])
    return options


def _terminate(signum, frame):
    raise LaunchError(f"terminated by signal {signum}; ranks killed, no checkpoint taken")


def main(argv=None):
    options = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM (an agent giving the devices back) ends the job like a failure: ranks are killed.
    signal.signal(signal.SIGTERM, _terminate)
    launcher = None
    try:
        launcher = Launcher(options)
        code = launcher.run()
    except LaunchError as exc:
        print(f"meridian-run: {exc}", file=sys.stderr)
        if launcher is not None and launcher.peers is not None:
            launcher.peers.report_failed(str(exc), host_failure=exc.host_failure)
        if launcher is not None:
            launcher.remove_private_dirs()  # also after a failure before the main loop (its finish)
            launcher.leave_job_network()
            launcher.state = "failed"
            try:
                launcher.event(Failed, error=str(exc), host_failure=exc.host_failure)
                launcher.write_progress()
            except OSError:
                pass
        return exc.code
    return code


if __name__ == "__main__":
    sys.exit(main())
