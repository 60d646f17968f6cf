"""The CRIU engine's CUDA bookkeeping (runtime/criu_cuda.py, issue 17 §3), on a machine without a GPU.

What runs here for real: finding the processes of a rank's tree that hold a GPU (real processes;
the one "GPU file" is a plain file a child opens at /dev/nvidia0 in a mount namespace of its own),
naming GPUs from the driver's /proc listing (a copy of its format), the GPU map of a restore, the
driver's argument block as NVIDIA's header lays it out, and a CRIU stop of a job whose rank holds
a GPU file: refused with the reason (this machine has no NVIDIA driver), the job going on. The
driver calls themselves (lock, checkpoint, restore with a map, unlock) need a GPU: bench/gpu_checks.py."""
import ctypes
import os
import subprocess
import time

import pytest
import torch
from runtime_helpers import JOB_TIMEOUT_S, SCRIPTS, Job, needs_criu, unique_id

from runtime import criu_cuda, cuda_checkpoint
from runtime.control import JobControlError
from runtime.engines import RankProcess

pytestmark = pytest.mark.runtime
H200 = "GPU-3f1c2a9e-0000-4b7d-9c11-5e2f00a1b2c3"
H200_B = "GPU-00000000-1200-4b7d-9c11-5e2f00a1b2ff"  # leading zero bytes: the block must keep them


