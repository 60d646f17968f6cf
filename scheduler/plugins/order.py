"""Queue order: who is considered first. Tier, then attained service, then team fair share, then age.

Within a tier, jobs are grouped into attained-service queues (Tiresias' discretized 2D-LAS:
`PolicySettings.las_thresholds_device_seconds` on Jobs.attained_device_seconds); a less served
queue goes first, so a short new job is not starved behind a long large one that already ran
for hours, and a job that keeps running sinks only past a threshold (no per-second reordering).

Fair share is dominant resource fairness (DRF) with memory: a team's share of a type is a
blend of what it holds now and its exponentially decayed past usage, divided by the fleet's
usable devices of that type; its dominant share is the largest over types, divided by its
weight. Within a tier, teams take turns by lowest dominant share, each turn charging the
team for the job it puts in line (progressive filling), so one team's thousand jobs do not
all queue ahead of another team's one. Within a team, older jobs go first. Because past
usage decays (half-life PolicySettings.fair_share_half_life_seconds), a team that burst
last week is not punished forever.
"""
from __future__ import annotations

import math

import numpy as np

from scheduler.snapshot import las_queue

NAME = "order.tier_fair_share"
REASON_TIER = "tier"  # behind jobs of a higher SLA tier
REASON_FAIR_SHARE = "fair share"  # behind teams with a smaller dominant share
REASON_AGE = "age"  # behind older jobs of its own team


def decay_usage(decayed_usage, devices_held, seconds: float, half_life_seconds: float) -> np.ndarray:
    """Returns Teams.decayed_usage advanced by `seconds` (for the caller, between ticks).

    decayed_usage: float[T, K] device-seconds; devices_held: [T, K] devices held during those
    seconds. Old usage decays by 2^(-seconds / half-life); the new usage is added decayed
    over the interval (exact for constant holdings), so a steady use of u devices converges
    to u * half_life / ln 2, which dominant_shares turns back into u devices.
    """
    if seconds < 0 or half_life_seconds <= 0:
        raise ValueError("seconds must be >= 0 and the half-life > 0")
    rate = math.log(2) / half_life_seconds
    factor = math.exp(-rate * seconds)
    added = (1.0 - factor) / rate if seconds > 0 else 0.0
    return np.asarray(decayed_usage, np.float64) * factor + np.asarray(devices_held, np.float64) * added


def dominant_shares(tick) -> np.ndarray:
    """Returns float64[T]: each team's dominant share now (current + decayed past, / weight)."""
    snap, settings = tick.snapshot, tick.snapshot.settings
    capacity = np.maximum(tick.type_capacity, 1).astype(np.float64)
    # decayed device-seconds -> devices: a steady use of u devices decays to u * H / ln 2
    past = snap.teams.decayed_usage * (math.log(2) / settings.fair_share_half_life_seconds)
    w = settings.past_usage_weight
    blended = (1.0 - w) * tick.team_usage + w * past
    return (blended / capacity).max(axis=1, initial=0.0) / snap.teams.weight


class TierFairShareOrder:
    """Orders pending jobs by (tier, attained-service queue, team dominant share with
    progressive filling, age)."""

    NAME = NAME

    def order(self, tick, jobs: np.ndarray) -> np.ndarray:
        """Returns `jobs` (indices) in the order they are considered."""
        snap = tick.snapshot
        if jobs.size == 0:
            return jobs
        j = snap.jobs
        shares = dominant_shares(tick)
        capacity = np.maximum(tick.type_capacity, 1).astype(np.float64)
        w = snap.settings.past_usage_weight
        charge = (1.0 - w) * j.min_devices[jobs] / capacity[j.type_id[jobs]] / snap.teams.weight[j.team[jobs]]
        queue = las_queue(j.attained_device_seconds[jobs], snap.settings)
        group = j.tier[jobs].astype(np.int64) * (len(snap.settings.las_thresholds_device_seconds) + 1) + queue
        keys = np.lexsort((j.ids[jobs], j.submit_time[jobs], j.team[jobs], group))
        jobs, charge, group = jobs[keys], charge[keys], group[keys]
        team = j.team[jobs].astype(np.int64)
        # Progressive filling within each (tier, queue) group: a team's next job is keyed by the
        # team's share plus the charges of the team's jobs before it (added one by one, as a
        # team charged per turn would), and the group goes in order of (key, team, age): the
        # turns of the lowest dominant share first, ties to the lower team index.
        key = np.empty(jobs.size, np.float64)
        new_run = np.ones(jobs.size, np.bool_)
        new_run[1:] = (group[1:] != group[:-1]) | (team[1:] != team[:-1])
        starts = np.flatnonzero(new_run)
        ends = starts[1:].tolist() + [jobs.size]
        for start, end, t in zip(starts.tolist(), ends, team[starts].tolist()):
            if end - start == 1:
                key[start] = shares[t]
            else:  # the share, then each job's charge added to the key before it
                turns = np.empty(end - start, np.float64)
                turns[0], turns[1:] = shares[t], charge[start:end - 1]
                key[start:end] = np.add.accumulate(turns)
        turn = np.arange(jobs.size)  # age within a team: the runs are already in that order
        return jobs[np.lexsort((turn, team, key, group))]


class FifoOrder:
    """Orders pending jobs by submit time only (the FIFO baseline)."""

    NAME = "order.fifo"

    def order(self, tick, jobs: np.ndarray) -> np.ndarray:
        j = tick.snapshot.jobs
        return jobs[np.lexsort((j.ids[jobs], j.submit_time[jobs]))]


class LeastAttainedServiceOrder:
    """Orders by attained device-seconds, least first, then age (Tiresias-style, continuous)."""

    NAME = "order.least_attained"

    def order(self, tick, jobs: np.ndarray) -> np.ndarray:
        j = tick.snapshot.jobs
        return jobs[np.lexsort((j.ids[jobs], j.submit_time[jobs], j.attained_device_seconds[jobs]))]
