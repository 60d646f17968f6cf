"""GPU checks in one go, for a lent machine with one NVIDIA GPU (CI has none), issue 17's Proof list.

In this order (what was never run first; each check under its own timeout, the whole under
--budget-s: a check whose estimate does not fit what is left is skipped and its row says so):
1. whole jobs (bench/gpu_job_checks.py): a single-process GPU training job under meridian-run,
   framework engine, stopped at a cut and resumed by a new launcher in a new PID namespace,
   bit-exact (parameters, Adam state, CPU and CUDA RNG) to an uninterrupted run; the same under
   --engine criu (the driver moves the rank's CUDA state to host memory around the dump and back
   after the restore into a new process and PID namespace on the same GPU: runtime/criu_cuda.py),
   skipped where CRIU is not installed.
2. folding (bench/gpu_fold_checks.py, issue 17 §2): W = 4 and W = 2 folded on the one GPU over
   several logical devices, bit-exact against each other; W = 4 resized 4 -> 2 -> 1 -> 4 bit-exact
   to the uninterrupted run; the fold's cost per step against plain DDP over NCCL (a measure, not
   a proof: run after check 3).
3. time-slicing two ranks whose memory does not fit on the GPU at once (each > half of it), sized
   to this host's RAM (both parked ranks live there at once): A runs, is swapped out; B runs, is
   swapped out; A in and finishes; B in and finishes; both hashes equal their uninterrupted runs'.
4. the CUDA driver checkpoint API (runtime/cuda_checkpoint.py): a process holding S GiB of
   device state swapped out to the host between steps and back in, its final hash equal to an
   uninterrupted run's, its device memory released while out (NVML, agent/devices.py).

UNPROVEN ON GPU: checks 1-3 have never run on one (no GPU was lent since they were written); the
estimates that decide what fits the budget are guesses until then (the first job's launch time
is measured and used for the rest). Check 4 and NVML ran once on an H200 (figures below).
Multi-GPU NCCL (the members' communicator between GPUs) cannot be tested on one GPU at all.

--device cpu is the dry run, in CI (tests/runtime/test_gpu_checks_dry_run.py): the same harness,
command lines, timeouts, result parsers and table rows on CPU (gloo instead of NCCL, CPU tensors,
tiny sizes; SIGSTOP/SIGCONT stand in for the CUDA checkpoint API in 3 and 4, which says nothing
about that API: only that the harness around it works).

Prints a table; also writes it as JSON to --json, or to $OUT/gpu_checks.json when $OUT is set (the
device tool returns what is under $OUT). Exit code: 0 every row ok or skipped, 1 otherwise, 2 no
GPU (with --device cuda), 3 the watchdog ended the run (budget + grace passed).

Usage: python3 bench/gpu_checks.py [--device cuda|cpu] [--checks job,fold,slice,swap]
       [--budget-s 420] [--step-timeout-s 150] [--sizes 1] [--slice-gib auto] [--json PATH]

On a lent machine (no package registry there, no CRIU so far): first, here,
`bash scripts/pack-criu-for-device.sh` (CRIU and its libraries into .device/criu), then
run(carry=[".device"], timeout_s=540, command='PATH=$PWD/.device/criu/bin:$PATH PYTHONUNBUFFERED=1
python3 bench/gpu_checks.py 2>&1 | tee $OUT/gpu_checks.log'); CRIU needs root there too.

Measured on an H200 (driver 580.159.04, 125 GiB host RAM), check 4: 1 / 16 / 60 GiB swapped out in
1.8 / 11.4 / 42.2 s and in in 0.4 / 3.3 / 10.6 s, all bit-exact. Two 80 GiB ranks time-sliced failed
there (restore -> CUresult 3), most likely because both parked ranks needed 160 GiB of host RAM; so
check 3 sizes its ranks to the host's RAM and skips, saying why, where no size fits.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_harness import (  # noqa: E402
    STARTED,
    Budget,
    CheckRow,
    Watchdog,
    exit_code,
    json_path,
    kill_started,
    print_table,
    run_check,
    write_json,
)

CHECKS = ("job", "fold", "slice", "swap")
DEFAULT_SIZES = {"cuda": "1", "cpu": "0.01"}  # 1 / 16 / 60 GiB were proven on the H200 already
CPU_SLICE_GIB = 0.02
WATCHDOG_GRACE_S = 45
HOST_RAM_MARGIN_GIB = 8  # what the host keeps for everything else while two ranks are parked
# One worker's start (python, torch, CUDA context): a guess. Out and in per GiB: the H200 run of
# check 4 measured 0.7 s out and 0.18 s in per GiB (fill and steps at GPU speed are negligible).
WORKER_START_S = {"cuda": 10.0, "cpu": 3.0}
SWAP_S_PER_GIB = {"cuda": 1.0, "cpu": 0.5}

# The worker: S GiB of float32 state plus a small matmul model, updated deterministically for
# `steps` steps; after steps // 2 it prints PAUSE and waits for a line on stdin before going on.
# argv: gib steps seed device width.
WORKER = r"""
import sys, torch
gib, steps, seed, device, width = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
cuda = device == "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator(device=device).manual_seed(seed)
n = int(gib * 2**30 // 4)
state = torch.empty(n, device=device, dtype=torch.float32)
chunk = 2**28
for i in range(0, n, chunk):
    state[i:i + chunk].uniform_(-1, 1, generator=g)
w = torch.randn(width, width, device=device, generator=g) / (width ** 0.5)
x = torch.randn(width, 256, device=device, generator=g)
sync = torch.cuda.synchronize if cuda else (lambda: None)
def step(k):
    global w
    y = torch.tanh(w @ x)
    w = w - 1e-3 * (y @ x.T) / 256
    for i in range(0, n, chunk):
        part = state[i:i + chunk]
        part.mul_(0.999).add_(float(w[k % width, k % width]))
for k in range(steps // 2):
    step(k)
sync()
print("PAUSE", flush=True)
sys.stdin.readline()
for k in range(steps // 2, steps):
    step(k)
sync()
h = 0
for i in range(0, n, chunk):
    h = (h * 1000003 + int(state[i:i + chunk].view(torch.int32).to(torch.int64).sum().item())) % (2**61 - 1)
h = (h * 1000003 + int(w.view(torch.int32).to(torch.int64).sum().item())) % (2**61 - 1)
print("HASH", h, flush=True)
"""


class CudaParking:
    """Parks a worker's device memory on the host with the CUDA driver checkpoint API."""

    stands_in = ""

    def __init__(self, pid):
        from runtime.cuda_checkpoint import CudaProcessCheckpoint
        self.cuda = CudaProcessCheckpoint(pid)

    def park(self):
        self.cuda.swap_out()
        state = self.cuda.state()
        if state != "checkpointed":
            raise RuntimeError(f"after swap_out the process is {state}, not checkpointed")

    def unpark(self):
        self.cuda.swap_in()
        state = self.cuda.state()
        if state != "running":
            raise RuntimeError(f"after swap_in the process is {state}, not running")


class SignalParking:
    """The dry run's stand-in: SIGSTOP / SIGCONT (says nothing about the CUDA checkpoint API)."""

    stands_in = "cpu dry run: SIGSTOP/SIGCONT stand in for the CUDA checkpoint API"

    def __init__(self, pid):
        self.pid = pid

    def park(self):
        os.kill(self.pid, signal.SIGSTOP)
        _await_task_state(self.pid, lambda state: state == "T", "stopped")

    def unpark(self):
        os.kill(self.pid, signal.SIGCONT)
        _await_task_state(self.pid, lambda state: state != "T", "running again")


def _await_task_state(pid, wanted, words, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as handle:
            if wanted(handle.read().rsplit(")", 1)[1].split()[0]):
                return
        time.sleep(0.01)
    raise RuntimeError(f"worker {pid} was not {words} within {timeout_s} s")


class Worker:
    """One worker process (WORKER) holding `gib` GiB on `device`, started and run to its pause."""

    def __init__(self, gib, *, device, timeout_s, seed=0, steps=8):
        self.gib = gib
        self.timeout_s = timeout_s
        width = 2048 if device == "cuda" else 256
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(gib), str(steps), str(seed), device,
                                      str(width)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        STARTED.append(self.proc)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        line = self._line()
        if line != "PAUSE":
            raise RuntimeError(f"worker ({gib:g} GiB) did not reach its pause: {line!r} {self._stderr()}")
        self.parking = (CudaParking if device == "cuda" else SignalParking)(self.proc.pid)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)  # end of output

    def _line(self):
        try:
            return self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.proc.kill()
            raise RuntimeError(f"worker ({self.gib:g} GiB) printed nothing within {self.timeout_s:.0f} s") from None

    def _stderr(self):
        if self.proc.poll() is None:
            return ""
        return (self.proc.stderr.read() or "")[-400:]

    def timed(self, action):
        started = time.perf_counter()
        action()
        return time.perf_counter() - started

    def finish(self):
        """Lets it go on from its pause; returns its final hash."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self._line()
        try:
            self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not line or not line.startswith("HASH "):
            raise RuntimeError(f"worker ({self.gib:g} GiB) ended without a hash: {line!r} {self._stderr()}")
        return int(line.split()[1])


class MemoryChecks:
    """Checks 3 and 4 of the module docstring."""

    def __init__(self, *, device, budget, step_timeout_s):
        self.device = device
        self.budget = budget
        self.step_timeout_s = step_timeout_s

    def worker(self, gib, seed):
        return Worker(gib, device=self.device, seed=seed, timeout_s=self.budget.timeout(self.step_timeout_s))

    def reference_hash(self, gib, seed):
        return self.worker(gib, seed).finish()

    def used_gib(self):
        """GPU memory in use (NVML), None on CPU."""
        if self.device != "cuda":
            return None
        from agent.devices import Devices
        return Devices("auto").sample()["devices"][0]["memory_used_gb"]

    def swap(self, gib) -> list:
        name = f"swap {gib:g} GiB out and in"
        started = time.monotonic()
        expected = self.reference_hash(gib, seed=1)
        worker = self.worker(gib, seed=1)
        before = self.used_gib()
        out_s = worker.timed(worker.parking.park)
        during = self.used_gib()
        in_s = worker.timed(worker.parking.unpark)
        exact = worker.finish() == expected
        memory = (f"; GPU memory used {before:.1f} -> {during:.1f} GiB while out" if before is not None else "")
        stand_in = f"; {worker.parking.stands_in}" if worker.parking.stands_in else ""
        return [CheckRow(name, time.monotonic() - started, "ok" if exact else "failed", exact,
                         f"out {out_s:.2f} s, in {in_s:.2f} s{memory}{stand_in}")]

    def slice(self, gib) -> list:
        started = time.monotonic()
        expected_a, expected_b = self.reference_hash(gib, seed=2), self.reference_hash(gib, seed=3)
        a = self.worker(gib, seed=2)
        a_out = a.timed(a.parking.park)
        b = self.worker(gib, seed=3)  # on a GPU it fits only because A's memory went to the host
        b_out = b.timed(b.parking.park)
        a_in = a.timed(a.parking.unpark)
        hash_a = a.finish()
        b_in = b.timed(b.parking.unpark)
        hash_b = b.finish()
        seconds = time.monotonic() - started
        stand_in = f"; {a.parking.stands_in}" if a.parking.stands_in else ""
        return [CheckRow(f"slice 2 x {gib:g} GiB: A", seconds, "ok" if hash_a == expected_a else "failed",
                         hash_a == expected_a, f"out {a_out:.2f} s, in {a_in:.2f} s{stand_in}"),
                CheckRow(f"slice 2 x {gib:g} GiB: B", 0.0, "ok" if hash_b == expected_b else "failed",
                         hash_b == expected_b, f"out {b_out:.2f} s, in {b_in:.2f} s{stand_in}")]

    def swap_estimate(self, gib):
        return 2 * WORKER_START_S[self.device] + gib * SWAP_S_PER_GIB[self.device]

    def slice_estimate(self, gib):
        return 4 * WORKER_START_S[self.device] + 2 * gib * SWAP_S_PER_GIB[self.device]


def slice_size(requested, *, device, gpu_gib, host_gib) -> tuple[float | None, str]:
    """Returns (GiB per rank for check 3, why) or (None, why it is skipped). "auto": on a GPU just
    over half its memory (two ranks must not fit at once), on CPU a tiny size; any size needs host
    RAM for both ranks parked at once."""
    if requested == "auto":
        if device != "cuda":
            gib = CPU_SLICE_GIB
        elif not gpu_gib:
            return None, "skipped: the GPU's memory is unknown (NVML), so no size is known not to fit twice"
        else:
            gib = float(int(gpu_gib / 2) + 2)
    else:
        gib = float(requested)
    if gib <= 0:
        return None, "skipped: --slice-gib 0"
    if 2 * gib + HOST_RAM_MARGIN_GIB > host_gib:
        return None, (f"skipped: two parked {gib:g} GiB ranks need {2 * gib + HOST_RAM_MARGIN_GIB:.0f} GiB of "
                      f"host RAM, this host has {host_gib:.0f} GiB"
                      + (f" (no size both exceeds half of the GPU's {gpu_gib:g} GiB and fits)" if gpu_gib else ""))
    return gib, ""


def host_ram_gib():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


class NvmlCheck:
    """The agent's device layer (agent/devices.py): NVML on a GPU, CPU slots in the dry run. Keeps
    the first GPU's memory in GiB (gpu_gib; None on CPU or when NVML failed) for check 3's size."""

    def __init__(self, device):
        self.device = device
        self.gpu_gib = None

    def __call__(self) -> list:
        from agent.devices import Devices
        started = time.monotonic()
        devices = Devices("auto" if self.device == "cuda" else "cpu:1")
        described = devices.describe()
        sample = devices.sample()
        if self.device == "cuda" and described:
            self.gpu_gib = described[0]["memory_gb"]
        ok = bool(described) and (self.device != "cuda" or described[0]["type"] != "CPU")
        return [CheckRow(f"NVML telemetry ({self.device})", time.monotonic() - started, "ok" if ok else "failed",
                         None, f"describe {described[:2]}; sample: {sample.get('memory_used_gb')} GiB used")]


def no_gpu_reason():
    """Why --device cuda cannot run here, or None."""
    from runtime import cudagroup
    from runtime.cuda_checkpoint import CudaCheckpointUnavailable, load_driver
    try:
        load_driver()
    except CudaCheckpointUnavailable as exc:
        return str(exc)
    return cudagroup.cuda_missing()


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: the checks; cpu: the dry run of the same harness")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"which of {', '.join(CHECKS)} to run")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="total time; a check that would not fit what is left is skipped (a row says so)")
    parser.add_argument("--step-timeout-s", type=float, default=150.0, help="limit of each job or worker step")
    parser.add_argument("--sizes", default=None, help="GiB of device state for check 4 (default 1; cpu 0.01)")
    parser.add_argument("--slice-gib", default="auto", help="GiB per rank for check 3, or auto")
    parser.add_argument("--json", default=None, help="also write the rows here (default $OUT/gpu_checks.json)")
    parser.add_argument("--work-dir", default=None, help="where jobs write (default a new temporary folder)")
    args = parser.parse_args(argv)
    args.checks = [name.strip() for name in args.checks.split(",") if name.strip()]
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    args.sizes = [float(size) for size in (args.sizes or DEFAULT_SIZES[args.device]).split(",") if size.strip()]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        missing = no_gpu_reason()
        if missing is not None:
            print(f"no GPU: no GPU checks possible here: {missing} (--device cpu runs the dry run)")
            return 2
    from bench.gpu_fold_checks import fold_check_plan
    from bench.gpu_job_checks import job_check_plan

    budget = Budget(args.budget_s)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-checks-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MERIDIAN_SPOOL_ROOT", str(work / "spool"))
    rows: list = []
    output = json_path(args.json)
    began = time.monotonic()

    def meta():
        import torch
        return {"device": args.device, "argv": sys.argv[1:] if argv is None else list(argv),
                "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                "budget_s": args.budget_s, "seconds": round(time.monotonic() - began, 1),
                "load_average": os.getloadavg(), "host_ram_gib": round(host_ram_gib(), 1)}

    def on_expire():
        kill_started()
        rows.append(CheckRow("watchdog", time.monotonic() - began, "error", None,
                             f"the run passed its budget of {args.budget_s:g} s plus grace; children killed"))
        print_table(rows, title=f"GPU checks ({args.device}), ended by the watchdog")
        write_json(output, rows, meta=meta())

    # Every step's timeout is capped at what is left of the budget; the grace covers a check's
    # last step and the table. 420 + 45 s stays under the 8 minutes issue 17 gives the script.
    watchdog = Watchdog(args.budget_s + WATCHDOG_GRACE_S, on_expire).start()
    try:
        nvml = NvmlCheck(args.device)
        run_check(rows, "NVML telemetry", 5.0, budget, nvml)
        plan, measures = [], []
        if "job" in args.checks:
            plan += job_check_plan(work / "job", device=args.device, budget=budget,
                                   step_timeout_s=args.step_timeout_s)
        if "fold" in args.checks:
            proofs, measures = fold_check_plan(work / "fold", device=args.device, budget=budget,
                                               step_timeout_s=args.step_timeout_s)
            plan += proofs
        memory = MemoryChecks(device=args.device, budget=budget, step_timeout_s=args.step_timeout_s)
        if "slice" in args.checks:
            gib, why = slice_size(args.slice_gib, device=args.device, gpu_gib=nvml.gpu_gib, host_gib=host_ram_gib())
            if gib is None:
                rows.append(CheckRow("slice: two ranks on one device", 0.0, "skipped", None, why))
            else:
                plan.append((f"slice 2 x {gib:g} GiB", lambda gib=gib: memory.slice_estimate(gib),
                             lambda gib=gib: memory.slice(gib)))
        plan += measures  # the fold's cost per step: a measure, after the proofs
        if "swap" in args.checks:
            for gib in args.sizes:
                plan.append((f"swap {gib:g} GiB", lambda gib=gib: memory.swap_estimate(gib),
                             lambda gib=gib: memory.swap(gib)))
        for name, estimate, check in plan:
            run_check(rows, name, estimate(), budget, check)
            write_json(output, rows, meta=meta())  # what is done survives a lease that ends now
    finally:
        watchdog.cancel()
        kill_started()
    print_table(rows, title=f"GPU checks ({args.device}), {time.monotonic() - began:.0f} s of a budget of "
                            f"{args.budget_s:g} s, load average {os.getloadavg()[0]:.1f}")
    write_json(output, rows, meta=meta())
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
