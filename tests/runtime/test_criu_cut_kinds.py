"""Jobs without torch.optim are stopped and resumed bit-exact under CRIU (issue 19 §3), and their
CRIU checkpoints after the first store only what changed (runtime/criu_pages.py).

A manual-SGD script (tests/runtime/scripts/manual_sgd.py: `p.data.add_(-lr * p.grad)`, no optimizer)
used to be uncuttable: the cut fired only after an optimizer step, so a stop waited out its timeout.
Now a single rank is cut at any moment (CRIU freezes it wherever it is) and two ranks at the entry of
the same all-reduce (the virtual group's collective boundary); the checkpoint event names the kind."""
import json
import time

import pytest
import torch
from runtime_helpers import JOB_TIMEOUT_S, SCRIPTS, Job, needs_criu, unique_id

from runtime import cut, engines

pytestmark = pytest.mark.runtime
SCRIPT = SCRIPTS / "manual_sgd.py"
ITERS = ["--iters", "60"]


def test_the_engines_name_only_cut_kinds_the_cut_module_knows():
    assert set(engines.CriuEngine.cut_kinds) == set(cut.CUT_KINDS)
    assert engines.FrameworkEngine.cut_kinds == (cut.OPTIMIZER_STEP,)


def wait_for_iteration(job, iteration):
    log = job.job_dir / "logs" / "rank0.log"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        if log.exists() and f"iter {iteration}\n" in log.read_text(errors="replace"):
            return
        if job.process.poll() is not None:
            raise AssertionError(f"job ended before iteration {iteration}:\n{job.output()}")
        time.sleep(0.05)
    raise AssertionError(f"job never reached iteration {iteration}")


def events(job_dir, kind):
    lines = (job_dir / "events.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["event"] == kind]


def stop_and_resume(tmp_path, jobs, ranks):
    out, reference = tmp_path / "out.pt", tmp_path / "reference.pt"
    hold = tmp_path / "hold"
    hold.touch()  # the job waits after iteration 3 until it is stopped, however loaded the machine is
    args = ITERS + ["--sleep", "0.05", "--hold-while", str(hold)]
    first = Job(tmp_path / "node", ranks=ranks, script=SCRIPT, out=out, script_args=args,
                engine="criu", job_id=unique_id("manual"), keep=2)
    jobs.append(first)
    first.wait_ready()
    wait_for_iteration(first, 3)
    full = first.control.checkpoint()
    after = first.control.checkpoint()
    stopped = first.control.stop()
    first.finish(75)
    hold.unlink()
    second = Job(tmp_path / "node", ranks=ranks, script=SCRIPT, out=out, script_args=args,
                 engine="criu", job_id=unique_id("manual-b"), resume=True, keep=2)
    jobs.append(second)
    second.finish(0)
    plain = Job(tmp_path / "reference", ranks=ranks, script=SCRIPT, out=reference,
                script_args=ITERS + ["--sleep", "0"], engine="criu", job_id=unique_id("ref"))
    jobs.append(plain)
    plain.finish(0)
    expected, actual = torch.load(reference), torch.load(out)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"parameter {name} differs after the resume"
    taken = events(tmp_path / "node", "checkpoint")
    assert [e["action"] for e in taken] == ["checkpoint", "checkpoint", "stop"]
    # After the first checkpoint (the base), a checkpoint stores only the pages that changed.
    assert taken[0]["base"] is None and taken[1]["base"] == taken[0]["checkpoint"] == taken[2]["base"]
    assert after["bytes"] < 0.10 * full["bytes"] and stopped["bytes"] < 0.10 * full["bytes"]
    assert events(tmp_path / "node", "restored")[0]["checkpoint"] == stopped["checkpoint"]
    return taken


@pytest.mark.criu
@needs_criu
def test_a_single_rank_without_an_optimizer_is_cut_at_any_moment_and_resumes_exactly(tmp_path, jobs):
    taken = stop_and_resume(tmp_path, jobs, 1)
    assert {e["cut_kind"] for e in taken} == {cut.ANY_MOMENT}


@pytest.mark.criu
@needs_criu
def test_two_ranks_without_an_optimizer_are_cut_at_a_collective_boundary_and_resume_exactly(tmp_path, jobs):
    taken = stop_and_resume(tmp_path, jobs, 2)
    assert {e["cut_kind"] for e in taken} == {cut.COLLECTIVE_BOUNDARY}


# -- the watcher between steps, in this process (no ranks, no CRIU: one rank without a group) ----

class Taken:
    def __init__(self):
        self.cuts, self.errors = [], []

    def on_cut(self, request, step, kind):
        self.cuts.append((request.id, step, kind))

    def report_error(self, request, step, reason):
        self.errors.append((request.id, step, reason))


def ask(spool, request_id, **fields):
    from protocol.cut import CutRequest
    from runtime import spool as spool_files
    fields.setdefault("staging_dir", str(spool / "staging"))
    spool_files.write_json_atomic(spool / "request.json",
                                  CutRequest(id=request_id, **fields).to_dict())


def test_a_single_rank_with_no_step_is_cut_at_once_and_one_with_steps_after_the_grace(tmp_path):
    taken, steps = Taken(), {"n": 0}
    barrier = cut.CutBarrier(spool=tmp_path, on_cut=taken.on_cut, step_of=lambda: steps["n"])
    watch = cut.RequestWatch(barrier, any_moment=True, grace_s=0.3)
    ask(tmp_path, 1, action="stop")
    watch.check()
    assert taken.cuts == [(1, 0, cut.ANY_MOMENT)]
    watch.check()  # handled: never taken twice
    assert len(taken.cuts) == 1
    steps["n"] = 7  # a job with optimizer steps: the step barrier has the grace period first
    ask(tmp_path, 2, action="checkpoint")
    watch.check()
    assert len(taken.cuts) == 1
    time.sleep(0.35)
    watch.check()
    assert taken.cuts[-1] == (2, 7, cut.ANY_MOMENT)
    ask(tmp_path, 3, action="stop", at_step=40)  # a cut after a given step waits for that step
    time.sleep(0.35)
    watch.check()
    assert len(taken.cuts) == 2
    barrier(40)  # the step barrier: a single rank's flags sum to its own
    barrier(41)
    assert taken.cuts[-1] == (3, 41, cut.OPTIMIZER_STEP)


def test_an_engine_that_cannot_cut_without_steps_refuses_at_once_with_its_reason(tmp_path):
    taken, steps = Taken(), {"n": 0}
    barrier = cut.CutBarrier(spool=tmp_path, on_cut=taken.on_cut, step_of=lambda: steps["n"])
    reason = "no torch.optim optimizer: use --engine criu"
    watch = cut.RequestWatch(barrier, any_moment=False, no_cut_reason=lambda: reason,
                             report_error=taken.report_error)
    ask(tmp_path, 5, action="stop")
    watch.check()
    watch.check()
    assert taken.errors == [(5, 0, reason)] and taken.cuts == []
    steps["n"] = 1  # once a step was taken, the request waits for the step barrier
    ask(tmp_path, 6, action="stop")
    watch.check()
    assert len(taken.errors) == 1
