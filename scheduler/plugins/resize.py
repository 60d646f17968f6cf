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

A job below W does not only grow here, last: the framework (scheduler.framework,
`_grow_ahead_of`) grows it with `grow_one` before the pending jobs that come after it in line,
into the devices free at that point, since its missing devices are demand at its place in line
as a pending job's are. What this phase grows is what no job in line took.

Then repack (`_repack`): a running job spread over more nodes than its count needs (it grew
into devices on other nodes, or started where only scattered devices were free) moves onto
devices still idle on the fewest nodes (scheduler.placement_cost: spread runs at 90%).
"""
from __future__ import annotations

import numpy as np

from scheduler.placement_cost import SPREAD_EFFICIENCY, is_spread, min_nodes
from scheduler.plan import Migrate, Resize
from scheduler.snapshot import SPREAD_NAMES, SPREAD_REGION
from scheduler.state import LEVEL_CLUSTER, LEVEL_NODE, LEVEL_RACK

NAME = "resize.grow_into_idle"
REASON_GREW = "grew into idle devices"
REASON_GREW_BORROWING = "grew into idle devices, borrowing"
REASON_REPACKED = "moved to fewer nodes"  # Migrate of a spread-out job onto idle whole nodes


class GrowIntoIdle:
    NAME = NAME

    def run(self, tick) -> None:
        self._grow(tick)
        self._repack(tick)

    @staticmethod
    def growers(tick) -> np.ndarray:
        """Returns the running jobs that may grow now: below W, not touched this tick, and not
        resized within PolicySettings.min_resize_interval_seconds."""
        snap, jobs, state = tick.snapshot, tick.snapshot.jobs, tick.state
        settled = snap.now - jobs.last_resize_time >= snap.settings.min_resize_interval_seconds
        return np.flatnonzero((state.alloc > 0) & (state.alloc < jobs.world_size) & ~tick.touched & settled)

    @staticmethod
    def _grow(tick) -> None:
        state, jobs = tick.state, tick.snapshot.jobs
        free_by_type = state.free_count[3].sum(axis=0)
        if not free_by_type.any():
            return
        elastic = GrowIntoIdle.growers(tick)
        elastic = elastic[free_by_type[jobs.type_id[elastic]] > 0]
        if elastic.size == 0:
            return
        for j in tick.policy.order.order(tick, elastic).tolist():
            if free_by_type[int(jobs.type_id[j])] == 0:
                continue
            GrowIntoIdle.grow_one(tick, j, free_by_type)

    @staticmethod
    def grow_one(tick, j: int, free_by_type=None, why: str = "idle {type} no pending job could use") -> bool:
        """Grows running job j to its largest allowed count that fits near its devices in the
        devices free now (never the Premium reserve or devices still releasing); returns True
        if it grew. `free_by_type` (per type, kept current) saves recounting."""
        snap, jobs, state = tick.snapshot, tick.snapshot.jobs, tick.state
        if free_by_type is None:
            free_by_type = state.free_count[3].sum(axis=0)
        k = int(jobs.type_id[j])
        have = int(state.alloc[j])
        if free_by_type[k] == 0 or have == 0 or have >= int(jobs.world_size[j]):
            return False
        devices = state.job_devices(j)
        region = int(snap.accelerators.region[devices[0]])
        room = int(state.region_free(k)[region])
        if room == 0:
            return False
        room_quota = int(snap.teams.quota[jobs.team[j], k] - tick.team_usage[jobs.team[j], k])
        larger = [d for d in jobs.allowed_counts(j) if have < d <= have + room
                  and (snap.settings.allow_borrowing or d - have <= room_quota)]
        for d in larger:
            extra = GrowIntoIdle._find_near(tick, j, k, d - have, devices, region)
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
                reason=f"grew from {have} to {d} devices: {why.format(type=tick.type_name(j))}{note}",
                borrowed=borrowed))
            return True
        return False

    @staticmethod
    def _repack(tick) -> None:
        """Moves running jobs whose devices span more nodes than their count needs (they run at
        scheduler.placement_cost's spread efficiency, e.g. after growing into devices on other
        nodes) onto devices still idle on the fewest nodes, in line order.

        Only devices idle after placement and growth are used (never the Premium reserve or
        devices still being released), the new set shares no device with the old (a plain
        live migration), and only jobs that have run PolicySettings.min_run_seconds since their
        last (re)start and min_resize_interval_seconds since their last resize move: a job that
        ran that long is likely to run much longer (heavy-tailed durations, as attained-service
        ordering assumes), so a move of seconds buys back 10% of a long remaining run. A job
        never moves to a placement that is spread too, so nothing moves back and forth. At most
        PolicySettings.max_defrag_migrations_per_tick moves (with defragmentation) per tick.
        """
        snap, jobs, state = tick.snapshot, tick.snapshot.jobs, tick.state
        settings = snap.settings
        budget = settings.max_defrag_migrations_per_tick - tick.migrations_used
        if budget <= 0:
            return
        free_by_type = state.free_count[3].sum(axis=0)
        if not free_by_type.any():
            return
        settled = ((snap.now - jobs.last_resize_time >= settings.min_resize_interval_seconds)
                   & (snap.now - jobs.last_start_time >= settings.min_run_seconds))
        cand = np.flatnonzero((state.alloc >= 2) & ~tick.touched & settled
                              & (free_by_type[jobs.type_id] >= state.alloc))
        if cand.size == 0:
            return
        for j in tick.policy.order.order(tick, cand).tolist():
            k = int(jobs.type_id[j])
            devices = state.job_devices(j)
            d, largest = int(devices.size), state.max_node_free[k]
            n = state.n_nodes_of(devices)
            if free_by_type[k] < d or not is_spread(d, n, largest):
                continue
            region = int(snap.accelerators.region[devices[0]])
            level = min(int(jobs.max_spread[j]), SPREAD_REGION)
            found = state.find_fewest_nodes(k, d, level, region=region)
            if found is None or is_spread(d, state.n_nodes_of(found.devices), largest):
                continue
            m = min_nodes(d, largest)
            tick.take(j, devices)
            tick.give(j, found.devices)  # as many idle devices as before: free_by_type unchanged
            tick.migrations_used += 1
            tick.decisions.append(Migrate(
                job=j, job_id=int(jobs.ids[j]), devices=tuple(np.sort(found.devices).tolist()),
                code=REASON_REPACKED,
                reason=(f"moved from {n} nodes to {m} {SPREAD_NAMES[0]}{'s' if m > 1 else ''} of idle "
                        f"{tick.type_name(j)}: spread over more nodes than {d} devices need, it ran at "
                        f"{SPREAD_EFFICIENCY:.0%} speed")))
            budget -= 1
            if budget <= 0:
                return

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
