"""Team quotas per accelerator type, with stated borrowing of idle capacity.

A team may hold up to its quota of each type. With PolicySettings.allow_borrowing it may go
over, but only onto devices that are idle (never by preempting anyone), and the devices over
quota are borrowed: a team that is within its quota reclaims them first (see preemption).
Which running jobs are borrowing is derived, not stored: per team and type, the most
recently started jobs that together cover the excess over quota.
"""
from __future__ import annotations

import numpy as np

NAME = "quota.team_borrowing"
REASON_WITHIN_QUOTA = "within quota"
REASON_BORROWING = "borrowing idle capacity"  # over quota on idle devices; first reclaimed
REASON_OVER_QUOTA = "over quota"  # would exceed the team's quota and borrowing is off


def borrowing_jobs(snapshot, alloc: np.ndarray, team_usage: np.ndarray) -> np.ndarray:
    """Returns bool[J]: running jobs holding devices over their team's quota (youngest first).

    A job is a borrower if the devices of its team's younger jobs of the same type do not yet
    cover the team's excess over quota for that type.
    """
    jobs = snapshot.jobs
    quota = snapshot.teams.quota
    excess = team_usage - quota  # [T, K]
    out = np.zeros(len(jobs), np.bool_)
    if not (excess > 0).any():
        return out
    held = np.flatnonzero(alloc > 0)
    over = excess[jobs.team[held], jobs.type_id[held]] > 0
    held = held[over]
    if held.size == 0:
        return out
    # youngest first within (team, type)
    order = np.lexsort((-jobs.ids[held], -jobs.last_start_time[held], jobs.type_id[held], jobs.team[held]))
    held = held[order]
    group = jobs.team[held].astype(np.int64) * snapshot.n_types + jobs.type_id[held]
    sizes = alloc[held]
    cum = np.cumsum(sizes)
    first = np.r_[True, group[1:] != group[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(held.size), 0))
    before = cum - sizes - (cum[group_start] - sizes[group_start])
    need = excess[jobs.team[held], jobs.type_id[held]]
    out[held[before < need]] = True
    return out


class TeamQuota:
    """Says how many of d devices a job may take within quota, and whether the rest may be borrowed."""

    NAME = NAME

    def headroom(self, tick, j: int) -> int:
        """Returns devices job j's team may still take within quota (may be <= 0)."""
        jobs = tick.snapshot.jobs
        t, k = int(jobs.team[j]), int(jobs.type_id[j])
        return int(tick.snapshot.teams.quota[t, k] - tick.team_usage[t, k])

    def counts_allowed(self, tick, j: int, counts) -> tuple[tuple, tuple]:
        """Returns (within-quota counts, borrowing counts) among `counts` for job j."""
        room = self.headroom(tick, j)
        within = tuple(d for d in counts if d <= room)
        if not tick.snapshot.settings.allow_borrowing:
            return within, ()
        return within, tuple(d for d in counts if d > room)

    def over_quota_reason(self, tick, j: int, counts) -> str:
        jobs = tick.snapshot.jobs
        t, k = int(jobs.team[j]), int(jobs.type_id[j])
        return (f"team {tick.snapshot.teams.names[t]} holds {int(tick.team_usage[t, k])} of its "
                f"quota {int(tick.snapshot.teams.quota[t, k])} {tick.snapshot.type_names[k]}; "
                f"needs {min(counts)} more and borrowing is off")