def information(minor, uuid, bus):
    # The lines the driver writes in /proc/driver/nvidia/gpus/<bus>/information (others elided).
    return (f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 150\nGPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.af.00.01\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t No\n")


@pytest.fixture
def gpus_root(tmp_path):
    root = tmp_path / "gpus"
    # Minors need not follow the bus order: the index is the bus order (NVML's, the agent's).
    for bus, minor, uuid in (("0000:9a:00.0", 0, H200_B), ("0000:1b:00.0", 1, H200)):
        (root / bus).mkdir(parents=True)
        (root / bus / "information").write_text(information(minor, uuid, bus))
    (root / "0000:ff:00.0").mkdir()  # listed without its information: not a GPU anyone can be given
    return root


def test_the_node_gpus_are_read_from_the_driver_listing_in_pci_bus_order(gpus_root, tmp_path):
    gpus = criu_cuda.node_gpus(str(gpus_root))
    assert [(g.index, g.minor, g.uuid, g.bus_id) for g in gpus] == [
        (0, 1, H200, "0000:1b:00.0"), (1, 0, H200_B, "0000:9a:00.0")]
    assert criu_cuda.node_gpus(str(tmp_path / "no-driver")) == []


def test_the_gpus_a_process_holds_are_named_by_their_device_minor(gpus_root):
    gpus = criu_cuda.node_gpus(str(gpus_root))
    files = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia0", "/dev/nvidia1"]
    assert criu_cuda.gpus_of_files(files, gpus) == [H200, H200_B]  # in index order, each once
    assert criu_cuda.gpus_of_files(["/dev/nvidiactl"], gpus) == []
    with pytest.raises(criu_cuda.CudaRefusal, match="/dev/nvidia7, a GPU the driver does not list"):
        criu_cuda.gpus_of_files(["/dev/nvidia7"], gpus)
    with pytest.raises(criu_cuda.CudaRefusal, match="MIG instance"):
        criu_cuda.gpus_of_files(["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21"], gpus)


@pytest.mark.parametrize("held, now, driver, pairs", [
    ([H200], None, 12080, []),           # a launcher started by hand: back on the GPU it held
    ([H200], H200, 12080, []),           # the same GPU: no map, any driver
    ([], H200_B, 12080, []),             # held only the driver's files
    ([H200], H200_B, 13000, [(H200, H200_B)]),
], ids=["unknown", "same", "no-gpu", "moved"])
def test_a_restore_maps_the_gpu_only_where_the_rank_moved(held, now, driver, pairs):
    assert criu_cuda.restore_pairs(held, now, driver_version=driver) == pairs


def test_a_restore_the_driver_or_the_engine_cannot_map_is_refused_with_its_reason():
    with pytest.raises(criu_cuda.CudaRefusal, match=r"restores CUDA state only onto the GPU it left: a driver >= 580"):
        criu_cuda.restore_pairs([H200], H200_B, driver_version=12090)
    with pytest.raises(criu_cuda.CudaRefusal, match="held 2 GPUs"):
        criu_cuda.restore_pairs([H200, H200_B], H200, driver_version=13000)


def test_the_restore_block_is_laid_out_as_the_driver_header_says():
    # CUcheckpointRestoreArgs: gpuPairs, gpuPairsCount, reserved[52 - sizeof(pointer)], reserved1.
    assert ctypes.sizeof(cuda_checkpoint._RestoreArgs) == 64
    assert cuda_checkpoint._RestoreArgs.reserved1.offset == 56
    assert ctypes.sizeof(cuda_checkpoint._GpuPair) == 32
    args = cuda_checkpoint.restore_args([(H200, H200_B)])
    raw = ctypes.string_at(ctypes.addressof(args.gpuPairs[0]), 32)
    assert args.gpuPairsCount == 1
    assert raw.hex() == (H200[4:] + H200_B[4:]).replace("-", "")
    empty = cuda_checkpoint.restore_args([])
    assert empty.gpuPairsCount == 0 and not empty.gpuPairs
    assert bytes(empty) == bytes(64)
    with pytest.raises(ValueError, match="not a GPU UUID"):
        cuda_checkpoint.uuid_bytes("MIG-3f1c2a9e-0000-4b7d-9c11-5e2f00a1b2c3")


# -- real processes -----------------------------------------------------------------------------------
HOLD = "mount -t tmpfs meridian-test-dev /dev && exec 3>/dev/{name} && echo held && exec sleep 60"


def hold_gpu_file(name, *, nested=False):
    """Returns a process that holds /dev/<name> open (a plain file on a tmpfs /dev of its own mount
    namespace), or, `nested`, a shell whose child does."""
    holder = ["unshare", "--mount", "--propagation", "private", "sh", "-c", HOLD.format(name=name)]
    command = ["sh", "-c", '"$@" & wait', "sh", *holder] if nested else holder
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    if process.stdout.readline() != b"held\n":
        process.kill()
        pytest.fail(f"the holder never opened /dev/{name}")
    return process


@pytest.fixture
def processes():
    started = []
    yield started
    for process in started:
        process.kill()
        process.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_ranks_holding_no_gpu_give_an_empty_cut_and_never_load_the_driver(processes):
    plain = subprocess.Popen(["sleep", "60"])
    processes.append(plain)
    cut = criu_cuda.checkpoint_ranks([RankProcess(0, plain.pid)])
    assert cut.empty and cut._lib is None  # this machine has no driver: loading it would have refused
    cut.record(0, "/nonexistent")  # nothing to write for a rank without CUDA state


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_a_rank_whose_tree_holds_a_gpu_is_refused_without_a_driver_naming_the_rank(processes, gpus_root):
    # The GPU file is held by a child of the rank's process (a DataLoader worker, say): the whole
    # tree is looked at.
    parent = hold_gpu_file("nvidia1", nested=True)
    processes.append(parent)
    with pytest.raises(criu_cuda.CudaRefusal) as refused:
        criu_cuda.checkpoint_ranks([RankProcess(3, parent.pid)], gpus_root=str(gpus_root))
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("this machine has an NVIDIA driver: the refusal for its absence cannot be seen")
    assert str(refused.value).startswith("ranks [3] hold CUDA state, and no NVIDIA driver here")
    # Without the driver's listing the file names no GPU anyone was given.
    with pytest.raises(criu_cuda.CudaRefusal, match=r"rank 3 \(process \d+\): it holds /dev/nvidia1, a GPU the driver"):
        criu_cuda.checkpoint_ranks([RankProcess(3, parent.pid)], gpus_root=str(gpus_root / "absent"))


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_a_rank_with_two_processes_holding_gpus_is_refused(processes, gpus_root):
    first, second = hold_gpu_file("nvidia0"), hold_gpu_file("nvidia1")
    processes.extend([first, second])
    with pytest.raises(criu_cuda.CudaRefusal, match="second process of rank 0 holding a GPU"):
        criu_cuda.checkpoint_ranks([RankProcess(0, os.getpid())], gpus_root=str(gpus_root))


# -- through the launcher ----------------------------------------------------------------------------
@pytest.mark.criu
@needs_criu
def test_a_criu_stop_of_a_rank_holding_a_gpu_is_refused_here_and_the_job_goes_on(tmp_path, jobs):
    out = tmp_path / "out.pt"
    hold = tmp_path / "hold"
    hold.touch()
    args = [str(SCRIPTS / "manual_sgd.py"), str(out), "--iters", "20", "--sleep", "0.02", "--hold-while", str(hold)]
    job = Job(tmp_path / "node", ranks=1, script=SCRIPTS / "gpu_file_holder.py", out=args[0],
              script_args=args[1:], engine="criu", job_id=unique_id("gpu-file"))
    jobs.append(job)
    job.wait_ready()
    log = job.job_dir / "logs" / "rank0.log"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (log.exists() and "iter 3\n" in log.read_text(errors="replace")):
        assert time.monotonic() < deadline and job.process.poll() is None, job.output()
        time.sleep(0.05)
    with pytest.raises(JobControlError) as refused:
        job.control.stop()
    message = str(refused.value)
    assert "stop refused at step" in message and "the job goes on" in message
    assert "holds /dev/nvidia0" in message or "no NVIDIA driver here" in message, message
    hold.unlink()
    job.finish(0)
    assert torch.load(out).keys()  # the job went on to its end and saved
    events = (job.job_dir / "events.jsonl").read_text()
    assert '"event": "checkpoint"' not in events
