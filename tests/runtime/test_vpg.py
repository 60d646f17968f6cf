"""The virtual group: teardown without leftover sockets, and deterministic reductions."""
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from runtime import vpg

pytestmark = pytest.mark.runtime
PROBE = pathlib.Path(__file__).parent / "scripts" / "vpg_reduce_probe.py"


def test_closing_the_inner_group_leaves_no_socket_open():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                           use_libuv=False)
    before = set(vpg.open_socket_fds())
    inner = vpg.InnerGroup(rank=0, world_size=1, master_addr="127.0.0.1",
                           master_port=server.port, key_prefix="t/0",
                           timeout=datetime.timedelta(seconds=30))
    tensor = torch.ones(3)
    inner.pg.allreduce([tensor]).wait()
    assert set(vpg.open_socket_fds()) - before, "a live gloo group should hold sockets"
    inner.close()
    assert set(vpg.open_socket_fds()) - before == set()
    # ...and it can be rebuilt on the same store under a new prefix.
    again = vpg.InnerGroup(rank=0, world_size=1, master_addr="127.0.0.1",
                           master_port=server.port, key_prefix="t/1",
                           timeout=datetime.timedelta(seconds=30))
    again.pg.allreduce([tensor]).wait()
    again.close()
    assert set(vpg.open_socket_fds()) - before == set()
    del server


