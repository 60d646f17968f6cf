"""The folding checks of bench/gpu_checks.py (issue 17 §2), for a machine with one NVIDIA GPU.

UNPROVEN ON GPU until this has run on one (it was written on a machine without; its CPU dry run,
bench/gpu_checks.py --device cpu, runs every line of it over gloo with meridian-run --fold, in CI).
The fold's CUDA path is runtime/cudagroup.py. On one GPU every rank of a job folds onto the one
physical device (the fold's key there is the GPU, not the launcher's logical device), so the
members' NCCL communicator is never built: the cross-device path needs two GPUs and stays
unproven here.

Checks, each a meridian-run job (or a plain process) under its own timeout, never hanging:
1. W = 4 folded on the GPU with 4, 2 and 1 logical devices: the same final bits (the unfolded
   layout, 4 ranks as 4 members of an NCCL communicator, is what NCCL refuses on one GPU: the
   4-logical-device run is the reference);
2. W = 4 resized 4 -> 2 -> 1 -> 4 while it runs: the same bits as the uninterrupted run;
3. W = 2 folded on 2 and 1 logical devices: the same bits as each other;
4. W = 2 spliced on the one GPU, started as a node agent starts a GPU job (a sandbox spec saying
   GPU, unconfined, device index 0), the script picking its GPU as cuda:LOCAL_RANK: both ranks are
   told LOCAL_RANK 0 (their shared GPU; before session 26 rank 1 was told 1, and cuda:1 does not
   exist on one GPU) and it ends with the bits of check 3's run on 2 logical devices;
5. cost per step of the fold: a plain DDP process over NCCL (W = 1, no meridian-run) against the
   same script under meridian-run at W = 1, 2 and 4 on the one GPU (time per optimizer step of
   the job, all ranks time-sliced on the device).
With --device cpu: gloo instead of NCCL, CPU tensors, a narrower cost model; W ranks on d CPU
devices fold onto d members (not 1: the fold's key is the logical device there).

Usage: python3 bench/gpu_fold_checks.py [--device cuda|cpu] [--timeout-s 150]
(or through bench/gpu_checks.py, which adds the budget and the JSON)
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_harness import (  # noqa: E402
    STARTED,
    BenchJob,
    Budget,
    CheckRow,
    exit_code,
    print_table,
    run_check,
    run_job,
    same_final_state,
)

DDP_SCRIPT = ROOT / "tests" / "runtime" / "scripts" / "ddp_mlp.py"
RESIZES = ((2, 6), (1, 14), (4, 24))  # (devices, after step) of the 40-step W = 4 job

# The cost worker: a DDP MLP of 4 layers `width` wide, `steps` steps, then the median step time
# (ms) of the last half. RANK/WORLD_SIZE/MASTER_* from env. argv: steps backend width.
COST_WORKER = r"""
import os, statistics, sys, time, torch, torch.distributed as dist
steps, backend, width = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group(backend)
cuda = backend == "nccl"
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
sync = torch.cuda.synchronize if cuda else (lambda: None)
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(5 + dist.get_rank())
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
x = torch.randn(64, width, device=device)
times = []
for step in range(steps):
    sync()
    started = time.perf_counter()
    optimizer.zero_grad()
    ddp(x).square().mean().backward()
    optimizer.step()
    sync()
    times.append(time.perf_counter() - started)
