"""The corpus: small training scripts written the way people write them (tests/runtime/corpus/
scripts/), each preempted, migrated or resized under each engine. Every case ends bit-exact
(torch.equal on every parameter and optimizer tensor, against an uninterrupted run) or is
refused with a reason that names the cause: never a silently different model. The table of
outcomes is in docs/design/runtime.md ("The corpus").

The framework engine runs through tests/runtime/framework_scripts/harness.py (what rank.py does:
framework.install, then the unmodified script; it saves at TEST_CUT_STEP and dies like a
preempted process); CRIU runs through meridian-run's public interface (stop, --resume)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.runtime_helpers import Job, assert_same_bits, load_state, needs_criu, unique_id

pytestmark = pytest.mark.runtime

REPO = Path(__file__).resolve().parents[3]
CORPUS = Path(__file__).resolve().parent / "scripts"
HARNESS = REPO / "tests" / "runtime" / "framework_scripts" / "harness.py"
CUT_STEP = 8  # the scripts take 10-16 optimizer steps in 2 epochs: the cut is in the second
UNRESUMABLE = 3  # the harness's exit status for a refusal (the reason follows UNRESUMABLE: on stderr)


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MERIDIAN_", "TEST_", "RANK", "WORLD_SIZE", "MASTER_", "SNAPSHOT"))}
    env.update(TEST_REPO_ROOT=str(REPO), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(name, cwd, *args, **env):
    """Runs corpus script `name` under the framework engine's harness in `cwd` (its relative
    paths land there); returns the CompletedProcess."""
    cwd = Path(cwd)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(HARNESS), str(CORPUS / name), *map(str, args)],
                          cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=300)


def run_ok(name, cwd, *args, **env):
    proc = run_script(name, cwd, *args, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def cut_and_resume(name, tmp_path, *args, migrate=False, **env):
    """First attempt in tmp_path/node-a, saved at CUT_STEP and killed; the resume runs in the
    same directory (a preemption) or, with `migrate`, from a copy of the checkpoint in another
    directory that holds none of the first attempt's files (a move to another node)."""
    first = tmp_path / "node-a"
    ckpt = tmp_path / "ckpt"
    proc = run_script(name, first, *args, TEST_CUT_STEP=CUT_STEP, TEST_SAVE_DIR=ckpt, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "rank-0").is_dir(), "the first attempt never reached its cut"
    assert not (first / "final.pt").exists()
    where = first
    if migrate:
        where = tmp_path / "node-b"
        shutil.copytree(ckpt, tmp_path / "moved")
        ckpt = tmp_path / "moved"
    return where, run_script(name, where, *args, MERIDIAN_RESUME=ckpt,
                             TEST_STEP_FILE=tmp_path / "step.json", **env)


def _compile_works():
    probe = ("import torch; f = torch.compile(lambda x: x * 2 + 1); "
             "assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))")
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=240,
                              env=_env()).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# --------------------------------------------------------------------------- framework: exact

