"""Proofs for folding (runtime/fold.py) under meridian-run: an unmodified DDP script's final
parameters and optimizer state are bitwise the unfolded run's for 4x1, 2x2 and 1x4 folded layouts
and across resizes (the fold is rebuilt at each cut); a job that asks for NCCL without a CUDA
device is refused with what is missing; the GPU runs are marked and skip with "no GPU"."""
import pytest
import torch
from runtime_helpers import DDP_ARGS, DDP_SCRIPT, Job, assert_same_state, reference_state, unique_id

from runtime import cudagroup, vpg

pytestmark = [pytest.mark.runtime]
NO_GPU = cudagroup.cuda_missing()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU: {NO_GPU}")


def _folded_note(job, devices):
    return f"folded 4 ranks onto {devices} device(s)" in job.output()


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 2, 1], ids=["4x1", "2x2", "1x4"])
def test_a_folded_ddp_job_ends_bitwise_where_the_unfolded_run_ends(devices, tmp_path, jobs, reference_tmp):
    expected = reference_state("ddp", reference_tmp)  # 4 ranks on 4 devices, unfolded
    out = tmp_path / "out.pt"
    job = Job(tmp_path / "node", ranks=4, script=DDP_SCRIPT, out=out, script_args=DDP_ARGS,
              engine="framework", devices=devices, job_id=unique_id("fold"), launcher_args=["--fold"])
    jobs.append(job)
    job.finish(0)
    assert _folded_note(job, devices), f"the job did not fold:\n{job.output()}"
    assert_same_state(expected, out)


@pytest.mark.slow
def test_a_folded_job_resized_4_2_1_4_refolds_at_each_cut_and_ends_bitwise_the_same(tmp_path, jobs, reference_tmp):
    expected = reference_state("ddp", reference_tmp)
    out = tmp_path / "out.pt"
    job = Job(tmp_path / "node", ranks=4, script=DDP_SCRIPT, out=out,
              script_args=DDP_ARGS + ["--step-sleep", "0.1"], engine="framework", devices=4,
              job_id=unique_id("fold-resize"), launcher_args=["--fold"])
    jobs.append(job)
    job.wait_ready()
    for devices, at_step in ((2, 6), (1, 14), (4, 24)):
        assert job.control.resize(devices, at_step=at_step)["devices"] == devices
    job.finish(0)
    for devices in (4, 2, 1):
        assert _folded_note(job, devices), f"no fold onto {devices} device(s):\n{job.output()}"
    assert_same_state(expected, out)


def test_without_fold_a_cpu_job_does_not_fold(tmp_path, jobs):
    # Today's CPU jobs keep their transports unless folding is asked for.
    out = tmp_path / "out.pt"
    job = Job(tmp_path / "node", ranks=4, script=DDP_SCRIPT, out=out, script_args=["--epochs", "1"],
              engine="framework", devices=2, job_id=unique_id("nofold"))
    jobs.append(job)
    job.finish(0)
    assert "folded" not in job.output()


@pytest.mark.skipif(NO_GPU is None, reason="a CUDA device is visible: NCCL is not refused here")
def test_asking_for_nccl_without_a_cuda_device_says_what_is_missing(tmp_path, jobs):
    with pytest.raises(RuntimeError, match="needs a CUDA device, and .*(without CUDA|no CUDA device|sees no device)"):
        vpg._wants_cuda("nccl")
    assert vpg._wants_cuda(None) is False  # backend=None: gloo where no CUDA device is visible
    with pytest.raises(RuntimeError, match="'mpi' is not available under meridian-run"):
        vpg._wants_cuda("mpi")
    # And under meridian-run, an unmodified script that asks for NCCL fails with that message.
    job = Job(tmp_path / "node", ranks=2, script=DDP_SCRIPT, out=tmp_path / "out.pt",
              script_args=["--epochs", "1", "--backend", "nccl"], engine="framework",
              job_id=unique_id("nccl"))
    jobs.append(job)
    assert job.wait() != 0
    assert "backend 'nccl' needs a CUDA device" in job.output()


@pytest.mark.gpu
@needs_gpu
def test_an_nccl_ddp_job_on_one_gpu_folds_every_logical_device_onto_it_with_the_same_bits(tmp_path, jobs):
    # UNPROVEN until run on a GPU. On a GPU the fold's key is the physical CUDA device, so 4 ranks
    # on 4, 2 or 1 logical devices of one GPU all fold onto one member (NCCL would refuse the
    # GPU twice in one communicator), and the rank-order contract gives the same bits.
    outs = []
    for devices in (4, 2, 1):
        out = tmp_path / f"out{devices}.pt"
        job = Job(tmp_path / f"node{devices}", ranks=4, script=DDP_SCRIPT, out=out,
                  script_args=DDP_ARGS + ["--backend", "nccl"], engine="framework", devices=devices,
                  job_id=unique_id("gpu-fold"))
        jobs.append(job)
        job.finish(0)
        assert _folded_note(job, 1), job.output()
        outs.append(out)
    assert torch.cuda.is_available()
    for out in outs[1:]:
        assert_same_state(outs[0], out)
