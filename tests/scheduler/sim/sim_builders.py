"""Builders for the simulator tests: tiny traces and fleets whose outcomes are computed by hand."""
import numpy as np

from scheduler.sim import costs as costs_module
from scheduler.sim import trace as trace_module

# Checkpoint 5 s, restore 7 s, transfer free, whatever the job's size: easy to add up by hand.
HAND_COSTS = costs_module.CostModel(
    checkpoint_gb_per_s=float("inf"), checkpoint_fixed_s=5.0,
    restore_gb_per_s=float("inf"), restore_fixed_s=7.0, transfer_gb_per_s=float("inf"),
    splice_efficiency=0.95, spread_efficiency=1.0,
)


def make_jobs(rows, tiers=None, seed=0):
    """rows: (submit_s, duration_s, ranks[, team]) per job, in job-id order."""
    submit = [r[0] for r in rows]
    duration = [r[1] for r in rows]
    ranks = [r[2] for r in rows]
    team = [r[3] if len(r) > 3 else 0 for r in rows]
    n_teams = max(team) + 1
    tier = None if tiers is None else np.asarray(tiers)
    return trace_module.make_trace("hand", submit, duration, ranks, team,
                                   [f"team-{i}" for i in range(n_teams)], seed, tier=tier)
