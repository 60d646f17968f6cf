"""Framework checkpoint engine: an unmodified script is preempted at a step (its process dies
right after tracker.save), resumed from the checkpoint by re-running it, and must end with
parameters, optimizer and scheduler state equal (torch.equal) to an uninterrupted run's.
Scripts that cannot be resumed correctly must be refused, never resumed wrong."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import framework, store
from tests.runtime.runtime_helpers import assert_same_bits, load_state

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "framework_scripts"
HARNESS = SCRIPTS / "harness.py"
MLP = SCRIPTS / "mlp_train.py"
DDP = SCRIPTS / "ddp_train.py"
STEPS_PER_EPOCH = 6  # mlp_train: 96 samples, batch 16
MLP_STEPS = 4 * STEPS_PER_EPOCH

pytestmark = pytest.mark.runtime


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MERIDIAN_", "TEST_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(TEST_REPO_ROOT=str(REPO), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(script, args, **env):
    proc = subprocess.run([sys.executable, str(HARNESS), str(script), *map(str, args)],
                          env=_env(**env), capture_output=True, text=True, timeout=300)
    return proc


def _run_ok(script, args, **env):
    proc = _run(script, args, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Final states of uninterrupted runs, one per script configuration, computed once."""
    cache = {}
    root = tmp_path_factory.mktemp("uninterrupted")

    def get(*args):
        if args not in cache:
            out = root / f"run-{len(cache)}.pt"
            _run_ok(MLP, ["--out", out, *args])
            cache[args] = load_state(out)
        return cache[args]
    return get


def _preempt_and_resume(tmp_path, script, args, cut_step, **env):
    ckpt = tmp_path / "ckpt"
    _run_ok(script, ["--out", tmp_path / "never-written.pt", *args],
            TEST_CUT_STEP=cut_step, TEST_SAVE_DIR=ckpt, **env)
    assert not (tmp_path / "never-written.pt").exists()
    manifest = json.loads((ckpt / f"rank-{env.get('RANK', 0)}" / "MANIFEST.json").read_text())
    assert manifest["engine"] == "framework" and manifest["step"] == cut_step
    out = tmp_path / "resumed.pt"
    _run_ok(script, ["--out", out, *args], MERIDIAN_RESUME=ckpt,
            TEST_STEP_FILE=tmp_path / "step.json", **env)
    return out, json.loads((tmp_path / "step.json").read_text())["step"]


@pytest.mark.parametrize("cut_step, args", [
    (2, ()),                                       # early in the first epoch
    (STEPS_PER_EPOCH, ()),                         # last batch of epoch 1: an epoch boundary
    (MLP_STEPS - 1, ()),                           # one step before the end
    (9, ("--sched", "step")),                      # per-iteration scheduler: replayed
    (2 * STEPS_PER_EPOCH, ("--sched", "step")),    # ... at an epoch boundary
    (STEPS_PER_EPOCH + 1, ("--workers", "2", "--loader-generator")),  # workers' RNG, seeded
                                                   # loader generator
    (8, ("--two-optimizers",)),                    # several optimizers, stepped in turn
    (10, ("--ema", "before-step")),                # a deepcopy'd EMA model is state too
], ids=["cut-2", "cut-6-epoch-end", "cut-23-last-but-one", "per-step-sched-cut-9",
        "per-step-sched-cut-12-epoch-end", "workers-2-generator-cut-7-epoch-start",
        "two-optimizers-cut-8", "ema-deepcopy-cut-10"])
def test_single_process_script_resumes_bit_exactly(tmp_path, uninterrupted, cut_step, args):
    expected = uninterrupted(*args)
    out, final_step = _preempt_and_resume(tmp_path, MLP, args, cut_step)
    assert_same_bits(expected, load_state(out))
    assert final_step == MLP_STEPS


