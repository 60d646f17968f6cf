"""A job over several hosts: each host's ranks are pinned to the devices the control plane gave that
host (issue 14 §3). Before, the launcher's device map was job-wide (8 devices over 2 hosts), so a
host's 4 ranks were spread over its affinity by the job's numbering, and the agent launched without
--device-indices at all ("not pinned", logged per launch)."""
import json
import os

import pytest

from protocol.launch import SandboxSpec
from runtime import launcher
from runtime import spool as spool_files
from runtime.splice import device_map

pytestmark = pytest.mark.runtime


def test_a_hosts_map_lists_only_its_own_devices_under_their_job_wide_numbers():
    mapping = device_map(world_size=8, devices=8, ranks=range(4, 8),
                         device_cores=[(8, 9), (10, 11), (12, 13), (14, 15)])
    assert mapping["devices"] == {"4": [8, 9], "5": [10, 11], "6": [12, 13], "7": [14, 15]}
    assert mapping["ranks"] == {"4": 4, "5": 5, "6": 6, "7": 7}
    # spliced: W = 8 on 4 devices over 2 hosts, 2 devices and 4 ranks per host
    spliced = device_map(world_size=8, devices=4, ranks=range(0, 4), device_cores=[(0,), (1,)])
    assert spliced == {"devices": {"0": [0], "1": [1]}, "ranks": {"0": 0, "1": 0, "2": 1, "3": 1}}
    # one host: the whole map, as before
    assert device_map(world_size=4, devices=2, device_cores=[(2, 3), (6,)])["ranks"] == {
        "0": 0, "1": 0, "2": 1, "3": 1}
    with pytest.raises(ValueError, match="on this host"):
        device_map(world_size=8, devices=8, ranks=range(0, 4), device_cores=[(0,)] * 8)


def test_hosts_holding_unequal_device_counts_run_blocks_in_proportion():
    # W = 6 on 3 devices (2 ranks each) over 2 hosts holding 2 + 1 devices: ranks 0..3 and 4..5
    leader = device_map(world_size=6, devices=3, ranks=range(0, 4), device_cores=[(0,), (1,)])
    assert leader == {"devices": {"0": [0], "1": [1]}, "ranks": {"0": 0, "1": 0, "2": 1, "3": 1}}
    follower = device_map(world_size=6, devices=3, ranks=range(4, 6), device_cores=[(5,)])
    assert follower == {"devices": {"2": [5]}, "ranks": {"4": 2, "5": 2}}
    # a block that would share a device with another host's ranks is refused by name
    with pytest.raises(ValueError, match="not whole devices"):
        device_map(world_size=6, devices=3, ranks=range(0, 3))
    with pytest.raises(ValueError, match="not whole devices"):
        device_map(world_size=6, devices=3, ranks=range(1, 5))


def _launcher(tmp_path, *, node_rank, indices, device_kind="cpu", ranks="8", devices="8", nodes="2", block=()):
    spec = SandboxSpec(unconfined_reason="test", device_kind=device_kind, node_devices=8,
                       node_cores=tuple(range(16)))
    (tmp_path / "sandbox.json").write_text(json.dumps(spec.to_dict()))
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    options = launcher.parse_args([
        "--ranks", ranks, "--devices", devices, "--nodes", nodes, "--node-rank", str(node_rank),
        *(("--first-rank", str(block[0]), "--host-ranks", str(block[1])) if block else ()),
        "--node-addr", "10.0.0.2",
        "--rendezvous", str(tmp_path / "rdv"), "--device-indices", indices, "--sandbox", str(tmp_path / "sandbox.json"),
        "--job-dir", str(tmp_path / f"job{node_rank}"), "--job-id", "j7-g3", "--engine", "framework", str(script)])
    return launcher.Launcher(options)


def test_each_hosts_ranks_get_the_cores_behind_that_hosts_own_device_indices(tmp_path, monkeypatch):
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    # host 1 holds its node's devices 2, 3, 5, 6 (of 8, two cores each): its ranks 4..7 run there
    follower = _launcher(tmp_path, node_rank=1, indices="2,3,5,6")
    assert follower.device_map.plain() == {"devices": {"4": [4, 5], "5": [6, 7], "6": [10, 11], "7": [12, 13]},
                                           "ranks": {"4": 4, "5": 5, "6": 6, "7": 7}}
    assert follower.devices == 8 and follower.device_indices == (2, 3, 5, 6)
    leader = _launcher(tmp_path, node_rank=0, indices="0,1,2,3")
    assert leader.device_map.plain()["devices"] == {"0": [0, 1], "1": [2, 3], "2": [4, 5], "3": [6, 7]}
    with pytest.raises(launcher.LaunchError, match="this host runs 4"):
        _launcher(tmp_path, node_rank=0, indices="0,1,2,3,4,5,6,7")  # the job's count, not the host's


