"""The folding checks of bench/gpu_checks.py (issue 17 §2), for a machine with one NVIDIA GPU.

UNPROVEN ON GPU until this has run on one (it was written on a machine without): the fold's CUDA
path is runtime/cudagroup.py. On one GPU every rank of a job folds onto the one physical device
(the fold's key there is the GPU, not the launcher's logical device), so the members' NCCL
communicator is never built: the cross-device path needs two GPUs and stays unproven here.

Checks, each a meridian-run job (or a plain process) under its own timeout, never hanging:
1. W = 4 folded on the GPU with 4, 2 and 1 logical devices: the same final bits (the unfolded
   layout, 4 ranks as 4 members of an NCCL communicator, is what NCCL refuses on one GPU: the
   4-logical-device run is the reference);
2. W = 4 resized 4 -> 2 -> 1 -> 4 while it runs: the same bits as the uninterrupted run;
3. W = 2 folded on 2 and 1 logical devices: the same bits as each other;
4. cost per step of the fold: a plain DDP process over NCCL (W = 1, no meridian-run) against the
   same script under meridian-run at W = 1, 2 and 4 on the one GPU (time per optimizer step of
   the job, all ranks time-sliced on the device).

Usage: python3 bench/gpu_fold_checks.py [--timeout-s 150]   (or through bench/gpu_checks.py)
"""
import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DDP_SCRIPT = ROOT / "tests" / "runtime" / "scripts" / "ddp_mlp.py"

# The cost worker: a DDP MLP of 4 x 2048-wide layers on the GPU, `steps` steps, then the median
# step time (ms) of the last half and a hash of the parameters. RANK/WORLD_SIZE/MASTER_* from env.
COST_WORKER = r"""
import os, statistics, sys, time, torch, torch.distributed as dist
steps = int(sys.argv[1])
dist.init_process_group("nccl")
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(5 + dist.get_rank())
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
x = torch.randn(64, 2048, device="cuda")
times = []
for step in range(steps):
    torch.cuda.synchronize()
    started = time.perf_counter()
    optimizer.zero_grad()
    ddp(x).square().mean().backward()
    optimizer.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - started)
if dist.get_rank() == 0:
    print("STEP_MS", 1e3 * statistics.median(times[steps // 2:]), flush=True)
dist.destroy_process_group()
"""


def _launcher(job_dir, *, ranks, devices, script, args, timeout_s, resize=None):
    """Runs one meridian-run job to its end (killed past timeout_s); returns (rc, output, seconds).
    resize: [(devices, at_step), ...] asked for through the control socket while it runs."""
    from runtime.control import JobControl, JobControlError

    command = [sys.executable, "-m", "runtime.launcher", "--ranks", str(ranks), "--devices", str(devices),
               "--engine", "framework", "--job-dir", str(job_dir), "--job-id", f"gpu-fold-{uuid.uuid4().hex[:8]}",
               str(script)] + list(args)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.perf_counter()
    log = open(pathlib.Path(job_dir).with_suffix(".log"), "wb")
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        if resize:
            control = JobControl(job_dir)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    control.progress()
                    break
                except (JobControlError, OSError):
                    time.sleep(0.1)
            for devices_now, at_step in resize:
                control.resize(devices_now, at_step=at_step, timeout_s=timeout_s)
        rc = process.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        rc = "timeout"
    except Exception as exc:  # noqa: BLE001 - a failed resize is a failed check, not a crash
        process.kill()
        process.wait()
        rc = f"error: {exc}"
    finally:
        log.close()
    seconds = time.perf_counter() - started
    text = pathlib.Path(job_dir).with_suffix(".log").read_text(errors="replace")
    for err in sorted(pathlib.Path(job_dir, "logs").glob("*.err")) if pathlib.Path(job_dir, "logs").is_dir() else []:
        text += err.read_text(errors="replace")
    return rc, text, seconds


def _same_state(first, second):
    import torch

    a, b = torch.load(first, weights_only=False, map_location="cpu"), torch.load(second, weights_only=False,
                                                                              map_location="cpu")
    if a["params"].keys() != b["params"].keys():
        return False
    if not all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]):
        return False
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not torch.equal(value, b["optimizer"]["state"][index][key]):
                return False
    return True


