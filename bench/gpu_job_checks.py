"""The whole-job checks of bench/gpu_checks.py (issue 17's Proof list): one single-process training
job under meridian-run, preempted at a cut and resumed in a new process, against an uninterrupted run.

UNPROVEN ON GPU until run on one (written on a machine without; its CPU dry run, --device cpu,
runs every line of it in CI). What each check shows on a GPU:
1. framework engine: tests/runtime/scripts/single_mlp.py --device cuda (model, Adam state and
   augmentation noise on cuda:0, dropout drawing from the CUDA generator) is stopped at step 13
   and resumed by a new launcher, in a new PID namespace where this host allows one
   (unshare --pid --mount-proc, as root); its final parameters, Adam state and CPU and CUDA RNG
   states must be the bits of the uninterrupted run.
   Then the same with --amp (last, so a short budget skips it first): autocast float16 and a
   GradScaler whose float16 gradients overflow now and then (skipped steps, the scale backing off
   and growing); the scaler's state joins the compared bits. The framework engine saves the scale
   as the script's update() after the cut's step leaves it (runtime/framework.py).
2. CRIU engine: the same stop and resume with --engine criu: the rank's CUDA state moved into its
   host memory by the driver before CRIU dumps it, and back after CRIU restored it into a new
   process and PID namespace on the same GPU (runtime/criu_cuda.py); before the stop, a checkpoint
   at step 5 that the job goes on from (its CUDA state back on the GPU after the dump); bit-exact
   as above. Where the
   driver cannot (older than 570), the stop is refused with the reason and the row fails with it;
   where CRIU is not installed (the lent machines so far) the row is "skipped" and says why. On CPU
   the CRIU engine dumps and restores the same way with no CUDA state: bit-exact.
"""
from __future__ import annotations

import pathlib
import time

from bench.gpu_harness import ROOT, BenchJob, Budget, CheckRow, pid_namespace_wrapper, run_job, same_final_state

SINGLE_SCRIPT = ROOT / "tests" / "runtime" / "scripts" / "single_mlp.py"
STOP_AT_STEP = 13
CHECKPOINT_AT_STEP = 5  # the CRIU check's checkpoint the job goes on from, before the stop
CRIU_STEP_SLEEP_S = 0.3  # 36 steps in ~11 s: room for a checkpoint's dump before the stop
# 3 epochs of 12 steps; a sleep per step keeps step 13 ahead of the stop request however fast
# the device is (a GPU runs this MLP's 36 steps in well under a second).
SCRIPT_ARGS = ["--epochs", "3", "--step-sleep", "0.05"]
EXIT_STOPPED = 75


def launches_estimate(budget: Budget, engine: str) -> float:
    """Seconds the check of `engine` is expected to take (the reference run counted once, with
    the framework check)."""
    return budget.launch_s * (3 if engine == "framework" else 2)


