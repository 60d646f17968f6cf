"""Device maps, pinning and the per-device token of replica splicing."""
import fcntl
import os

import pytest

from runtime import splice

pytestmark = pytest.mark.runtime


def test_device_map_places_contiguous_rank_blocks():
    mapping = splice.device_map(world_size=4, devices=2, cores=[0, 1])
    assert mapping["ranks"] == {"0": 0, "1": 0, "2": 1, "3": 1}
    assert mapping["devices"] == {"0": [0], "1": [1]}


def test_device_map_shares_cores_when_devices_outnumber_them():
    mapping = splice.device_map(world_size=4, devices=4, cores=[0, 1])
    assert mapping["devices"] == {"0": [0], "1": [1], "2": [0], "3": [1]}


def test_one_device_gets_every_core():
    assert splice.device_map(world_size=4, devices=1, cores=[0, 1])["devices"] == {"0": [0, 1]}


def test_it_refuses_a_device_count_that_does_not_divide_the_world_size():
    with pytest.raises(ValueError, match="do not divide the world size 4"):
        splice.device_map(world_size=4, devices=3, cores=[0, 1])


def test_pinning_moves_every_thread(tmp_path):
    before = os.sched_getaffinity(0)
    target = {sorted(before)[-1]}
    try:
        splice.pin_process_threads(target)
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == target
    finally:
        splice.pin_process_threads(before)


def test_ranks_sharing_a_device_exclude_each_other(tmp_path):
    mapping = splice.device_map(world_size=2, devices=1, cores=sorted(os.sched_getaffinity(0)))
    first = splice.DeviceSlot(spool=tmp_path, rank=0)
    first.apply(mapping)
    first.acquire()
    probe = os.open(tmp_path / "devices" / "dev0.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        first.before_collective()  # entering a collective hands the device over
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(probe, fcntl.LOCK_UN)
        first.after_collective()
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
        first.close()


def test_apply_refuses_to_move_while_holding_the_token(tmp_path):
    slot = splice.DeviceSlot(spool=tmp_path, rank=0)
    slot.apply(splice.device_map(world_size=2, devices=2, cores=[0, 0]))
    slot.acquire()
    with pytest.raises(RuntimeError, match="holding the device token"):
        slot.apply(splice.device_map(world_size=2, devices=1, cores=[0]))
    slot.close()
