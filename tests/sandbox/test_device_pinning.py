"""Pinned to exactly the devices the tick gave: two jobs on one node never share a device.

Measured on the landed code before this: desired state carried a device count and indices, but the
ranks were pinned over the launcher's own affinity, so two 1-device jobs on a 2-device node both ran
on cores {0, 1}; nothing set CUDA_VISIBLE_DEVICES."""
import os

import pytest
from sandbox_helpers import PROBE, entry, make_node, outcome, probe_report, workspace

from runtime import sandbox as mechanisms
from runtime.splice import device_map

pytestmark = [pytest.mark.runtime]
TWO_CORES = len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores: one per device")
def test_two_jobs_on_one_node_get_disjoint_cores_behind_their_devices(node_root):
    """Job 11 holds device 0, job 12 device 1 of a 2-device node: each rank runs on its device's core
    only, and both run at once."""
    work, store = node_root / "w", node_root / "store"
    node = make_node(work, node_devices=2)
    try:
        for job_id, index in ((11, 0), (12, 1)):
            workspace(work, job_id)
            node.reconcile([entry(job_id, store, args=["probe", "--sleep", "3"], indices=(index,))]
                           + [entry(other, store, args=["probe", "--sleep", "3"], indices=(i,))
                              for other, i in ((11, 0), (12, 1)) if other < job_id])
        for job_id in (11, 12):
            report = outcome(node, job_id)
            assert report["state"] == "finished", report.get("error")
        reports = {job_id: probe_report(work / "workspaces" / f"job-{job_id}" / "probe.json")
                   for job_id in (11, 12)}
    finally:
        node.kill_all()
    assert reports[11]["affinity"] == [0]
    assert reports[12]["affinity"] == [1]
    assert set(reports[11]["affinity"]).isdisjoint(reports[12]["affinity"])


def test_each_device_owns_its_block_of_the_nodes_cores():
    cores = (0, 1, 2, 3, 4, 5, 6, 7)
    assert [mechanisms.device_cores(k, node_devices=4, node_cores=cores) for k in range(4)] == [
        (0, 1), (2, 3), (4, 5), (6, 7)]
    # more devices than cores: neighbours share one (the embedded demo: 4 CPU slots on 2 cores)
    assert [mechanisms.device_cores(k, node_devices=4, node_cores=(0, 1)) for k in range(4)] == [
        (0,), (0,), (1,), (1,)]
    # uneven: every core belongs to some device, no device is empty
    assert [mechanisms.device_cores(k, node_devices=2, node_cores=(0, 1, 2)) for k in range(2)] == [(0,), (1, 2)]
    with pytest.raises(mechanisms.SandboxError, match="device index 4"):
        mechanisms.device_cores(4, node_devices=4, node_cores=cores)


def test_the_device_map_pins_each_device_to_its_own_cores():
    mapping = device_map(world_size=4, devices=2, device_cores=[(2, 3), (6,)])
    assert mapping["devices"] == {"0": [2, 3], "1": [6]}
    assert mapping["ranks"] == {"0": 0, "1": 0, "2": 1, "3": 1}
    with pytest.raises(ValueError, match="1 core set"):
        device_map(world_size=4, devices=2, device_cores=[(2, 3)])


def test_on_a_gpu_node_the_ranks_see_exactly_their_gpus_as_0_to_d_minus_1():
    """The environment only: there is no GPU on the machines this is tested on, so what CUDA does
    with it (the ranks seeing GPUs 3 and 5 as cuda:0 and cuda:1) is not exercised here."""
    from protocol.launch import SandboxSpec
    sandbox = mechanisms.LaunchSandbox(SandboxSpec(device_kind="gpu", node_devices=8, node_cores=tuple(range(16)),
                                                   env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}))
    env = sandbox.environment({"RANK": "0"}, home="/h", device_indices=(3, 5), pythonpath="/rt")
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"  # the job cannot widen it
    # in the agent's numbering (NVML's, PCI bus order), not CUDA's own fastest-first one
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert sandbox.device_cores((3, 5)) == [(6, 7), (10, 11)]
    cpu = mechanisms.LaunchSandbox(SandboxSpec(device_kind="cpu", node_devices=2, node_cores=(0, 1)))
    cpu_env = cpu.environment({}, home="/h", device_indices=(1,), pythonpath="/rt")
    assert "CUDA_VISIBLE_DEVICES" not in cpu_env and "CUDA_DEVICE_ORDER" not in cpu_env
    assert PROBE.exists()