def _reduce_once(tmp_path, tag, world, core_of_rank, delay_seed, transport="local",
                 segment_bytes=None, hosts=1, reports=None, devices=None):
    """Runs one all-reduce of order-sensitive values over `world` rank processes; returns each
    rank's result bytes (3 repeats each). transport "local": through the shared area (the ranks
    are on one host), "gloo": forced over gloo's TCP, "hosts": `hosts` emulated hosts of
    world/hosts ranks each (a shared-memory directory of their own), chained. `devices`: fold the
    ranks onto that many devices (contiguous blocks; with hosts, each host its block of devices),
    transport "fold". `reports`: a list that receives each rank's report."""
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                           use_libuv=False)
    env = dict(os.environ, MERIDIAN_VPG_LOCAL="0" if transport == "gloo" else "1")
    if segment_bytes:
        env["MERIDIAN_VPG_SEGMENT_BYTES"] = str(segment_bytes)
    shm_dirs = [pathlib.Path("/dev/shm")] * world
    if hosts > 1:  # rank r on host r // (world / hosts): its own /dev/shm stand-in
        roots = [pathlib.Path(tempfile.mkdtemp(prefix=f"host{h}-", dir="/dev/shm")) for h in range(hosts)]
        shm_dirs = [roots[r // (world // hosts)] for r in range(world)]
    areas_before = {d: set(d.glob("meridian-vpg-*")) for d in set(shm_dirs)}
    outs = [tmp_path / f"{tag}-rank{r}.json" for r in range(world)]
    processes = [subprocess.Popen([sys.executable, str(PROBE), str(r), str(world), str(server.port),
                                   core_of_rank(r), str(delay_seed), str(outs[r])]
                                  + ([str(r * devices // world)] if devices else []),
                                  env=dict(env, MERIDIAN_VPG_SHM_DIR=str(shm_dirs[r])))
                 for r in range(world)]
    assert [p.wait(timeout=120) for p in processes] == [0] * world
    found = [json.loads(out.read_text()) for out in outs]
    assert all(report["transport"] == transport for report in found), [r["transport"] for r in found]
    assert all(report["sockets"] == 0 and report["mappings"] == 0 for report in found)
    assert {d: set(d.glob("meridian-vpg-*")) for d in set(shm_dirs)} == areas_before
    assert all(report["rank_order"] for report in found), f"{tag}: not the left-to-right rank-order sum"
    assert all(report["flags"] == [world * (world - 1) // 2, world] for report in found)
    if hosts > 1:
        for root in set(shm_dirs):
            root.rmdir()
    if reports is not None:
        reports.extend(found)
    return [report["results"] for report in found]


@pytest.mark.parametrize("world", [4, 2])
def test_reductions_are_bitwise_the_same_whatever_the_transport_pinning_timing_and_position(
        tmp_path, world):
    cores = sorted(os.sched_getaffinity(0))
    spread = _reduce_once(tmp_path, "spread", world, lambda r: str(cores[r % len(cores)]),
                          delay_seed=1)
    one_core = _reduce_once(tmp_path, "one", world, lambda r: str(cores[0]), delay_seed=2)
    # Pieces smaller than the tensor, more of them than the area has slots (rows are reused).
    pieces = _reduce_once(tmp_path, "pieces", world, lambda r: str(cores[r % len(cores)]),
                          delay_seed=3, segment_bytes=64 << 10)
    over_gloo = _reduce_once(tmp_path, "gloo", world, lambda r: str(cores[r % len(cores)]),
                             delay_seed=4, transport="gloo")
    reference = spread[0][0]
    for layout in (spread, one_core, pieces, over_gloo):
        for per_rank in layout:
            assert per_rank == [reference] * 4, "every rank, repeat, layout and position: same bytes"


@pytest.mark.parametrize("world,hosts", [(4, 2), (6, 3)])
def test_ranks_on_several_hosts_chain_through_each_hosts_area_with_the_same_bits(tmp_path, world, hosts):
    cores = sorted(os.sched_getaffinity(0))
    reports = []
    chained = _reduce_once(tmp_path, "hosts", world, lambda r: str(cores[r % len(cores)]),
                           delay_seed=5, transport="hosts", hosts=hosts, reports=reports)
    pieces = _reduce_once(tmp_path, "hosts-pieces", world, lambda r: str(cores[0]), delay_seed=6,
                          transport="hosts", hosts=hosts, segment_bytes=64 << 10)
    one_host = _reduce_once(tmp_path, "one-host", world, lambda r: str(cores[r % len(cores)]),
                            delay_seed=7)
    reference = one_host[0][0]
    for layout in (chained, pieces, one_host):
        for per_rank in layout:
            assert per_rank == [reference] * 4, "every rank, repeat and position: the one-host bytes"
    # The cut's flags travel in the chain's own messages: the all-reduce that carried them issued
    # point-to-point sends and receives only, no gloo collective (the flat path issues three).
    for report in reports:
        assert set(report["issued"]) <= {"send", "recv"} and report["issued"], report["issued"]


def test_folded_layouts_4x1_2x2_1x4_and_across_hosts_give_the_one_host_bits(tmp_path):
    # Ranks sharing a device reduce through their area, and only each device's member (its
    # lowest rank) talks to other devices, over a group of exactly one member per device.
    cores = sorted(os.sched_getaffinity(0))
    one_host = _reduce_once(tmp_path, "unfolded", 4, lambda r: str(cores[r % len(cores)]), delay_seed=9)
    reference = one_host[0][0]
    for devices, hosts, seed in ((4, 1, 10), (2, 1, 11), (1, 1, 12), (2, 2, 13), (4, 2, 14)):
        reports = []
        folded = _reduce_once(tmp_path, f"fold-{devices}x{hosts}", 4, lambda r: str(cores[r % len(cores)]),
                              delay_seed=seed, transport="fold", hosts=hosts, devices=devices,
                              reports=reports, segment_bytes=64 << 10 if seed % 2 else None)
        for per_rank in folded:
            assert per_rank == [reference] * 4, f"{devices} device(s) on {hosts} host(s): other bytes"
        members = [r for r in range(4) if r * devices // 4 != (r - 1) * devices // 4 or r == 0]
        for rank, report in enumerate(reports):
            # The carrying all-reduce issued nothing on the W-rank group; members only point to point.
            assert report["issued"] == {}, report["issued"]
            if rank in members and devices > 1:
                assert report["members_group_size"] == devices
                assert set(report["members_issued"]) == {"send", "recv"}
            else:
                assert report["members_group_size"] is None and report["members_issued"] == {}


@pytest.mark.parametrize("world", [4, 3])
def test_on_the_flat_gloo_path_the_flags_ride_in_the_all_to_all(tmp_path, world):
    # An all-to-all and an all-gather, and no all-reduce of the flags' own (W = 3: uneven chunks).
    cores = sorted(os.sched_getaffinity(0))
    reports = []
    _reduce_once(tmp_path, "flat", world, lambda r: str(cores[r % len(cores)]), delay_seed=8,
                 transport="gloo", reports=reports)
    for report in reports:
        assert report["issued"] == {"alltoall_base": 1, "_allgather_base": 1}


def test_the_probe_values_are_order_sensitive():
    # Otherwise the test above could not fail: float32 sums of these depend on the order.
    values = [torch.randn(100_003, generator=torch.Generator().manual_seed(r))
              * torch.logspace(-3, 8, 100_003) for r in range(4)]
    assert not torch.equal((values[0] + values[1]) + (values[2] + values[3]),
                           ((values[3] + values[2]) + values[1]) + values[0])


def test_rank_order_reduction_adds_left_to_right():
    rows = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    expected = ((rows[0] + rows[1]) + rows[2]) + rows[3]
    assert torch.equal(vpg._reduce_in_rank_order(rows, dist.ReduceOp.SUM), expected)
    assert not torch.equal(expected, ((rows[0] + rows[2]) + rows[1]) + rows[3])


@pytest.mark.parametrize("op,expected", [
    (dist.ReduceOp.SUM, [6.0, 3.0]), (dist.ReduceOp.AVG, [2.0, 1.0]),
    (dist.ReduceOp.MAX, [3.0, 2.0]), (dist.ReduceOp.MIN, [1.0, 0.0]),
    (dist.ReduceOp.PRODUCT, [6.0, 0.0])])
def test_rank_order_reduction_ops(op, expected):
    rows = [torch.tensor([1.0, 2.0]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0])]
    assert vpg._reduce_in_rank_order(rows, op).tolist() == expected


def test_meta_allreduce_without_a_group_is_local():
    assert vpg.meta_allreduce([1, 42]) == [1, 42]


def test_an_unsupported_reduce_op_is_refused_before_any_rank_waits():
    # Refused on every rank alike at the call, not by one chunk's owner mid-reduction (the
    # others would wait for it at the next barrier until the group's timeout).
    group = vpg.VirtualProcessGroup(0, 4, lambda: pytest.fail("must not connect"),
                                    vpg.CollectiveHooks())
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.BAND
    with pytest.raises(NotImplementedError, match="not supported"):
        group.allreduce([torch.ones(3, dtype=torch.int64)], options)
