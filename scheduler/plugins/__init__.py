"""Plugins, one small interface each (kube-scheduler framework): each module has NAME and
REASON_* constants; REGISTRY maps a plugin name to a factory returning a fresh instance.

Steps and their interface (called by scheduler.framework.schedule):
  order    .order(tick, jobs) -> jobs in line order
  quota    .counts_allowed(tick, j, counts) -> (within-quota counts, borrowing counts)
  place    .place(tick, j, counts) -> Placement | None
           .replace(tick, j, keep) -> Placement | None (keep devices on healthy nodes, replace the rest)
  preempt  .run(tick, j) -> True if j was placed by shrinking/preempting others
  resize   .run(tick) -> grows elastic jobs into idle devices
  defrag   .run(tick, j) -> True if j was placed after moving small jobs away
  drain    .run(tick) -> moves jobs off lost/draining nodes and drained regions
"""
from scheduler.plugins import defrag, drain, order, placement, preemption, quota, resize

REGISTRY = {
    order.NAME: order.TierFairShareOrder,
    order.FifoOrder.NAME: order.FifoOrder,
    order.LeastAttainedServiceOrder.NAME: order.LeastAttainedServiceOrder,
    quota.NAME: quota.TeamQuota,
    placement.NAME: placement.GangPlacement,
    preemption.NAME: preemption.SlaPreemption,
    resize.NAME: resize.GrowIntoIdle,
    defrag.NAME: defrag.FreeADomain,
    drain.NAME: drain.DrainAndMove,
}
