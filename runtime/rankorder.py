"""The rank-order rule of every reduction of the virtual group, in one place.

Each element is combined left to right in logical rank order: ((v0 op v1) op v2) op ... op v[W-1],
then AVG divides the sum by W once. Floating-point addition is not associative, so this order is
what makes the bits independent of placement; every transport (runtime/vpg.py over gloo,
runtime/localreduce.py on one host, runtime/hostchain.py across hosts) calls these functions and
nothing else to combine values. A chain across hosts splits the same sequence of operations
between hosts (host 0 combines v0..v3 into a partial, host 1 combines that partial with v4..v7):
`combine_into` on a partial continues the sequence exactly where it stopped.
"""
import torch
import torch.distributed as dist

COMMUTATIVE_IN_GLOO = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)
RANK_ORDER_OPS = COMMUTATIVE_IN_GLOO + (dist.ReduceOp.AVG,)


def combine_into(result, rows, op):
    """Combines each of rows into result in place, in order: result = (result op rows[0]) op ...
    AVG adds here; `average` divides once every rank's value is in."""
    for other in rows:
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            result.add_(other)
        elif op == dist.ReduceOp.PRODUCT:
            result.mul_(other)
        elif op == dist.ReduceOp.MAX:
            torch.maximum(result, other, out=result)
        elif op == dist.ReduceOp.MIN:
            torch.minimum(result, other, out=result)
        else:
            raise NotImplementedError(f"meridian virtual group: reduce op {op} is not supported")
    return result


def average(result, count, op):
    """AVG only: divides a complete sum over `count` ranks in place (integers: floor); other ops
    are left as they are."""
    if op != dist.ReduceOp.AVG:
        return result
    if result.is_floating_point():
        return result.div_(count)
    return result.div_(count, rounding_mode="floor")


def reduce_in_rank_order(rows, op):
    """Returns rows[0] op rows[1] op ... op rows[-1], combined left to right (AVG divides the sum)."""
    if op not in RANK_ORDER_OPS:
        raise NotImplementedError(f"meridian virtual group: reduce op {op} is not supported")
    result = combine_into(rows[0].clone(), rows[1:], op)
    return average(result, len(rows), op)