if dist.get_rank() == 0:
    print("STEP_MS", 1e3 * statistics.median(times[steps // 2:]), flush=True)
dist.destroy_process_group()
"""


class FoldChecks:
    """Checks 1-4 of the module docstring on `device` ("cuda" or "cpu"), under `work`."""

    def __init__(self, work, *, device: str, budget: Budget, step_timeout_s: float):
        self.work = pathlib.Path(work)
        self.device = device
        self.budget = budget
        self.step_timeout_s = step_timeout_s
        self.cuda = device == "cuda"
        self.backend = "nccl" if self.cuda else "gloo"
        self.cost_steps, self.cost_width = (200, 2048) if self.cuda else (20, 64)

    def expected_fold_devices(self, devices: int) -> int:
        """The devices a job on `devices` logical devices folds onto: the one GPU, or on CPU the
        logical devices themselves."""
        return 1 if self.cuda else devices

    def ddp_run(self, name, ranks, devices, resize=None, extra=(), launcher_args=()):
        """Runs ddp_mlp.py at W = ranks on `devices` devices (the launcher given `launcher_args` too);
        returns (final state or None, exit code, output, seconds)."""
        out = self.work / f"{name}.pt"
        args = [out, "--epochs", "10", "--backend", self.backend] + list(extra)
        timeout_s = self.budget.timeout(self.step_timeout_s)
        if resize:
            rc, text, seconds = _run_resized(self.work / name, ranks=ranks, devices=devices, script=DDP_SCRIPT,
                                             script_args=args, fold=not self.cuda, resize=resize, timeout_s=timeout_s)
        else:
            rc, text, seconds = run_job(self.work / name, ranks=ranks, devices=devices, script=DDP_SCRIPT,
                                        script_args=args, fold=not self.cuda, timeout_s=timeout_s, budget=self.budget,
                                        launcher_args=launcher_args)
        return (out if rc == 0 and out.exists() else None), rc, text, seconds

    def layouts(self, ranks: int, layouts: tuple) -> list:
        """W = ranks on each of `layouts` logical device counts: folded as expected, and the same
        bits as the first layout's run."""
        rows = []
        reference, reference_devices = None, None
        for devices in layouts:
            name = f"fold: W={ranks} on {devices} logical device(s)"
            out, rc, text, seconds = self.ddp_run(f"w{ranks}-d{devices}", ranks, devices)
            if out is None:
                rows.append(CheckRow(name, seconds, "timeout" if rc == "timeout" else "failed", False,
                                     f"rc {rc}: {text[-400:]}"))
                continue
            onto = self.expected_fold_devices(devices)
            folded = f"folded {ranks} ranks onto {onto} device(s)" in text
            if reference is None:
                reference, reference_devices = out, devices
            same, what = same_final_state(reference, out)
            rows.append(CheckRow(name, seconds, "ok" if same and folded else "failed", same,
                                 f"folded onto {onto} device(s): {folded}; against d={reference_devices}: {what}"))
        return rows

    def resized(self) -> list:
        """W = 4 resized 4 -> 2 -> 1 -> 4 against the uninterrupted W = 4 run on 4 devices."""
        name = "fold: W=4 resized 4->2->1->4"
        reference = self.work / "w4-d4.pt"
        if not reference.exists():
            return [CheckRow(name, 0.0, "skipped", None, "skipped: no uninterrupted W=4 run to compare with")]
        out, rc, text, seconds = self.ddp_run("w4-resized", 4, 4, resize=RESIZES, extra=["--step-sleep", "0.05"])
        if out is None:
            return [CheckRow(name, seconds, "timeout" if rc == "timeout" else "failed", False,
                             f"rc {rc}: {text[-400:]}")]
        refolded = all(f"folded 4 ranks onto {self.expected_fold_devices(d)} device(s)" in text for d, _ in RESIZES)
        same, what = same_final_state(reference, out)
        return [CheckRow(name, seconds, "ok" if same and refolded else "failed", same,
                         f"refolded at each resize: {refolded}; against uninterrupted: {what}")]

    def by_local_rank(self) -> list:
        """Check 4: W = 2 on the one GPU (one device) under an agent's GPU spec, the script on
        cuda:LOCAL_RANK, against the W = 2 run on 2 logical devices. On CPU the same launch (the
        ranks are told CUDA_VISIBLE_DEVICES=0, which CPU tensors ignore) proves the environment."""
        from protocol.launch import SandboxSpec

        name = "fold: W=2 on 1 GPU, script on cuda:LOCAL_RANK (agent's GPU spec)"
        reference = self.work / "w2-d2.pt"
        if not reference.exists():
            return [CheckRow(name, 0.0, "skipped", None, "skipped: no W=2 run on 2 devices to compare with")]
        spec = self.work / "gpu-spec.json"
        # The ranks get only the spec's environment (as an agent's do): the loader path this machine's
        # CUDA build of torch may need is passed on.
        passed = {name: os.environ[name] for name in ("LD_LIBRARY_PATH",) if name in os.environ}
        spec.write_text(json.dumps(SandboxSpec(
            unconfined_reason="bench/gpu_fold_checks.py: an agent's GPU job, unconfined", device_kind="gpu",
            node_devices=1, node_cores=tuple(sorted(os.sched_getaffinity(0))), env=passed).to_dict()))
        out, rc, text, seconds = self.ddp_run("w2-local-rank", 2, 1, extra=["--gpu-by-local-rank"],
                                              launcher_args=["--sandbox", spec, "--device-indices", "0"])
        if out is None:
            return [CheckRow(name, seconds, "timeout" if rc == "timeout" else "failed", False,
                             f"rc {rc}: {text[-400:]}")]
        told = all(f"rank {rank}: LOCAL_RANK 0 of LOCAL_WORLD_SIZE 1," in text for rank in (0, 1))
        same, what = same_final_state(reference, out)
        return [CheckRow(name, seconds, "ok" if same and told else "failed", same,
                         f"both ranks told LOCAL_RANK 0 of 1: {told}; against d=2: {what}")]

    def cost(self) -> list:
        """The fold's time per step against plain DDP (no meridian-run) at W = 1."""
        rows = []
        worker = self.work / "cost_worker.py"
        worker.write_text(COST_WORKER)
        worker_args = [str(self.cost_steps), self.backend, str(self.cost_width)]
        plain_name = f"cost: plain DDP over {self.backend}, W=1"
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(29500 + os.getpid() % 1000))
        timeout_s = self.budget.timeout(self.step_timeout_s)
        started = time.monotonic()
        plain = subprocess.Popen([sys.executable, str(worker)] + worker_args, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        STARTED.append(plain)
        try:
            stdout, stderr = plain.communicate(timeout=timeout_s)
            plain_ms = step_ms(stdout)
            rows.append(CheckRow(plain_name, time.monotonic() - started, "ok" if plain_ms is not None else "failed",
                                 None, f"{plain_ms:.3f} ms/step" if plain_ms is not None else stderr[-300:]))
        except subprocess.TimeoutExpired:
            plain.kill()
            plain.communicate()
            plain_ms = None
            rows.append(CheckRow(plain_name, timeout_s, "timeout", None, "timeout"))
        for ranks in (1, 2, 4):
            rc, text, seconds = run_job(self.work / f"cost-w{ranks}", ranks=ranks, devices=ranks, script=worker,
                                        script_args=worker_args, fold=not self.cuda,
                                        timeout_s=self.budget.timeout(self.step_timeout_s), budget=self.budget)
            ms = step_ms(text)
            ratio = f", {ms / plain_ms:.2f}x plain W=1" if ms is not None and plain_ms else ""
            result = "ok" if rc == 0 and ms is not None else ("timeout" if rc == "timeout" else "failed")
            detail = f"{ms:.3f} ms/step of the job{ratio}" if ms is not None else f"rc {rc}: {text[-300:]}"
            rows.append(CheckRow(f"cost: meridian-run folded, W={ranks}", seconds, result, None, detail))
        return rows


def _run_resized(job_dir, *, resize, timeout_s, **job_args):
    """Runs one meridian-run job, asking for each (devices, after step) of `resize` through its
    control socket while it runs; returns (exit code, "timeout" or "error: <why>"; output; seconds)."""
    from runtime.control import JobControlError

    job = BenchJob(job_dir, **job_args)
    deadline = time.monotonic() + timeout_s
    try:
        job.wait_ready(timeout_s)
        control = job.control()
        for devices, at_step in resize:
            control.resize(devices, at_step=at_step, timeout_s=max(1.0, deadline - time.monotonic()))
    except (JobControlError, RuntimeError, OSError) as exc:
        job.kill()
        return f"error: {exc}", job.output(), job.seconds()
    rc = job.wait(deadline - time.monotonic())
    return rc, job.output(), job.seconds()


def step_ms(text):
    """The STEP_MS figure a cost worker printed, or None."""
    for line in text.splitlines():
        if line.startswith("STEP_MS"):
            return float(line.split()[1])
    return None


def fold_check_plan(work, *, device: str, budget: Budget, step_timeout_s: float):
    """Returns (proofs, measures): lists of (name, estimate function, check) in the order to run
    them (the W = 4 layouts first: the resize compares against their 4-device run); the caller
    runs the measures (cost per step) after the other checks' proofs."""
    checks = FoldChecks(work, device=device, budget=budget, step_timeout_s=step_timeout_s)
    proofs = [("fold: W=4 layouts", lambda: 3 * budget.launch_s, lambda: checks.layouts(4, (4, 2, 1))),
              ("fold: W=2 layouts", lambda: 2 * budget.launch_s, lambda: checks.layouts(2, (2, 1))),
              ("fold: W=4 resized", lambda: 2 * budget.launch_s, checks.resized),
              ("fold: W=2 by LOCAL_RANK", lambda: budget.launch_s, checks.by_local_rank)]
    return proofs, [("fold: cost per step", lambda: 4 * budget.launch_s, checks.cost)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="limit of each job")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip what would not fit in this")
    args = parser.parse_args()
    if args.device == "cuda":
        from runtime import cudagroup

        missing = cudagroup.cuda_missing()
        if missing is not None:
            print(f"no GPU: {missing}; the fold checks need one (--device cpu: the dry run)")
            return 2
    budget = Budget(args.budget_s)
    rows: list = []
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpu-fold-"))
    proofs, measures = fold_check_plan(work, device=args.device, budget=budget, step_timeout_s=args.timeout_s)
    for name, estimate, check in proofs + measures:
        run_check(rows, name, estimate(), budget, check)
    print_table(rows, title=f"fold checks ({args.device})")
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