def test_on_a_gpu_node_each_hosts_ranks_see_only_that_hosts_gpus(tmp_path, monkeypatch):
    """The environment only (no GPU on the machines this is tested on)."""
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    follower = _launcher(tmp_path, node_rank=1, indices="4,5,6,7", device_kind="gpu")
    follower.engine = "framework"
    env = follower.rank_env(5)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and env["LOCAL_RANK"] == "1" and env["RANK"] == "5"
    assert env[launcher.CUDA_DEVICE_ENV] == "1"


def _gpu_layout(launch):
    launch.engine = "framework"
    envs = [launch.rank_env(rank) for rank in launch.local_ranks]
    return [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e.get(launcher.CUDA_DEVICE_ENV)) for e in envs]


def test_a_spliced_gpu_jobs_local_rank_names_the_gpu_its_rank_shares(tmp_path, monkeypatch):
    """Issue 17: a GPU script picks its GPU by LOCAL_RANK (cuda:LOCAL_RANK, set_device(LOCAL_RANK)).
    Spliced (W = 8 on 4 GPUs over 2 hosts: 2 GPUs and 4 ranks per host), LOCAL_RANK was the rank's
    place in its host's block (0..3) and ranks 2 and 3 of each host asked for GPUs cuda:2 and cuda:3,
    which their host's job does not see (CUDA_VISIBLE_DEVICES lists 2): it is now the index of the
    rank's GPU, shared by the ranks of one GPU, and LOCAL_WORLD_SIZE how many GPUs the job has there."""
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    follower = _launcher(tmp_path, node_rank=1, indices="6,7", device_kind="gpu", devices="4")
    assert _gpu_layout(follower) == [("4", "0", "2", "0"), ("5", "0", "2", "0"), ("6", "1", "2", "1"),
                                     ("7", "1", "2", "1")]
    assert follower.rank_env(6)["CUDA_VISIBLE_DEVICES"] == "6,7"
    # unequal blocks (W = 6 on 3 GPUs, this host holding 1 of them): one GPU, ranks 4 and 5 on it
    lone = _launcher(tmp_path, node_rank=1, indices="3", device_kind="gpu", ranks="6", devices="3", block=(4, 2))
    assert _gpu_layout(lone) == [("4", "0", "1", "0"), ("5", "0", "1", "0")]
    # on CPU devices LOCAL_RANK stays the rank's place in its host's block, as torchrun's
    cpu = _launcher(tmp_path, node_rank=1, indices="6,7", device_kind="cpu", devices="4")
    assert _gpu_layout(cpu) == [("4", "0", "4", None), ("5", "1", "4", None), ("6", "2", "4", None),
                                ("7", "3", "4", None)]


def test_a_gpu_jobs_launcher_refuses_to_resize_it_in_place(tmp_path, monkeypatch):
    """A live resize re-pins running ranks to other cores; a GPU rank would go on computing on the GPU
    it started on (its CUDA_VISIBLE_DEVICES, LOCAL_RANK and tensors), one the job may no longer hold.
    The control plane resizes a GPU job by a relaunch (tests/jobs/test_gpu_resize.py); a resize that
    reaches its launcher anyway is refused with the reason, nothing touched."""
    from protocol.launch import ControlFailure, ResizeRequest
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    gpu = _launcher(tmp_path, node_rank=1, indices="4,5,6,7", device_kind="gpu")
    before = gpu.device_map.plain()
    answer = gpu.do_resize(ResizeRequest(devices=4, device_indices=(4, 5, 6, 7)))
    assert isinstance(answer, ControlFailure) and answer.error == launcher.GPU_RESIZE_REFUSAL
    assert gpu.device_map.plain() == before and gpu.device_indices == (4, 5, 6, 7)


def test_the_launchers_cuda_device_variable_is_the_one_the_ranks_read():
    from runtime import cudagroup  # the launcher names it without importing torch
    assert launcher.CUDA_DEVICE_ENV == cudagroup.CUDA_DEVICE_ENV
    assert launcher.CUDA_GPU_ENV == cudagroup.CUDA_GPU_ENV