EXACT = [
    pytest.param("seeded_loader.py", False, id="seeded-loader"),
    pytest.param("seeded_loader.py", True, id="seeded-loader-migrated"),
    pytest.param("seeded_workers.py", True, id="workers-augment-tqdm-migrated"),
    pytest.param("lbfgs_closure.py", False, id="lbfgs-closure"),
    pytest.param("grad_accum.py", False, id="grad-accum-per-step-scheduler"),
    # skipped steps and a scale that grows and backs off, saved as update() leaves it after the cut
    pytest.param("amp_scaler.py", True, id="amp-grad-scaler-migrated"),
    pytest.param("gan_amp.py", False, id="amp-two-optimizers-one-scaler"),
    pytest.param("compiled.py", False, id="torch-compile", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, migrate", EXACT)
def test_framework_resumes_bit_exactly(name, migrate, tmp_path):
    if name == "compiled.py" and not _compile_works():
        pytest.skip("torch.compile (inductor) does not run on this machine's CPU toolchain")
    run_ok(name, tmp_path / "uninterrupted", TEST_STEP_FILE=tmp_path / "steps-uninterrupted.json")
    expected = load_state(tmp_path / "uninterrupted" / "final.pt")
    where, proc = cut_and_resume(name, tmp_path, migrate=migrate)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads((tmp_path / "steps-uninterrupted.json").read_text())["step"]
    assert steps > CUT_STEP and json.loads((tmp_path / "step.json").read_text())["step"] == steps
    assert_same_bits(expected, load_state(where / "final.pt"))


def test_framework_resumes_an_unseeded_but_seed_independent_script_exactly(tmp_path):
    """Nothing seeded, but the model and data do not depend on the seed (the shuffle, the workers'
    seeds and Dropout draw from the RNG the engine restores). A separate uninterrupted run is no
    reference (its own seed shuffles differently), so the first attempt checkpoints and runs on
    to its end; the resume from that checkpoint, elsewhere, must end with the same bytes."""
    name = "unseeded_shuffle_workers.py"
    first = tmp_path / "node-a"
    run_ok(name, first, TEST_CUT_STEP=CUT_STEP, TEST_SAVE_DIR=tmp_path / "ckpt", TEST_CUT_CONTINUE=1)
    proc = run_script(name, tmp_path / "node-b", MERIDIAN_RESUME=tmp_path / "ckpt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_bits(load_state(first / "final.pt"), load_state(tmp_path / "node-b" / "final.pt"))


# --------------------------------------------------------------------------- framework: refused

REFUSED_AT_RESUME = [
    pytest.param("unseeded.py", (), "model #1 (Sequential) has different parameters",
                 id="unseeded-torch"),
    pytest.param("numpy_data.py", (), "batch 1 of the epoch in progress", id="unseeded-numpy-data"),
    pytest.param("data_order.py", (), "batch 1 of the epoch in progress", id="order-from-clock"),
    pytest.param("data_order.py", ("--urandom",), "batch 1 of the epoch in progress",
                 id="order-from-urandom"),
    pytest.param("private_generator.py", (), "batch 1 of the epoch in progress",
                 id="private-numpy-generator"),
    pytest.param("own_snapshot.py", (), "snapshot.pt with torch.load", id="own-snapshot-relative"),
]


@pytest.mark.parametrize("name, args, words", REFUSED_AT_RESUME)
def test_framework_refuses_a_rerun_that_is_not_the_run_that_was_cut(name, args, words, tmp_path):
    """The re-run builds another model or other data (or loads its own snapshot): refused before
    a single step, naming what differed, instead of finishing with a different model."""
    where, proc = cut_and_resume(name, tmp_path, *args)
    assert proc.returncode == UNRESUMABLE, proc.stderr[-3000:]
    assert "the re-run is not the run that was cut" in proc.stderr
    assert words in proc.stderr, proc.stderr[-3000:]
    assert not (where / "final.pt").exists()


def test_own_snapshot_at_an_absolute_path_is_refused_and_its_own_resume_then_works(tmp_path):
    """The script's own fault tolerance keeps working: the engine refuses to fast-forward a
    script that restored itself, and a restart without the engine's checkpoint (what the job's
    policy does on such a refusal) lets the script resume from its own snapshot."""
    snapshot = tmp_path / "elsewhere" / "snapshot.pt"
    snapshot.parent.mkdir()
    where, proc = cut_and_resume("own_snapshot.py", tmp_path, SNAPSHOT=snapshot)
    assert proc.returncode == UNRESUMABLE, proc.stderr[-3000:]
    assert f"{snapshot} with torch.load" in proc.stderr
    restarted = run_ok("own_snapshot.py", where, SNAPSHOT=snapshot)
    assert "resuming from my own snapshot at epoch 1" in restarted.stdout
    assert (where / "final.pt").exists()


def test_a_script_without_torch_optim_is_named_as_uncuttable(tmp_path):
    """Manual SGD never reaches the framework engine's cut (after optimizer.step()): the engine
    says so (FrameworkEngine.no_cut_reason, asked while a stop waits) instead of a stop that waits
    out its timeout."""
    run_ok("manual_sgd.py", tmp_path, TEST_CUT_STEP=CUT_STEP, TEST_SAVE_DIR=tmp_path / "c",
           TEST_STEP_FILE=tmp_path / "step.json")
    report = json.loads((tmp_path / "step.json").read_text())
    assert report["step"] == 0 and not (tmp_path / "c").exists()
    assert "no torch.optim optimizer" in report["no_cut_reason"]
    assert "--engine criu" in report["no_cut_reason"]


def test_a_script_with_an_optimizer_is_not_named_as_uncuttable(tmp_path):
    run_ok("seeded_loader.py", tmp_path, TEST_STEP_FILE=tmp_path / "step.json")
    assert json.loads((tmp_path / "step.json").read_text())["no_cut_reason"] is None


# --------------------------------------------------------------------------- the launcher

def test_a_script_that_trains_nothing_says_so_in_its_finished_event(tmp_path):
    out = tmp_path / "final.pt"
    job = Job(tmp_path / "job", ranks=1, script=CORPUS / "trains_nothing.py", out=out,
              engine="framework", job_id=unique_id("nothing"))
    job.finish(0)
    events = [json.loads(line) for line in (tmp_path / "job" / "events.jsonl").read_text().splitlines()]
    finished = [e for e in events if e["event"] == "finished"]
    assert finished and finished[-1]["step"] == 0
    assert "without a single optimizer step" in finished[-1]["note"]


def _events(job_dir):
    return [json.loads(line) for line in (Path(job_dir) / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_refused_resume_fails_with_its_reason_or_restarts_as_the_job_allows(tmp_path, jobs, monkeypatch):
    """meridian-run, framework engine: a script that keeps its own snapshot (absolute path) is
    stopped at a step; its resume is refused (exit 1, a failed event with the reason), and with
    --if-resume-refused restart the launcher starts it from scratch instead, where the script's
    own resume logic takes over."""
    snapshot = tmp_path / "own" / "snapshot.pt"
    snapshot.parent.mkdir()
    monkeypatch.setenv("SNAPSHOT", str(snapshot))
    out = tmp_path / "final.pt"
    node, job_id = tmp_path / "node", unique_id("own-snapshot")
    script = CORPUS / "own_snapshot.py"
    first = Job(node, ranks=1, script=script, out=out, engine="framework", job_id=job_id)
    jobs.append(first)
    first.wait_ready()
    assert first.control.stop(at_step=CUT_STEP)["step"] == CUT_STEP
    first.finish(75)
    refused = Job(node, ranks=1, script=script, out=out, engine="framework", job_id=job_id, resume=True)
    jobs.append(refused)
    refused.finish(1)
    failed = [e for e in _events(node) if e["event"] == "failed"][-1]
    assert "resume refused by the framework engine" in failed["error"]
    assert f"{snapshot} with torch.load" in failed["error"]
    assert not out.exists()
    restarted = Job(node, ranks=1, script=script, out=out, engine="framework", job_id=job_id,
                    resume=True, launcher_args=["--if-resume-refused", "restart"])
    jobs.append(restarted)
    restarted.finish(0)
    events = _events(node)
    assert "restarted from scratch" in [e for e in events if e["event"] == "started"][-1]["reason"]
    # The node agent reads the restart from these events and says so in its reports (JobReport.restarted).
    from agent.node import LocalJob
    assert LocalJob(1, node).restarted().startswith("restarted from scratch (--if-resume-refused restart)")
    assert events[-1]["event"] == "finished" and out.exists()
    assert "resuming from my own snapshot at epoch 1" in (node / "logs" / "rank0.log").read_text()
    assert (node / "logs" / "attempt-1" / "rank0.log").exists()  # the earlier attempts' logs are kept


# --------------------------------------------------------------------------- CRIU

CRIU_CASES = [
    pytest.param("unseeded.py", id="unseeded-torch"),
    pytest.param("data_order.py", id="order-from-clock"),
    pytest.param("own_snapshot.py", id="own-snapshot"),
]


@needs_criu
@pytest.mark.criu
@pytest.mark.slow
@pytest.mark.parametrize("name", CRIU_CASES)
def test_criu_resumes_exactly_what_the_framework_engine_refuses(name, tmp_path, jobs):
    """A whole-process image holds the data and the model the first run built: exact even for a
    script that seeds nothing, where no second run can be the reference. So the reference is the
    first attempt itself, checkpointed at a step and run on to its end; the checkpoint restored
    (on the same node) must end with the same bytes."""
    job_id = unique_id("corpus-criu")
    node = tmp_path / "node"
    out = tmp_path / "final.pt"
    first = Job(node, ranks=1, script=CORPUS / name, out=out, engine="criu", job_id=job_id)
    jobs.append(first)
    first.wait_ready()
    answer = first.control.checkpoint(at_step=CUT_STEP)
    assert answer["step"] == CUT_STEP and answer["engine"] == "criu"
    first.finish(0)
    expected = load_state(out)
    out.unlink()
    resumed = Job(node, ranks=1, script=CORPUS / name, out=out, engine="criu", job_id=job_id,
                  resume=True)
    jobs.append(resumed)
    resumed.finish(0)
    assert_same_bits(expected, load_state(out))
