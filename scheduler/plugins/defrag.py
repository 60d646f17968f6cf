"""Defragmentation: free a node, rack or cluster for a gang that fails only because free
devices are scattered.

Applies to a job that must stay within one node, rack or cluster (Jobs.max_spread) when
some entity of that level has the capacity but not the free devices, and enough free
devices exist elsewhere in its region to take the small jobs in the way. It picks the
entity missing the fewest devices, moves the small jobs there (fewer devices than the gang,
not Premium unless approved, not started within min_run_seconds) to free devices outside it
in the same region, cheapest first (smallest checkpoint, then fewest devices), and starts
the gang there. All or nothing: if any small job finds no new home, every move is undone.
At most PolicySettings.max_defrag_migrations_per_tick moves per tick.
"""
from __future__ import annotations

import numpy as np

from scheduler.plan import Migrate, Start
from scheduler.snapshot import PREMIUM, SPREAD_NAMES, SPREAD_REGION

NAME = "defrag.free_a_domain"
REASON_DEFRAG_MOVE = "moved to defragment"  # Migrate of a small job
REASON_PLACED_AFTER_DEFRAG = "placed after defragmentation"  # Start of the gang
REASON_DEFRAG_IMPOSSIBLE = "defragmentation impossible"  # wait reason
MAX_ENTITIES_TRIED = 3


class FreeADomain:
    NAME = NAME

    def run(self, tick, j: int) -> bool:
        """Returns True if job j was started after moving small jobs out of its way."""
        snap, jobs, state = tick.snapshot, tick.snapshot.jobs, tick.state
        level = tick.spread(j)
        if level >= SPREAD_REGION:
            return False  # a region-wide job fits wherever the region has room: no fragmentation
        counts = tick.start_counts(j)
        within, _ = tick.policy.quota.counts_allowed(tick, j, counts)
        if not within:
            return False
        budget = snap.settings.max_defrag_migrations_per_tick - tick.migrations_used
        if budget <= 0:
            return self._explain(tick, j, "the defragmentation budget of this tick is spent")
        k, d = int(jobs.type_id[j]), min(within)
        key = (NAME, k, level, int(jobs.tier[j]) == PREMIUM)  # Premium also sees the reserve
        known = tick.known_failure(key, d)
        if known is not None:
            return self._explain(tick, j, known)
        capacity = state.capacity[level][:, k]
        free = state.free_count[level][:, k]
        region_free = state.free_count[3][:, k]
        entity_region = state.entity_region[level]
        movable = self._movable(tick, j, level, k, d)
        entity_of = self._job_entity(tick, level)
        moved_devices = np.bincount(entity_of[movable], weights=state.alloc[movable],
                                    minlength=capacity.size).astype(np.int64) if movable.size else \
            np.zeros(capacity.size, np.int64)
        deficit = d - free
        ok = (capacity >= d) & (deficit > 0) & (moved_devices >= deficit) & \
             (region_free[entity_region] - free >= deficit)
        entities = np.flatnonzero(ok)
        if entities.size == 0:
            why = f"no {SPREAD_NAMES[level]} can be freed by moving small jobs"
            tick.remember_failure(key, d, why)
            return self._explain(tick, j, why)
        entities = entities[np.lexsort((entities, deficit[entities]))][:MAX_ENTITIES_TRIED]
        for e in entities.tolist():
            if self._free_entity(tick, j, level, k, e, int(deficit[e]), movable[entity_of[movable] == e],
                                 within, budget):
                return True
        return self._explain(tick, j, "the small jobs in the way found no other home")

    def _movable(self, tick, j, level, k, d) -> np.ndarray:
        snap, jobs, state = tick.snapshot, tick.snapshot.jobs, tick.state
        held = np.flatnonzero((state.alloc > 0) & ~tick.touched)
        held = held[(jobs.type_id[held] == k) & (state.alloc[held] < d)
                    & (tick.usable_alloc[held] == state.alloc[held])
                    & ((jobs.tier[held] != PREMIUM) | jobs.preemption_approved[held])
                    & ~jobs.preemption_denied[held]
                    & (snap.now - jobs.last_start_time[held] >= snap.settings.min_run_seconds)]
        return held[self._job_entity(tick, level)[held] >= 0]

    @staticmethod
    def _job_entity(tick, level) -> np.ndarray:
        """Returns int64[J]: the one entity of `level` holding all of a job's devices, else -1.

        Computed once per tick from the working state; only untouched jobs are read from it.
        """
        cache = tick.__dict__.setdefault("_job_entity", {})
        if level not in cache:
            state = tick.state
            held = np.flatnonzero(state.holder >= 0)
            ent = state.node_entity[level][state.node[held]]
            big = np.iinfo(np.int64).max
            lo = np.full(state.n_jobs, big, np.int64)
            hi = np.full(state.n_jobs, -1, np.int64)
            np.minimum.at(lo, state.holder[held], ent)
            np.maximum.at(hi, state.holder[held], ent)
            cache[level] = np.where(lo == hi, lo, -1)
        return cache[level]

    def _free_entity(self, tick, j, level, k, e, deficit, movers, within, budget) -> bool:
        jobs, state = tick.snapshot.jobs, tick.state
        order = np.lexsort((jobs.ids[movers], state.alloc[movers], jobs.checkpoint_bytes[movers]))
        movers = movers[order]
        take = np.cumsum(state.alloc[movers]) - state.alloc[movers] < deficit
        movers = movers[take]
        if movers.size > budget:
            return False
        region = int(state.entity_region[level][e])
        blocked = state.node_entity[level] == e
        label = f"{SPREAD_NAMES[level]} {e}"
        mark = tick.mark()
        for m in movers.tolist():
            found = tick.policy.place.place(tick, m, (int(state.alloc[m]),), region=region, blocked_nodes=blocked)
            if found is None:
                tick.rollback(mark)
                return False
            tick.take(m, state.job_devices(m))
            tick.give(m, found.devices)
            tick.migrations_used += 1
            tick.decisions.append(Migrate(
                job=m, job_id=int(jobs.ids[m]), devices=tuple(found.devices.tolist()), code=REASON_DEFRAG_MOVE,
                reason=f"moved off {label} to make room for {tick.job_label(j)}, which needs "
                       f"{min(within)} {tick.type_name(j)} on one {SPREAD_NAMES[level]}"))
        placement = tick.policy.place.place(tick, j, within, region=region)
        if placement is None:
            tick.rollback(mark)
            return False
        tick.give(j, placement.devices)
        starts_at, note = tick.releasing_note(placement.devices)
        tick.decisions.append(Start(
            job=j, job_id=int(jobs.ids[j]), devices=tuple(placement.devices.tolist()),
            code=REASON_PLACED_AFTER_DEFRAG,
            reason=f"{len(placement)} {tick.type_name(j)} on one {SPREAD_NAMES[level]} after moving "
                   f"{movers.size} small jobs off {label}" + note, starts_at=starts_at))
        tick.waiting.pop(j, None)
        return True

    @staticmethod
    def _explain(tick, j, why) -> bool:
        code, base = tick.waiting.get(j, (REASON_DEFRAG_IMPOSSIBLE, ""))
        tick.waiting[j] = (code, f"{base}; {why}" if base else why)
        return False