class JobChecks:
    """The whole-job checks on `device` ("cuda" or "cpu"), under `work`, within `budget`."""

    def __init__(self, work: pathlib.Path, *, device: str, budget: Budget, step_timeout_s: float,
                 amp: bool = False):
        self.work = pathlib.Path(work)
        self.device = device
        self.amp = amp
        self.budget = budget
        self.step_timeout_s = step_timeout_s
        self.reference: pathlib.Path | None = None
        self.reference_error = ""

    def args(self, out, *, step_sleep: float | None = None) -> list:
        """The script's arguments; `step_sleep` (which changes no bit of the result) slows a job whose
        cuts take long (CRIU's, a GPU process's image) so that it is still running for the next one."""
        sleep = ["--step-sleep", str(step_sleep)] if step_sleep is not None else []
        return [out] + SCRIPT_ARGS + sleep + ["--device", self.device] + (["--amp"] if self.amp else [])

    def reference_state(self) -> pathlib.Path | None:
        """The uninterrupted run's final state (run once, by the first check that needs it)."""
        if self.reference is None and not self.reference_error:
            out = self.work / "reference.pt"
            rc, text, seconds = run_job(self.work / "reference", ranks=1, script=SINGLE_SCRIPT,
                                        script_args=self.args(out), engine="framework",
                                        timeout_s=self.budget.timeout(self.step_timeout_s), budget=self.budget)
            if rc == 0 and out.exists():
                self.reference = out
            else:
                self.reference_error = f"the uninterrupted run ended {rc} after {seconds:.0f} s: {text[-500:]}"
        return self.reference

    def framework_preempt_resume(self) -> list:
        amp = f", AMP {'float16' if self.device == 'cuda' else 'bfloat16'} + GradScaler" if self.amp else ""
        name = f"single job, framework engine{amp}, stop+resume ({self.device})"
        started = time.monotonic()
        reference = self.reference_state()
        if reference is None:
            return [CheckRow(name, time.monotonic() - started, "error", None, self.reference_error)]
        prefix, namespace = pid_namespace_wrapper()
        stopped, detail = self._stop_and_resume("framework", prefix)
        return [self._compare_row(name, started, stopped, detail + f"; resumed {namespace}", reference)]

    def criu(self) -> list:
        from runtime import criu

        name = f"single job, CRIU engine ({self.device})"
        ok, why = criu.check_available()
        if not ok:
            return [CheckRow(name, 0.0, "skipped", None, f"skipped: CRIU unavailable here ({why})")]
        started = time.monotonic()
        reference = self.reference_state()
        if reference is None:
            return [CheckRow(name, time.monotonic() - started, "error", None, self.reference_error)]
        stopped, detail = self._stop_and_resume("criu", [])
        cuda = "; its CUDA state moved to host and back by the driver" if self.device == "cuda" else ""
        return [self._compare_row(name, started, stopped, detail + "; each rank the init of its own PID "
                                  "namespace, restored into a new one by a new launcher" + cuda, reference)]

    def _stop_and_resume(self, engine: str, prefix: list) -> tuple[pathlib.Path | None, str]:
        """Stops a job at STOP_AT_STEP and resumes it in a new launcher; returns (the final state's
        path or None, what happened)."""
        from runtime.control import JobControlError

        out = self.work / f"{engine}.pt"
        job_dir = self.work / f"{engine}-node" / "job"
        job_id = f"gpu-check-{engine}-{int(time.time() * 1000) % 10**8}"
        script_args = self.args(out, step_sleep=CRIU_STEP_SLEEP_S if engine == "criu" else None)
        first = BenchJob(job_dir, ranks=1, script=SINGLE_SCRIPT, script_args=script_args, engine=engine,
                         job_id=job_id)
        went_on = ""
        try:
            first.wait_ready(self.budget.timeout(self.step_timeout_s))
            if engine == "criu":
                # First a checkpoint the job goes on from (the periodic kind): its CUDA state goes
                # to host memory for the dump and must come back for the run to end bit-exact.
                taken = first.control().checkpoint(at_step=CHECKPOINT_AT_STEP,
                                                   timeout_s=self.budget.timeout(self.step_timeout_s))
                went_on = f"checkpoint at step {taken['step']} gone on from{_moved(taken)}; "
            answer = first.control().stop(at_step=STOP_AT_STEP, timeout_s=self.budget.timeout(self.step_timeout_s))
        except (JobControlError, RuntimeError, OSError) as exc:
            first.kill()
            return None, f"{went_on}stop failed: {exc}; {first.output()[-400:]}"
        rc = first.wait(self.budget.timeout(self.step_timeout_s))
        if rc != EXIT_STOPPED or out.exists():
            return None, f"the stopped launcher ended {rc} (expected {EXIT_STOPPED}), output there: {out.exists()}"
        second = BenchJob(job_dir, ranks=1, script=SINGLE_SCRIPT, script_args=script_args, engine=engine,
                          job_id=job_id, resume=True, prefix=prefix)
        rc = second.wait(self.budget.timeout(self.step_timeout_s))
        if rc != 0 or not out.exists():
            return None, f"the resumed launcher ended {rc}: {second.output()[-500:]}"
        return out, (f"{went_on}stopped at step {answer['step']} ({answer['engine']}{_moved(answer)}), resumed "
                     "by a new launcher")

    def _compare_row(self, name, started, final, detail, reference) -> CheckRow:
        seconds = time.monotonic() - started
        if final is None:
            return CheckRow(name, seconds, "failed", False, detail)
        exact, what = same_final_state(reference, final)
        return CheckRow(name, seconds, "ok" if exact else "failed", exact, f"{detail}; {what}")


def _moved(answer) -> str:
    """A checkpoint answer's dump time and its CUDA moves, in words ("" for none)."""
    seconds = answer.get("seconds") or {}
    return "".join(f", {label} {seconds[key]:.2f} s" for key, label in
                   (("dump", "dump"), ("device_out", "CUDA state device -> host"), ("device_in", "host -> device"))
                   if seconds.get(key) is not None)


def job_check_plan(work, *, device: str, budget: Budget, step_timeout_s: float):
    """Returns [(name, estimate function, check)] in the order to run them."""
    checks = JobChecks(work, device=device, budget=budget, step_timeout_s=step_timeout_s)
    return [("job: framework stop+resume", lambda: launches_estimate(budget, "framework"),
             checks.framework_preempt_resume),
            ("job: CRIU", lambda: launches_estimate(budget, "criu") if _criu_ok() else 0.0, checks.criu),
            ("job: framework stop+resume, AMP", lambda: launches_estimate(budget, "framework"),
             JobChecks(pathlib.Path(work) / "amp", device=device, budget=budget, step_timeout_s=step_timeout_s,
                       amp=True).framework_preempt_resume)]


def _criu_ok() -> bool:
    from runtime import criu
    return criu.check_available()[0]
