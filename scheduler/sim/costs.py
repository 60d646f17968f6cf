"""The simulator's cost model: what checkpoint, restore, migration and resize cost a job,
how fast a spliced or time-sliced job runs, and how often nodes fail.

Defaults come from the runtime's measurements on this machine kind
(../shared/FINDINGS-runtime.md), scaled by each job's checkpoint size:

- checkpoint: CRIU dumped a 804 MB-resident model + Adam to 711 MB of images in 2.0 s
  -> 0.36 GB/s; a fixed 0.05 s for the consistent-cut barrier and communicator
  teardown (~21 ms measured) on top.
- restore: CRIU restored those 711 MB in 0.9 s -> 0.79 GB/s; plus 1.31 s "process launch to
  resumed state" measured for the framework engine (the slower of the two paths).
- migration: checkpoint + transfer at 1.25 GB/s (a 10 Gb/s link; not measured here, an
  assumption) + restore.
- resize (splicing): the ranks stay alive; the job takes a consistent cut, rebuilds its
  communicator on the new mapping (rebuild 3-7 ms measured) and moves the state of the ranks
  that change device: modelled as checkpoint + restore of the moved fraction of the state.
- splice efficiency: ranks sharing a device take turns at collective boundaries; the
  measured per-step overhead of the virtual group was within noise (14.24 vs 14.67 ms), the
  turn-taking swap is not measured here: 0.95 is an assumption.
- time slicing (Gandiva-like): 0.97 of the time slice does useful work (suspend/resume
  at iteration boundaries, Gandiva reports under 1 s per minute-long quantum... assumption).
- spread: a job whose devices span more nodes than it needs runs at 0.9 of full speed
  (assumption; Tiresias and Gandiva report 10-50% slowdowns for communication-bound models,
  and the trace's durations were measured as Philly placed them, mostly consolidated).
- periodic checkpoints every 30 minutes bound the work a node failure loses; they are taken
  asynchronously and cost no run time here.
"""
from __future__ import annotations

import dataclasses

from scheduler import placement_cost


@dataclasses.dataclass(frozen=True)
class CostModel:
    checkpoint_gb_per_s: float = placement_cost.CHECKPOINT_GB_PER_S
    checkpoint_fixed_s: float = placement_cost.CHECKPOINT_FIXED_S
    restore_gb_per_s: float = 0.79
    restore_fixed_s: float = 1.31
    transfer_gb_per_s: float = 1.25
    splice_efficiency: float = placement_cost.SPLICE_EFFICIENCY
    time_slice_efficiency: float = 0.97
    spread_efficiency: float = placement_cost.SPREAD_EFFICIENCY
    periodic_checkpoint_s: float = 1800.0
    # Node failures: mean time between failures per node (None = no failures) and repair time.
    node_mtbf_s: float | None = None
    node_repair_s: float = 3600.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value < 0:
                raise ValueError(f"cost {field.name} must be >= 0, got {value}")
        if not all(0 < e <= 1 for e in (self.splice_efficiency, self.time_slice_efficiency, self.spread_efficiency)):
            raise ValueError("efficiencies must be in (0, 1]")
        if self.periodic_checkpoint_s <= 0:
            raise ValueError("periodic_checkpoint_s must be > 0")

    def checkpoint_s(self, gb):
        """Returns the seconds to write a checkpoint of `gb` GB (placement_cost.checkpoint_seconds's
        rule, which the core uses to pick the room a Premium job waits least for)."""
        return placement_cost.checkpoint_seconds(gb, self.checkpoint_gb_per_s, self.checkpoint_fixed_s)

    def restore_s(self, gb):
        return self.restore_fixed_s + gb / self.restore_gb_per_s

    def migration_s(self, gb):
        return self.checkpoint_s(gb) + gb / self.transfer_gb_per_s + self.restore_s(gb)

    def resize_s(self, gb, moved_fraction):
        moved = gb * min(1.0, max(0.0, moved_fraction))
        return self.checkpoint_fixed_s + moved / self.checkpoint_gb_per_s + moved / self.restore_gb_per_s

    def rate(self, devices, ranks, share=1):
        """Returns the job's speed as a fraction of running alone on W devices:
        d/W x splice efficiency (when d < W), divided among `share` time-sliced jobs.
        The spread cost is `placement_speed`'s (the engine applies it per placement)."""
        speed = placement_cost.speed(devices, ranks, 1, 1, self.splice_efficiency, self.spread_efficiency)
        if share > 1:
            speed *= self.time_slice_efficiency / share
        return speed


    def placement_speed(self, devices, ranks, n_nodes, largest_node, share=1):
        """Returns `rate` with the spread cost of `n_nodes` nodes (scheduler.placement_cost)."""
        speed = self.rate(devices, ranks, share)
        if placement_cost.is_spread(devices, n_nodes, largest_node):
            speed *= self.spread_efficiency
        return speed


FREE = CostModel(checkpoint_gb_per_s=float("inf"), checkpoint_fixed_s=0.0,
                 restore_gb_per_s=float("inf"), restore_fixed_s=0.0,
                 transfer_gb_per_s=float("inf"))
