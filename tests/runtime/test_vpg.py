"""The virtual group's pieces that run in this process: teardown and rank-order reduction."""
import datetime

import pytest
import torch
import torch.distributed as dist

from runtime import vpg

pytestmark = pytest.mark.runtime


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


def test_reduction_sums_in_rank_order():
    # Values chosen so that float32 addition order changes the result.
    gathered = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    result = vpg._reduce_in_rank_order(gathered, dist.ReduceOp.SUM)
    expected = ((gathered[0] + gathered[1]) + gathered[2]) + gathered[3]
    assert torch.equal(result, expected)
    reordered = ((gathered[0] + gathered[2]) + gathered[1]) + gathered[3]
    assert not torch.equal(expected, reordered), "the example must be order-sensitive"


@pytest.mark.parametrize("op,expected", [
    (dist.ReduceOp.SUM, [6.0, 3.0]), (dist.ReduceOp.AVG, [2.0, 1.0]),
    (dist.ReduceOp.MAX, [3.0, 2.0]), (dist.ReduceOp.MIN, [1.0, 0.0]),
    (dist.ReduceOp.PRODUCT, [6.0, 0.0])])
def test_reduction_ops(op, expected):
    gathered = [torch.tensor([1.0, 2.0]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0])]
    assert vpg._reduce_in_rank_order(gathered, op).tolist() == expected


def test_meta_allreduce_without_a_group_is_local():
    assert vpg.meta_allreduce([1, 42]) == [1, 42]