def test_a_gpu_rank_is_told_its_gpus_uuid_and_the_resume_file_names_the_hosts_gpus(tmp_path, monkeypatch):
    """The fold's key of a rank's GPU (runtime/cudagroup.device_key) is its UUID from the launcher, at
    the start and at every resume: a CRIU restore may map the rank's CUDA state onto another GPU under
    the device number it keeps (runtime/criu_cuda.py), which torch's cached properties do not see."""
    from protocol.cut import ResumeFile
    from runtime import criu_cuda, spool
    from runtime.engines import follow_host_layout
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    listing = tmp_path / "gpus"
    uuids = [f"GPU-{i:08x}-0000-4000-8000-00000000000{i}" for i in range(8)]
    for index, uuid in enumerate(uuids):  # the driver's listing: bus order = NVML's = the agent's
        (listing / f"0000:{16 + index:02x}:00.0").mkdir(parents=True)
        (listing / f"0000:{16 + index:02x}:00.0" / "information").write_text(
            f"GPU UUID: \t {uuid}\nDevice Minor: \t {7 - index}\n")
    monkeypatch.setattr(criu_cuda, "NVIDIA_GPUS", str(listing))
    follower = _launcher(tmp_path, node_rank=1, indices="6,7", device_kind="gpu", devices="4")
    follower.engine = "framework"
    assert [follower.rank_env(rank)[launcher.CUDA_GPU_ENV] for rank in (4, 5, 6, 7)] == [uuids[6], uuids[6],
                                                                                         uuids[7], uuids[7]]
    follower.master_port = 29500  # the rendezvous is not started here
    follower.resume_ranks(9)
    resume = ResumeFile.from_dict(spool.read_json(spool.resume_path(follower.spool, 9)))
    assert resume.gpu_uuids == (uuids[6], uuids[7])
    monkeypatch.setattr(os, "environ", {launcher.CUDA_DEVICE_ENV: "1", launcher.CUDA_GPU_ENV: "GPU-old"})
    follow_host_layout(resume, rank=7, world_size=8)
    assert os.environ[launcher.CUDA_GPU_ENV] == uuids[7]
    # without the driver's listing (no driver, a GPU it does not list) nothing is said: torch's word
    monkeypatch.setattr(criu_cuda, "NVIDIA_GPUS", str(tmp_path / "none"))
    assert launcher.CUDA_GPU_ENV not in follower.rank_env(4) and follower.gpu_uuids() is None
    cpu = _launcher(tmp_path, node_rank=1, indices="6,7", device_kind="cpu", devices="4")
    assert cpu.gpu_uuids() is None


def test_each_host_checks_at_a_resume_the_part_of_the_checkpoint_it_restores_not_the_others(tmp_path, monkeypatch):
    # runtime/criu_parts.py: a job on N hosts reads its checkpoint once in all, not N times.
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    follower, leader = (_launcher(tmp_path, node_rank=node, indices="0,1,2,3").store for node in (1, 0))
    assert follower.skip_parts_of({"nodes": 2}) == {"node0"} and leader.skip_parts_of({"nodes": 2}) == {"node1"}
    # Dumped on 4 hosts (W = 8: 2 ranks a part), restored on 2: each host reads the 2 parts of its ranks.
    assert follower.skip_parts_of({"nodes": 4}) == {"node0", "node1"}
    assert leader.skip_parts_of({"nodes": 4}) == {"node2", "node3"}
    assert leader.skip_parts_of({"nodes": 1}) == set()  # dumped on one host: no parts, everything is read


def test_a_host_given_its_block_runs_it_on_its_devices_and_bad_blocks_are_usage_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("MERIDIAN_SPOOL_ROOT", str(tmp_path / "spool"))
    # W = 6 on 3 devices over 2 hosts holding 2 + 1 devices (the control plane's span)
    leader = _launcher(tmp_path, node_rank=0, indices="0,1", ranks="6", devices="3", block=(0, 4))
    assert leader.local_ranks == range(0, 4) and leader.device_map.plain()["ranks"] == {"0": 0, "1": 0, "2": 1, "3": 1}
    follower = _launcher(tmp_path, node_rank=1, indices="3", ranks="6", devices="3", block=(4, 2))
    assert follower.local_ranks == range(4, 6) and follower.device_map.plain()["devices"] == {"2": [6, 7]}
    follower.engine = "framework"
    env = follower.rank_env(5)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["RANK"]) == ("1", "2", "5")
    # resumed ranks take their host's block from the resume file (engines.follow_host_layout)
    follower.master_port = 1
    follower.resume_ranks(3)
    resume = json.loads(spool_files.resume_path(follower.spool, 3).read_text())
    assert (resume["first_rank"], resume["host_ranks"], resume["nodes"], resume["node_rank"]) == (4, 2, 2, 1)
    cases = [
        (dict(node_rank=1, indices="3", block=(4, 3)), "not inside the job's ranks 0..5"),
        (dict(node_rank=0, indices="0,1", block=(2, 4)), "node 0 leads"),
        (dict(node_rank=1, indices="2", block=(3, 3)), "not whole devices"),
        (dict(node_rank=1, indices="2", nodes="3", block=(1, 2)), "not whole devices"),
        (dict(node_rank=1, indices="2", block=(2, 3)), "last of 2"),
        (dict(node_rank=1, indices="2", nodes="3", block=(4, 2)), "leaves fewer ranks than hosts"),
        (dict(node_rank=1, indices="2,3", block=(4, 2)), "this host runs 1"),
        (dict(node_rank=1, indices="2", block=(4, None)), "go together"),
    ]
    for fields, message in cases:
        block = fields.pop("block")
        if block[1] is None:  # only one of the two flags
            options = ["--first-rank", str(block[0])]
            with pytest.raises(launcher.LaunchError, match=message) as caught:
                launcher.Launcher(launcher.parse_args([
                    "--ranks", "6", "--devices", "3", "--nodes", "2", "--node-rank", "1", *options,
                    "--rendezvous", str(tmp_path / "rdv"), "--job-dir", str(tmp_path / "x"),
                    str(tmp_path / "noop.py")]))
        else:
            with pytest.raises(launcher.LaunchError, match=message) as caught:
                _launcher(tmp_path, ranks="6", devices="3", block=block, **fields)
        assert caught.value.code == launcher.EXIT_USAGE, message
