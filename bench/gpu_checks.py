"""GPU checks in one go (run on a machine with an NVIDIA GPU; CI has none):

1. NVML telemetry through the agent's own device layer (agent/devices.py).
2. The CUDA driver checkpoint API through runtime/cuda_checkpoint.py: a process holding
   S GiB of device state is paused between steps, swapped out to host memory and back in,
   then finishes; its final state hash must equal an uninterrupted run's (bit-exact), and
   the device memory must really be released while it is swapped out. S = 1, 16, 60 GiB.
3. Time-slicing two 80 GiB "ranks" on one GPU that cannot hold both (139 GiB H200): A runs,
   is swapped out; B runs, is swapped out; A is swapped in and finishes; B is swapped in and
   finishes; both hashes must equal their uninterrupted runs'.

4. Folding (bench/gpu_fold_checks.py, issue 17 §2): W = 4 and W = 2 folded on the one GPU over
   several logical devices, bit-exact against each other and against W = 4 on 4 logical devices;
   W = 4 resized 4 -> 2 -> 1 -> 4 bit-exact; the fold's cost per step against plain DDP over NCCL.
   UNPROVEN ON GPU until run on one (no GPU was lent when it was written).

Prints a table. Usage: python3 bench/gpu_checks.py [--sizes 1,16,60] [--slice-gib 80]
[--checks swap,slice,fold] [--fold-timeout-s 150]
Without a GPU it stops at once, printing "no GPU" and the runtime's own refusal message.

Measured on an H200 (driver 580.159.04, 125 GiB host RAM): 1 / 16 / 60 GiB swapped out in
1.8 / 11.4 / 42.2 s and in in 0.4 / 3.3 / 10.6 s, all bit-exact. The 2 x 80 GiB slice failed
there (restore -> CUresult 3), most likely because both parked ranks need 160 GiB of host RAM; so the
slice check now needs host RAM for two parked ranks and says so otherwise.
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runtime.cuda_checkpoint import CudaCheckpointUnavailable, CudaProcessCheckpoint, load_driver  # noqa: E402

# The worker: S GiB of float32 state plus a small matmul model, updated deterministically for
# `steps` steps; after steps // 2 it prints PAUSE and waits for a line on stdin before going on.
WORKER = r"""
import sys, torch
gib, steps, seed = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator(device="cuda").manual_seed(seed)
n = int(gib * 2**30 // 4)
state = torch.empty(n, device="cuda", dtype=torch.float32)
chunk = 2**28
for i in range(0, n, chunk):
    state[i:i + chunk].uniform_(-1, 1, generator=g)
w = torch.randn(2048, 2048, device="cuda", generator=g) / 45.0
x = torch.randn(2048, 256, device="cuda", generator=g)
def step(k):
    global w
    y = torch.tanh(w @ x)
    w = w - 1e-3 * (y @ x.T) / 256
    for i in range(0, n, chunk):
        part = state[i:i + chunk]
        part.mul_(0.999).add_(float(w[k % 2048, k % 2048]))
for k in range(steps // 2):
    step(k)
torch.cuda.synchronize()
print("PAUSE", flush=True)
sys.stdin.readline()
for k in range(steps // 2, steps):
    step(k)
torch.cuda.synchronize()
h = 0
for i in range(0, n, chunk):
    h = (h * 1000003 + int(state[i:i + chunk].view(torch.int32).to(torch.int64).sum().item())) % (2**61 - 1)
h = (h * 1000003 + int(w.view(torch.int32).to(torch.int64).sum().item())) % (2**61 - 1)
print("HASH", h, flush=True)
"""


LIVE = []  # workers to kill if a check fails, so the script never hangs on a paused child


def used_gib():
    from agent.devices import Devices

    return Devices("auto").sample()["devices"][0]["memory_used_gb"]


class Worker:
    def __init__(self, gib, steps=8, seed=0):
        self.gib = gib
        LIVE.append(self)
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(gib), str(steps), str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if line != "PAUSE":
            raise RuntimeError(f"worker ({gib} GiB) did not reach its pause: {line!r}")
        self.cuda = None

    def swap_out(self):
        self.cuda = self.cuda or CudaProcessCheckpoint(self.proc.pid)
        started = time.perf_counter()
        self.cuda.swap_out()
        seconds = time.perf_counter() - started
        assert self.cuda.state() == "checkpointed", self.cuda.state()
        return seconds

    def swap_in(self):
        started = time.perf_counter()
        self.cuda.swap_in()
        seconds = time.perf_counter() - started
        assert self.cuda.state() == "running", self.cuda.state()
        return seconds

    def finish(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        self.proc.wait(timeout=600)
        if not line or line[0] != "HASH":
            raise RuntimeError(f"worker ({self.gib} GiB) ended without a hash: {line}")
        return int(line[1])


def reference_hash(gib, seed):
    return Worker(gib, seed=seed).finish()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,16,60")
    parser.add_argument("--slice-gib", type=float, default=80)
    parser.add_argument("--checks", default="swap,slice,fold", help="which of swap, slice, fold to run")
    parser.add_argument("--fold-timeout-s", type=float, default=150.0, help="limit of each folding job")
    args = parser.parse_args()
    checks = {name.strip() for name in args.checks.split(",") if name.strip()}
    try:
        load_driver()
    except CudaCheckpointUnavailable as exc:
        print(f"no GPU: no GPU checks possible here: {exc}")
        return 2
    fold_rows = []
    if "fold" in checks:  # first: short, and what the fold's issue needs (device time is short)
        from bench.gpu_fold_checks import fold_checks
        from bench.gpu_fold_checks import report as fold_report
        fold_rows = fold_checks(args.fold_timeout_s)
        fold_report(fold_rows)
    if "swap" not in checks:
        args.sizes = ""
    if "slice" not in checks:
        args.slice_gib = 0
    from agent.devices import Devices

    devices = Devices("auto")
    print("NVML describe:", devices.describe())
    print("NVML sample:", devices.sample())

    rows = []
    for gib in [float(size) for size in args.sizes.split(",") if size.strip()]:
        expected = reference_hash(gib, seed=1)
        worker = Worker(gib, seed=1)
        before = used_gib()
        out_s = worker.swap_out()
        during = used_gib()
        in_s = worker.swap_in()
        got = worker.finish()
        rows.append((f"{gib:g} GiB swap out/in", out_s, in_s, before, during, got == expected))
        print(rows[-1], flush=True)

    g = args.slice_gib
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if 2 * g + 8 > host_gib:
        print(f"time-slice check skipped: two parked {g:g} GiB ranks need {2 * g + 8:.0f} GiB of host RAM, "
              f"this host has {host_gib:.0f} GiB (use --slice-gib {max(1, int((host_gib - 8) // 2))})")
        g = 0
    if not g:
        return report(rows) or (0 if all(row[2] for row in fold_rows) else 1)
    expected_a, expected_b = reference_hash(g, seed=2), reference_hash(g, seed=3)
    a = Worker(g, seed=2)
    a_out = a.swap_out()
    b = Worker(g, seed=3)           # fits only because A's memory went to the host
    b_out = b.swap_out()
    a_in = a.swap_in()
    hash_a = a.finish()
    b_in = b.swap_in()
    hash_b = b.finish()
    rows.append((f"2 x {g:g} GiB time-sliced: A", a_out, a_in, None, None, hash_a == expected_a))
    rows.append((f"2 x {g:g} GiB time-sliced: B", b_out, b_in, None, None, hash_b == expected_b))
    return report(rows) or (0 if all(row[2] for row in fold_rows) else 1)


def report(rows):
    print()
    print(f"{'check':34} {'swap out s':>10} {'swap in s':>10} {'used GiB':>9} {'swapped':>8}  bit-exact")
    for name, out_s, in_s, before, during, exact in rows:
        fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
        print(f"{name:34} {out_s:10.2f} {in_s:10.2f} {fmt(before):>9} {fmt(during):>8}  {exact}")
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        for worker in LIVE:
            if worker.proc.poll() is None:
                worker.proc.kill()