def test_a_resumed_run_can_be_preempted_and_resumed_again(tmp_path, uninterrupted):
    first = tmp_path / "first"
    first.mkdir()
    ckpt1 = first / "ckpt"
    _run_ok(MLP, ["--out", tmp_path / "x.pt"], TEST_CUT_STEP=4, TEST_SAVE_DIR=ckpt1)
    ckpt2 = tmp_path / "ckpt2"
    _run_ok(MLP, ["--out", tmp_path / "x.pt"], MERIDIAN_RESUME=ckpt1, TEST_CUT_STEP=15,
            TEST_SAVE_DIR=ckpt2)
    out = tmp_path / "final.pt"
    _run_ok(MLP, ["--out", out], MERIDIAN_RESUME=ckpt2)
    assert_same_bits(uninterrupted(), load_state(out))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ddp(tmp_path, out, **env):
    # The free port is probed, then bound by rank 0's store: another process may take it in
    # between. Only that case is retried, and it is recognisable by its error.
    for _attempt in range(3):
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, str(HARNESS), str(DDP), "--out", str(out)],
                                  env=_env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=r,
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        results = [p.communicate(timeout=300) for p in procs]
        errors = "".join(err for _, err in results)
        if any(p.returncode for p in procs) and "address already in use" in errors.lower():
            continue
        for p, (_, err) in zip(procs, results):
            assert p.returncode == 0, err[-3000:]
        return
    pytest.fail("no free port for the gloo rendezvous after 3 tries")


@pytest.fixture(scope="module")
def ddp_uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    _run_ddp(root, root / "base.pt")
    return [load_state(f"{root}/base.pt.rank{r}") for r in range(2)]


