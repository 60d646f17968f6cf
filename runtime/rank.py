"""One rank process of a meridian-run job: sets up the runtime, then runs the user's script.

Started by the launcher as ``python -m runtime.rank --spool DIR script.py args...`` with the
torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) plus
MERIDIAN_JOB_DIR, MERIDIAN_ENGINE (criu|framework), MERIDIAN_RESUME (framework checkpoint
folder to resume from, or unset), MERIDIAN_NONCE (this launch attempt's rendezvous prefix) and,
when the launcher was given them, MERIDIAN_DEVICE_INDICES (the job's node-local device indices,
"0,2,5"; a resize or a CRIU resume that brings new ones updates it in the running rank).

Before the script runs: stdout goes to ``<spool>/rank<r>/out.log``, stderr to ``err.log`` (opened here, inside
the rank's PID namespace, so CRIU sees a plain file), one intra-op thread, the rank is pinned
to its device and holds its token, the virtual group replaces gloo, the framework tracker is
installed and the consistent-cut barrier listens to its optimizer steps.
"""
import argparse
import os
import runpy
import sys
import time

from protocol.cut import CutReport, CutRequest, CutStatus, DeviceMap, RankProgress, StateLoaded
from runtime import engines
from runtime.exits import end_children
from runtime.polling import PollingThread

DEVICE_INDICES_ENV = "MERIDIAN_DEVICE_INDICES"  # node-local indices of this job's devices, when known


