"""Work conservation: after placement, grow elastic jobs into devices that would idle.

Every pending job that could use an idle device has already been offered it (placement ran
first), so what is still free would idle. Elastic running jobs (allowed counts above what
they hold) grow to their largest allowed count that fits, in line order (tier, fair share,
age), near their current devices: same nodes first, then the tightest free spot in their region
(never another region). Growing past the team's quota is borrowing and is said so; borrowed
devices are the first to be reclaimed. Jobs shrunk or moved in this tick are not grown back
in the same tick, and a job resized (grown or shrunk) less than
PolicySettings.min_resize_interval_seconds ago is not grown again (no flapping: every resize
pauses the job for a cut and moves rank state). A shrink for a higher tier is not held back
by that interval: its alternative is a preemption or a higher tier waiting.
"""
from __future__ import annotations

import numpy as np

from scheduler.plan import Resize
from scheduler.snapshot import SPREAD_REGION
from scheduler.state import LEVEL_CLUSTER, LEVEL_NODE, LEVEL_RACK

NAME = "resize.grow_into_idle"
REASON_GREW = "grew into idle devices"
REASON_GREW_BORROWING = "grew into idle devices, borrowing"


class GrowIntoIdle:
    NAME = NAME

    def run(self, tick) -> None:
        snap, jobs, state = tick.snapshot, tick.snapshot.jobs, tick.state
        free_by_type = state.free_count[3].sum(axis=0)
        if not free_by_type.any():
            return
        settled = snap.now - jobs.last_resize_time >= snap.settings.min_resize_interval_seconds
        elastic = np.flatnonzero((state.alloc > 0) & (state.alloc < jobs.world_size) & ~tick.touched
                                 & (free_by_type[jobs.type_id] > 0) & settled)
        if elastic.size == 0:
            return
        allow_borrowing = snap.settings.allow_borrowing
        for j in tick.policy.order.order(tick, elastic).tolist():
            k = int(jobs.type_id[j])
            if free_by_type[k] == 0:
                continue
            have = int(state.alloc[j])
            devices = state.job_devices(j)
            region = int(snap.accelerators.region[devices[0]])
            room = int(state.region_free(k)[region])
            if room == 0:
                continue
            room_quota = int(snap.teams.quota[jobs.team[j], k] - tick.team_usage[jobs.team[j], k])
            larger = [d for d in jobs.allowed_counts(j) if have < d <= have + room
                      and (allow_borrowing or d - have <= room_quota)]
            for d in larger:
                extra = self._find_near(tick, j, k, d - have, devices, region)
                if extra is None:
                    continue
                borrowed = tick.borrowed_by(j, d - have)
                tick.give(j, extra)
                free_by_type[k] -= d - have
                new = np.union1d(devices, extra)
                code = REASON_GREW_BORROWING if borrowed else REASON_GREW
                note = f"; {borrowed} borrowed over the team's quota (reclaimed first)" if borrowed else ""
                tick.decisions.append(Resize(
                    job=j, job_id=int(jobs.ids[j]), devices=tuple(new.tolist()), code=code,
                    reason=f"grew from {have} to {d} devices: idle {tick.type_name(j)} no pending job "
                           f"could use{note}", borrowed=borrowed))
                break

    @staticmethod
    def _find_near(tick, j, k, extra, devices, region):
        """Returns `extra` free devices of type k near job j's devices, within its max_spread."""
        state, jobs = tick.state, tick.snapshot.jobs
        spread = int(jobs.max_spread[j])
        nodes = np.unique(state.node[devices])
        if spread < SPREAD_REGION:
            # must stay within the one node / rack / cluster it is in now
            level = (LEVEL_NODE, LEVEL_RACK, LEVEL_CLUSTER)[spread]
            entity = state.node_entity[level][nodes[0]]
            blocked = state.node_entity[level] != entity
            found = state.find(k, extra, spread, region=region, blocked_nodes=blocked)
            return None if found is None else found.devices
        # its own nodes first (largest free first), then anywhere in its region
        own_free = state.free_count[LEVEL_NODE][nodes, k]
        if int(own_free.sum()) >= extra:
            order = np.lexsort((nodes, -own_free))
            nodes, own_free = nodes[order], own_free[order]
            before = np.cumsum(own_free) - own_free
            use = (before < extra) & (own_free > 0)
            takes = np.minimum(own_free[use], extra - before[use])
            return state._pick_devices(nodes[use].tolist(), takes.tolist(), k)
        found = state.find(k, extra, SPREAD_REGION, region=region, prefer_nodes=nodes)
        return None if found is None else found.devices