def fold_checks(timeout_s=150.0):
    """Returns rows (check, seconds, result, detail) for checks 1-4 of the module docstring."""
    rows = []
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpu-fold-"))
    args = ["--epochs", "10", "--backend", "nccl"]

    def ddp_run(name, ranks, devices, resize=None, extra=()):
        out = work / f"{name}.pt"
        rc, text, seconds = _launcher(work / name, ranks=ranks, devices=devices, script=DDP_SCRIPT,
                                      args=[str(out)] + args + list(extra), timeout_s=timeout_s, resize=resize)
        folded = f"folded {ranks} ranks onto 1 device(s)" in text
        return out if rc == 0 and out.exists() else None, rc, folded, seconds, text[-400:]

    # 1. and 3.: logical layouts on the one GPU.
    for ranks, layouts in ((4, (4, 2, 1)), (2, (2, 1))):
        reference = None
        for devices in layouts:
            out, rc, folded, seconds, tail = ddp_run(f"w{ranks}-d{devices}", ranks, devices)
            if out is None:
                rows.append((f"W={ranks} on {devices} logical device(s)", seconds, False, f"rc {rc}: {tail!r}"))
                continue
            reference = reference or out
            same = _same_state(reference, out)
            rows.append((f"W={ranks} on {devices} logical device(s)", seconds, same and folded,
                         f"folded onto the GPU: {folded}; same bits as d={layouts[0]}: {same}"))
    # 2.: resized while running, against the uninterrupted W = 4 run on 4 logical devices.
    reference = work / "w4-d4.pt"
    out, rc, folded, seconds, tail = ddp_run("w4-resized", 4, 4, resize=[(2, 6), (1, 14), (4, 24)],
                                             extra=["--step-sleep", "0.05"])
    same = out is not None and reference.exists() and _same_state(reference, out)
    rows.append(("W=4 resized 4->2->1->4", seconds, same, f"rc {rc}; same bits as uninterrupted: {same}"))
    # 4.: cost per step.
    rows.extend(_cost_rows(work, timeout_s))
    return rows


def _cost_rows(work, timeout_s, steps=200):
    rows = []
    worker = work / "cost_worker.py"
    worker.write_text(COST_WORKER)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000))
    started = time.perf_counter()
    try:
        plain = subprocess.run([sys.executable, str(worker), str(steps)], env=env, capture_output=True, text=True,
                               timeout=timeout_s)
        plain_ms = _step_ms(plain.stdout)
        rows.append(("cost: plain DDP over NCCL, W=1", time.perf_counter() - started, plain_ms is not None,
                     f"{plain_ms:.3f} ms/step" if plain_ms else plain.stderr[-300:]))
    except subprocess.TimeoutExpired:
        plain_ms = None
        rows.append(("cost: plain DDP over NCCL, W=1", timeout_s, False, "timeout"))
    for ranks in (1, 2, 4):
        rc, text, seconds = _launcher(work / f"cost-w{ranks}", ranks=ranks, devices=ranks, script=worker,
                                      args=[str(steps)], timeout_s=timeout_s)
        logs = pathlib.Path(work / f"cost-w{ranks}", "logs")
        for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
            text += log.read_text(errors="replace")
        ms = _step_ms(text)
        ratio = f", {ms / plain_ms:.2f}x plain W=1" if ms and plain_ms else ""
        rows.append((f"cost: meridian-run folded, W={ranks}", seconds, rc == 0 and ms is not None,
                     (f"{ms:.3f} ms/step of the job{ratio}" if ms else f"rc {rc}: {text[-300:]!r}")))
    return rows


def _step_ms(text):
    for line in text.splitlines():
        if line.startswith("STEP_MS"):
            return float(line.split()[1])
    return None


def report(rows):
    print()
    print(f"{'fold check':40} {'seconds':>8}  {'ok':5} detail")
    for name, seconds, ok, detail in rows:
        print(f"{name:40} {seconds:8.1f}  {str(bool(ok)):5} {detail}")
    return 0 if all(row[2] for row in rows) else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout-s", type=float, default=150.0, help="limit of each job")
    args = parser.parse_args()
    from runtime import cudagroup

    missing = cudagroup.cuda_missing()
    if missing is not None:
        print(f"no GPU: {missing}; the fold checks need one")
        return 2
    return report(fold_checks(args.timeout_s))


if __name__ == "__main__":
    sys.exit(main())