def _redirect_output(out_path, err_path):
    for path, target in ((out_path, 1), (err_path, 2)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


class RankRuntime:
    """What the rank does at a consistent cut: a resize itself, a checkpoint or stop by its engine."""

    PROGRESS_INTERVAL_S = 0.5

    def __init__(self, *, rank, world_size, spool, engine, tracker, slot, connection):
        from runtime import spool as spool_files
        self.spool_files = spool_files
        self.rank = rank
        self.world_size = world_size
        self.spool = spool
        self.engine = engine  # an engines.Engine
        self.tracker = tracker
        self.slot = slot
        self.connection = connection
        self._progress_at = 0.0
        self._window = []  # (monotonic time, step) samples for steps/s
        self.cut_kind = None  # the kind of the cut being taken (runtime/cut.py), for the report

    # -- progress (rank 0 only) -----------------------------------------------------------
    def on_step(self, step):
        if self.rank != 0:
            return
        now = time.monotonic()
        if now - self._progress_at < self.PROGRESS_INTERVAL_S:
            return
        self.write_progress(step, now)

    def write_progress(self, step, now=None):
        now = time.monotonic() if now is None else now
        self._progress_at = now
        self._window.append((now, step))
        self._window = self._window[-10:]
        first_t, first_step = self._window[0]
        rate = (step - first_step) / (now - first_t) if now > first_t else None
        progress = RankProgress(step=step, steps_per_s=rate, engine=self.engine.name,
                                world_size=self.world_size, updated_unix=time.time())
        self.spool_files.write_json_atomic(os.path.join(self.spool, "progress.json"), progress.to_dict())

    def state_loaded(self, step: int, load_s: float, apply_s: float, device_bytes: int) -> None:
        """Tells the launcher how this framework-resumed rank's state came back (a StateLoaded)."""
        loaded = StateLoaded(rank=self.rank, step=step, load_s=round(load_s, 4),
                             apply_s=round(apply_s, 4), device_bytes=device_bytes)
        self.spool_files.write_json_atomic(self.spool_files.loaded_path(self.spool, self.rank), loaded.to_dict())

    # -- the cut ------------------------------------------------------------------------------
    def report(self, request: CutRequest, step: int, status: CutStatus, **fields) -> None:
        """Tells the launcher that this rank is `status` after `step` for `request` (a CutReport)."""
        fields.setdefault("cut_kind", self.cut_kind)
        report = CutReport(rank=self.rank, step=step, status=status, **fields)
        self.spool_files.write_json_atomic(
            self.spool_files.cut_report_path(self.spool, self.rank, request.id), report.to_dict())

    def on_cut(self, request: CutRequest, step: int, kind: str | None = None) -> None:
        self.cut_kind = kind
        if self.rank == 0:
            self.write_progress(step)
        if request.action == "resize":
            assert request.devices is not None  # CutRequest refuses a resize without its map
            self.refold(request)
            self.slot.release()
            self.move_to(request.devices, request.device_indices)
            self.slot.acquire()
            self.report(request, step, "resized", device=self.slot.device, cores=tuple(self.slot.cores))
            return
        self.engine.cut(self, request, step)

    def refold(self, request: CutRequest) -> None:
        """A folded group (runtime/fold.py) names its devices' members: closes it at a resize so
        that the next collective builds it on the new devices, under a rendezvous prefix of this
        request's own (every rank derives the same one). Unfolded groups do not depend on the
        devices and are kept. Called with the device token held (close_inner waits with it given
        away, and takes it back)."""
        from runtime import vpg
        group = vpg.current_group()
        if group is None or not group.folded:
            return
        group.close_inner()
        addr, port, _ = self.connection()
        self.connection.update(addr=addr, port=port,
                               prefix=f"{os.environ.get('MERIDIAN_NONCE', 'job')}/refold-{request.id}")

    def move_to(self, devices: DeviceMap, device_indices: tuple[int, ...] | None) -> None:
        """Moves this rank to its device in `devices` (token not held) and records the job's
        node-local device indices for the script (unset when the launcher does not know them)."""
        self.slot.apply(devices.plain())
        if device_indices is None:
            os.environ.pop(DEVICE_INDICES_ENV, None)
        else:
            os.environ[DEVICE_INDICES_ENV] = ",".join(map(str, device_indices))

    def resumed(self) -> None:
        """Called by the engine when this rank goes on after being parked at a cut."""
        self._progress_at = 0.0  # report the first step after a resume at once


# -- launcher liveness (both engines; the only mechanism that survives a CRIU dump/restore) --------
#
# The launcher holds an exclusive flock on <spool>/launcher.lock for as long as it lives (taken
# before any rank starts or is restored, released by the kernel when the launcher exits, however
# it dies). A rank probes the lock without blocking: if it can take a shared lock, or the file is
# gone, nobody holds the job any more and the rank ends itself. Nothing about the probe lives in
# the process between probes (no open fd, no parent-death signal, no pid), so it works the same
# after a restore, inside the rank's own PID namespace, and on another node: the spool path is the
# same everywhere and every launcher takes the lock there before it restores a rank. The lock
# file stays empty, so even a probe's fd caught open by a dump restores (CRIU needs the same size).

LAUNCHER_LOCK = "launcher.lock"
LAUNCHER_CHECK_S = 0.25
EXIT_LAUNCHER_GONE = 70


def launcher_lock_path(spool):
    return os.path.join(str(spool), LAUNCHER_LOCK)


def hold_launcher_lock(spool, wait_s=2.0):
    """Called by the launcher: creates <spool>/launcher.lock and holds an exclusive flock on it
    until the returned fd is closed (at the launcher's exit, whatever ends it). Raises
    BlockingIOError when another live launcher holds it (a rank of a dead launcher probing it
    holds it for microseconds only: retried for ``wait_s``)."""
    import fcntl
    os.makedirs(str(spool), exist_ok=True)
    fd = os.open(launcher_lock_path(spool), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise
            time.sleep(0.01)


def launcher_alive(spool):
    """True while a launcher holds <spool>/launcher.lock. Never blocks."""
    import fcntl
    try:
        fd = os.open(launcher_lock_path(spool), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # the spool is gone: the job was torn down
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock, if we got it
    return False


def _launcher_gone(spool):
    try:
        sys.stderr.write(f"meridian rank {os.getpid()}: the launcher holding "
                         f"{launcher_lock_path(spool)} is gone; this rank ends\n")
        sys.stderr.flush()
    finally:
        end_children()
        os._exit(EXIT_LAUNCHER_GONE)


class LauncherWatch(PollingThread):
    """Ends this rank when its launcher is gone: a daemon thread probes every LAUNCHER_CHECK_S
    (so a rank blocked in a collective, parked at a cut or loading data ends too; collectives
    release the GIL while they wait), and the main thread probes at step boundaries as well.
    CRIU dumps and restores the thread with the rest of the process."""

    def __init__(self, spool, interval_s=LAUNCHER_CHECK_S):
        self.spool = str(spool)
        self.interval_s = interval_s
        self._checked_at = time.monotonic()

    thread_name = "meridian-launcher-watch"

    def check(self):
        self._checked_at = time.monotonic()
        if not launcher_alive(self.spool):
            _launcher_gone(self.spool)

    def on_step(self, step):
        if time.monotonic() - self._checked_at >= self.interval_s:
            self.check()


def _refuse_resume(rank_dir, exc):
    """The framework engine refused this resume: say why (for the launcher, whose job policy
    decides: fail, or restart from scratch) and end with EXIT_RESUME_REFUSED."""
    from runtime import exits
    from runtime import spool as spool_files
    sys.stderr.write(f"meridian rank: resume refused: {exc.reason}\n")
    sys.stderr.flush()
    spool_files.write_json_atomic(os.path.join(rank_dir, exits.REFUSED_FILE), {"reason": exc.reason})
    exits.end_children()
    os._exit(exits.EXIT_RESUME_REFUSED)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m runtime.rank")
    parser.add_argument("--spool", required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    engine = engines.engine_named(os.environ.get("MERIDIAN_ENGINE", "criu"))
    engine.start_rank()
    spool = os.path.abspath(options.spool)
    rank_dir = os.path.join(spool, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    # The job's workspace (runtime/workspace.py) when it has one: relative paths work as on the user's laptop.
    os.chdir(os.environ.get("MERIDIAN_WORKSPACE") or rank_dir)
    _redirect_output(os.path.join(rank_dir, "out.log"), os.path.join(rank_dir, "err.log"))
    watch = LauncherWatch(spool).start()
    watch.check()  # the launcher may have died before this rank started

    import torch
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    from runtime import cut, splice, vpg
    from runtime import spool as spool_files
    slot = splice.DeviceSlot(spool=spool, rank=rank)
    slot.apply(DeviceMap.from_dict(spool_files.read_json(os.path.join(spool, "devices.json"))).plain())
    slot.acquire()

    connection = {"addr": os.environ["MASTER_ADDR"], "port": int(os.environ["MASTER_PORT"]),
                  "prefix": f"{os.environ.get('MERIDIAN_NONCE', 'job')}/start"}

    class Connection:
        def __call__(self):
            return connection["addr"], connection["port"], connection["prefix"]

        def update(self, *, addr, port, prefix):
            connection.update(addr=addr, port=int(port), prefix=prefix)

    vpg.install(rank=rank, world_size=world_size, connection=Connection(), hooks=slot)

    resume_dir = os.environ.get("MERIDIAN_RESUME") or None
    from runtime import framework
    try:
        tracker = framework.install(rank=rank, world_size=world_size, resume_dir=resume_dir)
    except framework.UnresumableScript as exc:
        _refuse_resume(rank_dir, exc)

    runtime = RankRuntime(rank=rank, world_size=world_size, spool=spool, engine=engine,
                          tracker=tracker, slot=slot, connection=Connection())
    tracker.on_applied = runtime.state_loaded
    tracker.add_step_listener(watch.on_step)
    tracker.add_step_listener(runtime.on_step)
    barrier = cut.CutBarrier(spool=spool, on_cut=runtime.on_cut, step_of=lambda: tracker.step)
    tracker.add_step_listener(barrier)
    cut.watch_between_steps(barrier, engine=engine, runtime=runtime, world_size=world_size)

    script = os.path.abspath(options.script)
    sys.argv = [script] + list(options.args)
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except framework.UnresumableScript as exc:
        if resume_dir is None:
            raise
        _refuse_resume(rank_dir, exc)

    if rank == 0:
        runtime.write_progress(tracker.step)
    spool_files.write_json_atomic(os.path.join(rank_dir, "finished.json"),
                                  {"rank": rank, "step": tracker.step})
    group = vpg.current_group()
    if group is not None and group.inner is not None:
        barrier.drain()
    if group is not None:
        group.close_inner()
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
