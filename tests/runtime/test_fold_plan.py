"""The fold plan (runtime/fold.py): groups, members, the combining order, refusals; and the
arithmetic argument behind it, run on torch tensors: a device-by-device chain of rank-order
partials gives the bits of the flat rank-order sum for every layout."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.layout import rank_devices
from runtime import fold, rankorder


@pytest.mark.parametrize("world,devices,blocks,members", [
    (4, 4, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)], (0, 1, 2, 3)),
    (4, 2, [range(0, 2), range(2, 4)], (0, 2)),
    (4, 1, [range(0, 4)], (0,)),
    (6, 3, [range(0, 2), range(2, 4), range(4, 6)], (0, 2, 4)),
], ids=["4x1", "2x2", "1x4", "3x2"])
def test_it_groups_contiguous_blocks_and_names_each_devices_lowest_rank(world, devices, blocks, members):
    plan = fold.fold_plan(rank_devices(world, devices))
    assert list(plan.blocks) == blocks
    assert plan.members == members
    assert plan.devices == devices and plan.world_size == world
    assert [plan.is_member(rank) for rank in range(world)] == [rank in members for rank in range(world)]


def test_device_keys_need_not_be_numbers_or_sorted():
    # Job-wide device numbers from a device map, or any key: order comes from the ranks.
    plan = fold.fold_plan(["gpu7", "gpu7", "gpu3", "gpu3"])
    assert plan.members == (0, 2) and plan.position(3) == 1


@pytest.mark.parametrize("devices,hosts,match", [
    ([0, 1, 0, 1], None, "one contiguous block"),
    ([0, 0, 1, 0], None, "one contiguous block"),
    ([0, 0, 0, 1], None, "different numbers of ranks"),
    ([0, 0, 1, 1], ["a", "b", "b", "b"], "ranks on 2 hosts"),
    ([0, None, 1, 1], None, "have no device"),
    ([], None, "no ranks"),
], ids=["interleaved", "device-twice", "uneven", "device-on-two-hosts", "unknown-device", "empty"])
def test_it_refuses_what_cannot_be_folded_in_rank_order(devices, hosts, match):
    with pytest.raises(fold.FoldError, match=match):
        fold.fold_plan(devices, hosts)


@st.composite
def layouts(draw):
    """W ranks on d devices (d divides W) with arbitrary device keys, plus the hosts they sit on."""
    devices = draw(st.integers(1, 8))
    per_device = draw(st.integers(1, 4))
    keys = draw(st.lists(st.integers(0, 1000), min_size=devices, max_size=devices, unique=True))
    hosts_count = draw(st.sampled_from([h for h in range(1, devices + 1) if devices % h == 0]))
    ranks = [keys[r // per_device] for r in range(devices * per_device)]
    hosts = [r // per_device // (devices // hosts_count) for r in range(devices * per_device)]
    return ranks, hosts, devices, per_device


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_layout_combines_in_rank_order_with_one_member_per_device(layout):
    ranks, hosts, devices, per_device = layout
    plan = fold.fold_plan(ranks, hosts)
    world = len(ranks)
    assert plan.combine_order() == tuple(range(world))
    assert len(plan.members) == devices == len(set(ranks))
    assert [ranks[m] for m in plan.members] == list(dict.fromkeys(ranks))  # one per device
    for rank in range(world):
        block = plan.blocks[plan.position(rank)]
        assert ranks[rank] == ranks[block.start] and len(block) == per_device
        assert plan.is_member(rank) == (rank == block.start)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=10))
def test_it_folds_exactly_the_contiguous_equal_blocks_and_refuses_the_rest(ranks):
    # An oracle written another way: each key's positions form one interval, all the same length.
    positions = {key: [r for r, k in enumerate(ranks) if k == key] for key in set(ranks)}
    contiguous = all(p[-1] - p[0] + 1 == len(p) for p in positions.values())
    equal = len({len(p) for p in positions.values()}) == 1
    if contiguous and equal:
        assert fold.fold_plan(ranks).combine_order() == tuple(range(len(ranks)))
    else:
        with pytest.raises(fold.FoldError):
            fold.fold_plan(ranks)


def _chain(plan, values, op):
    """What the folded transport computes: each device's member continues the running partial
    with its ranks' rows (rankorder.combine_into), the last one averages."""
    partial = None
    for block in plan.blocks:
        rows = [values[rank] for rank in block]
        if partial is None:
            partial = rankorder.combine_into(rows[0].clone(), rows[1:], op)
        else:
            partial = rankorder.combine_into(partial, rows, op)
    return rankorder.average(partial, plan.world_size, op)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3), (6, 2), (8, 4), (8, 2)]),
       st.integers(0, 2**31 - 1), st.sampled_from(["sum", "avg"]))
def test_the_chain_of_per_device_partials_has_the_bits_of_the_flat_rank_order_sum(shape, seed, op_name):
    world, devices = shape
    op = dist.ReduceOp.SUM if op_name == "sum" else dist.ReduceOp.AVG
    generator = torch.Generator().manual_seed(seed)
    # Magnitudes over eleven decades: float32 sums of these depend on the order of the additions.
    values = [torch.randn(4096, generator=generator) * torch.logspace(-3, 8, 4096) for _ in range(world)]
    flat = rankorder.reduce_in_rank_order(values, op)
    assert torch.equal(_chain(fold.fold_plan(rank_devices(world, devices)), values, op), flat)


def test_a_pairwise_tree_over_devices_would_not_give_those_bits():
    # Why the devices chain a running partial instead of summing per-device totals: the totals'
    # sum is another order of operations, and here it comes out different (the test above could fail).
    generator = torch.Generator().manual_seed(3)
    values = [torch.randn(4096, generator=generator) * torch.logspace(-3, 8, 4096) for _ in range(4)]
    flat = rankorder.reduce_in_rank_order(values, dist.ReduceOp.SUM)
    tree = (values[0] + values[1]) + (values[2] + values[3])
    assert not torch.equal(tree, flat)
