"""Launcher <-> ranks messages: the device map, the cut request, the rank's report, the resume file."""
import os

import pytest

from protocol import ProtocolError
from protocol.cut import CutReport, CutRequest, DeviceMap, RankProgress, ResumeFile

TWO_ON_ONE = {"devices": {"0": [0, 1]}, "ranks": {"0": 0, "1": 0}}


def test_a_device_map_round_trips_and_gives_splices_plain_dict():
    device_map = DeviceMap.from_dict(TWO_ON_ONE)
    assert DeviceMap.from_dict(device_map.to_dict()) == device_map
    assert device_map.plain() == TWO_ON_ONE


def test_a_device_map_whose_rank_names_an_unlisted_device_is_refused():
    with pytest.raises(ProtocolError) as caught:
        DeviceMap.from_dict({"devices": {"0": [0]}, "ranks": {"0": 0, "1": 1}})
    assert caught.value.field == "ranks.1"


def test_a_resize_request_carries_its_map_and_indices():
    request = CutRequest(id=7, action="resize", devices=DeviceMap.from_dict(TWO_ON_ONE), device_indices=(3,))
    assert CutRequest.from_dict(request.to_dict()) == request


@pytest.mark.parametrize("obj, field", [
    ({"id": 1, "action": "resize"}, "devices"),
    ({"id": 1, "action": "stop"}, "staging_dir"),
    ({"id": 0, "action": "stop", "staging_dir": "/s"}, "id"),
    ({"id": 1, "action": "explode", "staging_dir": "/s"}, "action"),
    ({"id": 1, "action": "resize", "devices": TWO_ON_ONE, "device_indices": [1, 2]}, "device_indices"),
], ids=["resize-without-map", "stop-without-staging", "zero-id", "unknown-action", "indices-for-other-count"])
def test_a_malformed_cut_request_is_refused_by_field(obj, field):
    with pytest.raises(ProtocolError) as caught:
        CutRequest.from_dict(obj)
    assert caught.value.field == field


def test_a_report_says_why_it_refuses_the_cut():
    assert CutReport(rank=0, step=3, status="error", error="DataLoader missing").problem() == "DataLoader missing"
    parked = CutReport(rank=1, step=3, status="error", open_sockets=("5 -> socket:[1]",))
    assert "5 -> socket:[1]" in parked.problem()
    assert CutReport.from_dict(parked.to_dict()) == parked


def test_a_resume_file_names_where_the_ranks_go_on():
    resume = ResumeFile(master_addr="127.0.0.1", master_port=29500, key_prefix="n/7",
                        devices=DeviceMap.from_dict(TWO_ON_ONE), device_indices=(2,))
    assert ResumeFile.from_dict(resume.to_dict()) == resume
    with pytest.raises(ProtocolError, match="port|master_port"):
        ResumeFile.from_dict({**resume.to_dict(), "master_port": 70000})
    # a GPU job's: the UUIDs of its GPUs on the host, one per device index
    gpu = ResumeFile.from_dict({**resume.to_dict(), "gpu_uuids": ["GPU-3f1c2a9e-0000-4b7d-9c11-5e2f00a1b2c3"]})
    assert ResumeFile.from_dict(gpu.to_dict()) == gpu
    for bad in (["GPU-a", "GPU-b"], [""], ["G" * 65]):
        with pytest.raises(ProtocolError, match="gpu_uuids"):
            ResumeFile.from_dict({**resume.to_dict(), "gpu_uuids": bad})
    with pytest.raises(ProtocolError, match="gpu_uuids"):
        ResumeFile.from_dict({**resume.to_dict(), "device_indices": None, "gpu_uuids": ["GPU-a"]})


def test_a_resume_file_may_name_its_hosts_block_and_one_from_before_blocks_still_reads(monkeypatch):
    from runtime.engines import follow_host_layout
    older = {"master_addr": "10.0.0.1", "master_port": 29500, "key_prefix": "n/7", "devices": TWO_ON_ONE,
             "nodes": 2, "node_rank": 1}
    resume = ResumeFile.from_dict(older)  # a launcher from before blocks: the equal W/N block
    assert resume.first_rank is None and resume.host_ranks is None
    monkeypatch.setattr(os, "environ", {})
    follow_host_layout(resume, rank=5, world_size=6)
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("2", "3")
    unequal = ResumeFile.from_dict({**older, "first_rank": 4, "host_ranks": 2})  # W = 6 on 2 + 1 devices
    assert ResumeFile.from_dict(unequal.to_dict()) == unequal
    follow_host_layout(unequal, rank=5, world_size=6)
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["NODE_RANK"]) == ("1", "2", "1")
    # a GPU job's rank keeps the LOCAL_RANK that names its GPU (it cannot change GPU in place)
    monkeypatch.setattr(os, "environ", {"MERIDIAN_CUDA_DEVICE": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    follow_host_layout(unequal, rank=5, world_size=6)
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["NODE_RANK"]) == ("0", "1", "1")
    for bad in ({"first_rank": 4}, {"host_ranks": 2}, {"first_rank": 4, "host_ranks": 0},
                {"first_rank": -1, "host_ranks": 2}):
        with pytest.raises(ProtocolError):
            ResumeFile.from_dict({**older, **bad})
    with pytest.raises(ProtocolError, match="host layout"):
        ResumeFile.from_dict({**older, "nodes": None, "node_rank": None, "first_rank": 0, "host_ranks": 2})


def test_rank_progress_may_lack_a_rate():
    progress = RankProgress.from_dict({"step": 4, "engine": "criu", "world_size": 2, "updated_unix": 1.0})
    assert progress.steps_per_s is None and progress.step == 4