@pytest.mark.parametrize("cut_step", [4, 7], ids=["cut-4-epoch-end", "cut-7"])
def test_two_rank_ddp_script_resumes_bit_exactly(tmp_path, ddp_uninterrupted, cut_step):
    ckpt = tmp_path / "ckpt"
    _run_ddp(tmp_path, tmp_path / "never.pt", TEST_CUT_STEP=cut_step, TEST_SAVE_DIR=ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["rank-0", "rank-1"]
    _run_ddp(tmp_path, tmp_path / "resumed.pt", MERIDIAN_RESUME=ckpt)
    for r in range(2):
        assert_same_bits(ddp_uninterrupted[r], load_state(f"{tmp_path}/resumed.pt.rank{r}"))


# --------------------------------------------------------------------------- refusals

def _refused(proc, words):
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "UNRESUMABLE:" in proc.stderr and words in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def checkpoint_at_8(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("refusals") / "ckpt"
    _run_ok(MLP, ["--out", ckpt.parent / "x.pt"], TEST_CUT_STEP=8, TEST_SAVE_DIR=ckpt)
    return ckpt


@pytest.mark.parametrize("args, words", [
    (("--n", "112"), "DataLoader #1 differs from the checkpoint"),
    (("--hidden", "24"), "optimizer #1 differs from the checkpoint"),
    (("--two-optimizers",), "optimizer #1 differs from the checkpoint"),
], ids=["dataset-length-changed", "model-shape-changed", "different-optimizers"])
def test_a_script_built_differently_on_resume_is_refused(tmp_path, checkpoint_at_8, args, words):
    _refused(_run(MLP, ["--out", tmp_path / "o.pt", *args], MERIDIAN_RESUME=checkpoint_at_8),
             words)
    assert not (tmp_path / "o.pt").exists()


def test_optimizers_built_in_another_order_are_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _run_ok(MLP, ["--out", tmp_path / "x.pt", "--two-optimizers"], TEST_CUT_STEP=8,
            TEST_SAVE_DIR=ckpt)
    proc = _run(MLP, ["--out", tmp_path / "o.pt", "--two-optimizers", "--swap-optimizers"],
                MERIDIAN_RESUME=ckpt)
    _refused(proc, "optimizer #1 differs from the checkpoint")


def test_a_world_size_mismatch_is_refused(checkpoint_at_8):
    with pytest.raises(framework.UnresumableScript, match="has world size 1, this job runs 2"):
        framework.FrameworkTracker(rank=0, world_size=2, resume_dir=checkpoint_at_8)


def test_a_missing_rank_is_refused(tmp_path, checkpoint_at_8):
    with pytest.raises(framework.UnresumableScript, match="rank-0.*missing"):
        framework.FrameworkTracker(rank=0, world_size=1, resume_dir=tmp_path / "nothing-here")
    # a rank whose folder was not copied along
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_at_8, ckpt)
    os.rename(ckpt / "rank-0", ckpt / "rank-7")
    with pytest.raises(framework.UnresumableScript, match="rank-0"):
        framework.FrameworkTracker(rank=0, world_size=1, resume_dir=ckpt)


def test_a_corrupt_rank_file_is_refused_naming_the_file(tmp_path, checkpoint_at_8):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_at_8, ckpt)
    state = ckpt / "rank-0" / "state.pt"
    payload = bytearray(state.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    state.write_bytes(bytes(payload))
    with pytest.raises(framework.UnresumableScript, match="state.pt is corrupt: sha256"):
        framework.FrameworkTracker(rank=0, world_size=1, resume_dir=ckpt)
    # and the process path says so before the script runs
    _refused(_run(MLP, ["--out", tmp_path / "o.pt"], MERIDIAN_RESUME=ckpt), "state.pt")


class _RunsCodeWhenUnpickled:
    """What a node could plant: a pickle that runs a command when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_state_file_with_a_matching_manifest_is_refused_without_running_it(tmp_path, checkpoint_at_8):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_at_8, ckpt)
    rank_dir = ckpt / "rank-0"
    marker = tmp_path / "code-ran"
    state = torch.load(rank_dir / "state.pt", weights_only=True)
    state["payload"] = _RunsCodeWhenUnpickled(marker)
    torch.save(state, rank_dir / "state.pt")
    fields = json.loads((rank_dir / "MANIFEST.json").read_text())
    digest, size = store.sha256_file(rank_dir / "state.pt")
    files = {"state.pt": {"size": size, "sha256": digest}}
    store.write_manifest(rank_dir, files, **{k: v for k, v in fields.items()
                                            if k not in ("format", "bytes", "files", "files_sha256")})

    with pytest.raises(framework.UnresumableScript, match="cannot read .*state.pt"):
        framework.FrameworkTracker(rank=0, world_size=1, resume_dir=ckpt)
    assert not marker.exists()


def test_a_checkpoint_of_the_other_engine_is_refused(tmp_path, checkpoint_at_8):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_at_8, ckpt)
    manifest = ckpt / "rank-0" / "MANIFEST.json"
    fields = json.loads(manifest.read_text())
    fields["engine"] = "criu"
    manifest.write_text(json.dumps(fields))
    with pytest.raises(framework.UnresumableScript, match="engine 'criu'"):
        framework.FrameworkTracker(rank=0, world_size=1, resume_dir=ckpt)


def test_random_draws_between_step_and_the_next_batch_refuse_the_checkpoint(tmp_path):
    proc = _run(MLP, ["--out", tmp_path / "o.pt", "--rng-after-step"], TEST_CUT_STEP=5,
                TEST_SAVE_DIR=tmp_path / "ckpt")
    _refused(proc, "draws random numbers between optimizer.step() and the next batch")
    assert not (tmp_path / "ckpt" / "rank-0").exists()


def test_evaluation_with_a_dataloader_between_step_and_the_next_batch_is_refused(tmp_path):
    proc = _run(MLP, ["--out", tmp_path / "o.pt", "--eval-after-step"], TEST_CUT_STEP=5,
                TEST_SAVE_DIR=tmp_path / "ckpt")
    _refused(proc, "draws random numbers between optimizer.step() and the next batch")


def test_a_model_update_between_step_and_the_next_batch_refuses_the_checkpoint(tmp_path):
    proc = _run(MLP, ["--out", tmp_path / "o.pt", "--ema", "after-step"], TEST_CUT_STEP=5,
                TEST_SAVE_DIR=tmp_path / "ckpt")
    _refused(proc, "modified between optimizer.step() and the next batch")


def test_a_cut_at_the_first_step_is_refused_until_the_loop_was_observed(tmp_path):
    proc = _run(MLP, ["--out", tmp_path / "o.pt"], TEST_CUT_STEP=1,
                TEST_SAVE_DIR=tmp_path / "ckpt")
    _refused(proc, "cut after a later step")


def test_a_loop_without_a_dataloader_is_refused(tmp_path):
    plain = SCRIPTS / "plain_loop.py"
    _refused(_run(plain, ["--out", tmp_path / "o.pt"], TEST_CUT_STEP=3,
                  TEST_SAVE_DIR=tmp_path / "ckpt"), "no batch has been fetched")


def test_a_resumed_script_that_never_reaches_the_cut_fails_loudly(tmp_path, checkpoint_at_8):
    # with one epoch the loop ends before epoch 2, where the cut was: nothing was restored
    proc = _run(MLP, ["--out", tmp_path / "o.pt", "--epochs", "1"],
                MERIDIAN_RESUME=checkpoint_at_8)
    assert proc.returncode == 75 and "NOT restored" in proc.stderr, proc.stderr[-2000:]
