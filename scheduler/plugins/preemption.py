"""SLA tiers and cost-aware victims: make room for a job by shrinking, then preempting, others.

Called for the job at the head of the line when it does not fit in idle devices. Victims
must hold its accelerator type, be in one region (a gang never spans regions), and be:
  - borrowing over their team's quota while the preemptor's team is within its own: those
    devices are reclaimed first, whatever the victim's tier (except Premium, see below); or
  - of a lower tier than the preemptor; or
  - Basic, like a Basic preemptor, but in a higher attained-service queue (Tiresias' 2D-LAS,
    PolicySettings.las_thresholds_device_seconds): a job that already ran for hours yields
    to a new short one (shrunk first if elastic, as for a higher tier; the no-thrash rule holds).
Within a region, actions are taken in this order until enough devices are free:
  1. reclaim borrowed devices (preempt borrowers, least lost work first);
  2. shrink elastic victims (splicing: no work is lost), Basic before Standard, biggest
     possible release first (for a Premium preemptor: smallest checkpoint first, since it
     starts only when the victim's cut is done), each to the largest allowed count that still
     frees enough;
  3. preempt victims, Basic before Standard, least lost work first (device-seconds since
     the last checkpoint), then smallest checkpoint (for a Premium preemptor: smallest
     checkpoint first, then least lost work: it starts only when its victims' checkpoints
     are written, and every second of that wait counts against its 95%).
A packed-tier (Premium) gang larger than a node first tries whole nodes
(`_start_on_whole_nodes`): preempting the jobs on the fewest nodes that hold it, so that it
does not run spread out (scheduler.placement_cost). A tier in PolicySettings.floor_speed_tiers
(Standard) is shrunk only to counts that keep its SLA floor speed (Tick.run_counts).
The region needing the fewest preemptions, then the least lost work, wins. A gang of two or
more devices that needs a preemption also looks for one node, else one rack, else one
cluster that preempting whole jobs can free (fewest preemptions, then least lost work) and
takes the tightest such place that needs no more preemptions than the region-wide choice: a
packed gang beats a spread one. A job whose max_spread is tighter than a region only takes
victims within one node / rack / cluster (as its spread allows).

SLA rules: Premium is never preempted or shrunk unless Jobs.preemption_approved; Standard
may be while attained/ideal >= PolicySettings.standard_sla_floor (else only with approval);
Basic freely. If the only way to fit needs an approval, the plan carries Preempt decisions
with needs_approval=True for those victims (nothing else happens) and the job waits for the
approval. A job whose preemption a capacity manager denied (Jobs.preemption_denied) is
neither a victim nor asked about again while the denial holds. No thrash: a job (re)started
less than PolicySettings.min_run_seconds ago is not preempted (it may still be shrunk). The
preemptor never borrows by preempting: a job whose team would go over quota fits only into
idle devices.
"""
from __future__ import annotations

import numpy as np

from scheduler.placement_cost import checkpoint_seconds, is_spread, min_nodes
from scheduler.plan import Preempt, Resize, Start
from scheduler.snapshot import BASIC, PREMIUM, SPREAD_NAMES, SPREAD_REGION, STANDARD, TIER_NAMES, las_queue
from scheduler.state import LEVEL_CLUSTER, LEVEL_REGION

NAME = "preempt.sla_cost_aware"
REASON_PLACED_BY_PREEMPTION = "placed by preemption"  # Start after making room
REASON_SHRUNK = "shrunk for a higher tier"  # Resize of a victim
REASON_PREEMPTED = "preempted for a higher tier"  # Preempt of a victim
REASON_PREEMPTED_LESS_SERVED = "preempted for a less-served job"  # Basic victim of a Basic job (2D-LAS)
REASON_RECLAIMED = "borrowed devices reclaimed"  # Preempt of a borrower
REASON_NEEDS_APPROVAL = "needs approval"  # Preempt that would break an SLA
REASON_WAITING_FOR_APPROVAL = "waiting for approval"  # wait reason of the preemptor
REASON_NOTHING_TO_PREEMPT = "nothing to preempt"  # no eligible victims suffice (appended; code stays "no room")
REASON_BUDGET_SPENT = "preemption budget spent"  # wait reason: PolicySettings.max_preemptions_per_tick

GROUP_RECLAIM, GROUP_SHRINK, GROUP_PREEMPT, GROUP_APPROVAL = 0, 1, 2, 3
# A preemptor of a tier in PolicySettings.soonest_room_tiers takes the room ready soonest; waits
# within the same step of this many seconds are a tie (then the fewest victims win), so that
# seconds saved do not cost victims' lost work. Premium has 5% of its run time to spare (16 s for
# a 5-minute job): steps of 1 s. Standard has 43% (51 s for a 2-minute job): steps of a tick
# (60 s); with 10-30 s steps a Standard preemptor took ~2x the victims (preempting several small
# jobs rather than shrinking one) in bench/scheduler_tick.py's contended fleet, and the quick
# goals grid met no more goals (docs/devlog/2026-12-02/policy.md, round 3).
WAIT_TIE_SECONDS = {PREMIUM: 1.0, STANDARD: 60.0, BASIC: 60.0}
ORDER_BY_COST, ORDER_BY_RELEASE, ORDER_BY_WAIT, ORDER_BY_RELEASE_TIME = 0, 1, 2, 3  # `_candidates`' tables


def _wait_steps(tick, j: int, wait):
    """Returns `wait` (seconds, a number or an array) in steps of WAIT_TIE_SECONDS for job j's
    tier: equal steps are a tie."""
    return np.ceil(np.asarray(wait, np.float64) / WAIT_TIE_SECONDS[int(tick.snapshot.jobs.tier[j])])


def _lower_priority(tick, j: int, facts: dict) -> np.ndarray:
    """Returns bool per candidate in `facts`: may be preempted for job j by priority alone
    (a lower tier, or Basic in a higher attained-service queue than Basic job j)."""
    jobs = tick.snapshot.jobs
    tier = int(jobs.tier[j])
    lower = facts["tier"] > tier
    if tier == BASIC:
        queue = int(las_queue(jobs.attained_device_seconds[j:j + 1], tick.snapshot.settings)[0])
        lower |= (facts["tier"] == BASIC) & (facts["queue"] > queue)
    if tier != PREMIUM:
        lower &= ~facts["protected"]  # the most-progressed jobs yield to Premium only
    return lower


def _most_progressed(tick, cand: np.ndarray, tier: np.ndarray, k: int) -> np.ndarray:
    """Returns bool per candidate in `cand` (jobs holding type k): among the non-Premium ones,
    those with the most work done (attained device-seconds / W: seconds at full size) whose
    devices, counted from the most progressed down, stay within
    PolicySettings.protected_progress_share of the type's usable devices.

    Durations are heavy-tailed, so the job that has done the most work is the likeliest to
    have the most left: it sets the makespan and the p99 JCT, and 2D-LAS alone makes it the
    first victim of every arrival. These yield only to Premium; the share bounds how much of
    the fleet is out of LAS's reach."""
    share = tick.snapshot.settings.protected_progress_share
    out = np.zeros(cand.size, np.bool_)
    if share <= 0 or cand.size == 0:
        return out
    jobs, rows = tick.snapshot.jobs, np.flatnonzero(tier != PREMIUM)
    mine = cand[rows]
    order = np.lexsort((jobs.ids[mine], -(jobs.attained_device_seconds[mine] / jobs.world_size[mine])))
    held = np.cumsum(tick.state.alloc[mine][order])  # most progressed first, ties by id
    out[rows[order]] = held <= share * float(tick.type_capacity[k])
    return out


def _job_regions(tick, cand: np.ndarray) -> np.ndarray:
    """Returns the region of each job in `cand` (jobs never span regions), from the tick's holders."""
    holder = tick.state.holder
    held = np.flatnonzero(holder >= 0)
    region = np.full(tick.state.n_jobs, -1, np.int64)
    region[holder[held]] = tick.snapshot.accelerators.region[held]
    return region[cand]


def _segment_starts(keys: np.ndarray) -> np.ndarray:
    """Returns, for each row of `keys` (sorted so equal keys are adjacent), the index of the first row
    of its run of equal keys: the segment it belongs to."""
    first = np.r_[True, keys[1:] != keys[:-1]]
    return np.maximum.accumulate(np.where(first, np.arange(keys.size), 0))


def _max_in_ranges(values: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Returns max(values[first[i]:last[i] + 1]) for each i (values >= 0; ranges ascending and
    disjoint, as a segment's first row and a row of it): one reduceat over the interleaved
    bounds, whose every other result is a range's maximum."""
    if first.size == 0:
        return np.zeros(0)
    padded = np.concatenate((values.astype(np.float64), np.zeros(1)))  # last + 1 may be the end
    bounds = np.empty(2 * first.size, np.int64)
    bounds[0::2], bounds[1::2] = first, last + 1
    return np.maximum.reduceat(padded, bounds)[0::2]


def _cumsum_by_segment(values: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Returns running totals of `values` that restart at each segment's first row; start[i] is
    the first row of row i's segment (from _segment_starts). One cumsum for all segments: what
    the rows before a segment summed to is subtracted (start - 1 wraps to -1 only where start == 0,
    and np.where discards those)."""
    total = np.cumsum(values)
    return total - np.where(start > 0, total[start - 1], 0)


class _Tables:
    """The facts about one type's candidate victims (a dict of columns), in each of the orders
    the searches walk, each sorted when first asked for (`tables[ORDER_BY_COST]`): a tick that
    has no Premium preemptor never sorts by checkpoint size."""

    def __init__(self, facts: dict, ids: np.ndarray):
        self.facts, self.ids = facts, ids
        self.sorted: dict[int, dict] = {}

    def __getitem__(self, order_index: int) -> dict:
        table = self.sorted.get(order_index)
        if table is None:
            facts, ids, tier = self.facts, self.ids, self.facts["tier"]
            if order_index == ORDER_BY_COST:  # preemption: Basic first, least lost work, smallest checkpoint
                order = np.lexsort((ids, facts["ckpt"], facts["lost"], -tier))
            elif order_index == ORDER_BY_RELEASE:  # shrink: Basic first, biggest release first
                order = np.lexsort((ids, -facts["shrink"], -tier))
            elif order_index == ORDER_BY_WAIT:
                # shrink for a Premium preemptor: Basic first, smallest checkpoint first (it starts
                # only when the victim's cut and checkpoint are done), then biggest release
                order = np.lexsort((ids, -facts["shrink"], facts["ckpt"], -tier))
            else:
                # preemption for a Premium preemptor: Basic first, smallest checkpoint first (it
                # starts when its victims' checkpoints are written), then least lost work
                order = np.lexsort((ids, facts["lost"], facts["ckpt"], -tier))
            table = self.sorted[order_index] = {name: col[order] for name, col in facts.items()}
        return table


class SlaPreemption:
    """Finds the cheapest set of shrinks/preemptions that makes a job fit, and applies it."""

    NAME = NAME

    def run(self, tick, j: int) -> bool:
        """Returns True if job j was started after shrinking/preempting others.

        Otherwise leaves everything as it was and adds to j's wait reason why preemption
        did not help.
        """
        jobs, settings = tick.snapshot.jobs, tick.snapshot.settings
        counts = tick.start_counts(j)
        within, _ = tick.policy.quota.counts_allowed(tick, j, counts)
        if not within:
            return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT,
                                 "its team is at its quota, so it may only borrow idle devices")
        if tick.victims_used >= settings.max_preemptions_per_tick:
            return self._explain(tick, j, REASON_BUDGET_SPENT,
                                 f"the preemption budget of {settings.max_preemptions_per_tick} "
                                 f"victims per tick is spent; next tick")
        need = min(within)
        queue = int(las_queue(jobs.attained_device_seconds[j:j + 1], settings)[0])
        key = (NAME, int(jobs.type_id[j]), int(jobs.tier[j]), int(tick.search_team(j)), queue)
        known = tick.known_failure(key, need)
        if known is not None:
            return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT, known)
        actions = self._actions(tick, j)
        if actions is None:
            who = ("borrowed devices or more-served Basic jobs" if jobs.tier[j] == BASIC
                   else "lower-tier jobs or borrowed devices")
            why = f"no {who} of its type to take"
            tick.remember_failure(key, need, why)
            return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT, why)
        chosen = self._choose(tick, j, actions, need, with_approval=False)
        if chosen is None:
            chosen = self._choose(tick, j, actions, need, with_approval=True)
            if chosen is None:
                why = ("shrinking or preempting every eligible job would not free "
                       f"{need} {tick.type_name(j)} together in one region")
                tick.remember_failure(key, need, why)
                return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT, why)
            return self._ask_approval(tick, j, actions, chosen)
        region, rows = chosen
        k = int(jobs.type_id[j])
        spread = tick.spread(j)
        preempts = any(actions["group"][r] != GROUP_SHRINK for r in rows)
        must = spread < SPREAD_REGION  # victims anywhere in the region would not do
        scope = None
        shrink_in = None  # (region, victims, level, entity): room made by shrinks alone
        if int(jobs.tier[j]) in settings.packed_tiers and j not in tick.spread_ok:
            # a packed-tier gang larger than a node: whole nodes, not devices scattered over many
            started = self._start_on_whole_nodes(tick, j, need, within, min(spread, LEVEL_CLUSTER))
            if started is not None:
                return started
        if int(jobs.tier[j]) in settings.soonest_room_tiers:
            # a Premium job placed on a victim's devices waits for its checkpoint before its
            # first step: the room ready soonest, wherever it is, then the fewest victims, the
            # least lost work
            picked = self._soonest_room(tick, j, need, spread, must, actions, rows, region)
            if picked is None:
                return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT,
                                     f"shrinking or preempting could not free {need} "
                                     f"{tick.type_name(j)} within one {SPREAD_NAMES[spread]}")
            shrink_in, found = picked
            if found is not None:
                region, rows, actions, scope = found
        elif (need >= 2 and preempts) or must:
            levels = [level for level in range(0, min(spread, LEVEL_CLUSTER) + 1)
                      if need <= int(tick.state.capacity[level][:, k].max(initial=0))]
            # shrinking loses no work, so room made by shrinks alone within one node / rack /
            # cluster beats any preemption, whatever the job's spread
            for level in levels:
                shrink_in = self._shrink_in_one(tick, j, need, level)
                if shrink_in is not None:
                    break
            if shrink_in is None:
                # a gang gets one node, else one rack, else one cluster if preempting whole jobs
                # there takes no more preemptions than the region-wide choice (or if it must)
                n_region = len({int(actions["job"][r]) for r in rows if actions["group"][r] != GROUP_SHRINK})
                for level in levels:
                    found = self._choose_in_one(tick, j, need, level)
                    if found is not None and (must or len(found[1]) <= n_region):
                        region, rows, actions, scope = found[:4]
                        break
                else:
                    if must:
                        return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT,
                                             f"shrinking or preempting could not free {need} "
                                             f"{tick.type_name(j)} within one {SPREAD_NAMES[spread]}")
        n_victims = len(shrink_in[1]) if shrink_in is not None else len(np.unique(actions["job"][rows]))
        if tick.victims_used + n_victims > settings.max_preemptions_per_tick:
            return self._explain(tick, j, REASON_BUDGET_SPENT,
                                 f"making room needs more victims than the per-tick budget of "
                                 f"{settings.max_preemptions_per_tick} has left; next tick")
        mark = tick.mark()
        if shrink_in is not None:
            region, victims, level, entity = shrink_in[:4]
            done = self._apply_shrinks_in(tick, j, victims, level, entity, need)
        else:
            done = self._apply(tick, j, actions, rows, region, need, scope)
        placement = tick.policy.place.place(tick, j, within, region=region)
        if placement is None and j not in tick.spread_ok and tick.snapshot.settings.packed_tiers_may_spread:
            # the room made is spread over more nodes than a packed place needs: a Premium gang
            # runs spread out rather than wait (GangPlacement.place), if the settings allow it
            tick.spread_ok.add(j)
            placement = tick.policy.place.place(tick, j, within, region=region)
        if placement is None:  # the job's max_spread is tighter than what was freed
            tick.rollback(mark)
            return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT,
                                 "preemption frees room in the region but not within one "
                                 + ("node", "rack", "cluster", "region")[spread])
        self._start(tick, j, placement, region, done)
        return True

    def _soonest_room(self, tick, j: int, need: int, spread: int, must: bool, actions: dict, rows: list,
                      region: int):
        """Returns (shrink_in, found) for job j of a tier in PolicySettings.soonest_room_tiers:
        the room that is ready soonest among shrinks alone and whole-job preemptions within one
        node, else one rack, else one cluster (the tightest of these, as the job's spread
        allows, where either can free `need`; `_shrink_in_one`, `_choose_in_one`) and, unless
        the job `must` stay within one, the region-wide choice (`actions` rows `rows` in
        `region`: both None); ties go to the fewest victims, then the least lost work, then a
        shrink before a preemption. None if `must` and nothing frees `need` devices.

        Every second between its Start and its devices being free counts against its 95%
        (a 5-minute job may wait 16 s), so a shrink of a job with a 60 GB checkpoint (160 s
        to write) loses to preempting two single-device jobs that write theirs in 4 s."""
        jobs, state = tick.snapshot.jobs, tick.state
        k = int(jobs.type_id[j])
        options: list[tuple] = []  # (wait s, victims, lost work, order, shrink_in, found)
        for level in range(0, min(spread, LEVEL_CLUSTER) + 1):
            if need > int(state.capacity[level][:, k].max(initial=0)):
                continue
            shrink_in = self._shrink_in_one(tick, j, need, level)
            if shrink_in is not None:
                options.append((shrink_in[4], len(shrink_in[1]), 0.0, len(options), shrink_in, None))
                if len(shrink_in[1]) == 1 and _wait_steps(tick, j, shrink_in[4]) <= 1:
                    # one shrink in the first wait step: nothing can beat it (any room needs a
                    # victim whose checkpoint takes a step; a shrink loses no work, and it comes
                    # first among ties), so the preemption search is skipped
                    return shrink_in, None
            found = self._choose_in_one(tick, j, need, level)
            if found is not None:
                lost = float(found[2]["cost"].sum())
                options.append((found[4], len(found[1]), lost, len(options), None, found[:4]))
            if options:
                break  # the tightest place that can be had: a looser one may run spread out
        if not must:
            acting = np.asarray(rows, np.int64)
            wait = max(float(actions["wait"][acting].max(initial=0.0)),
                       float(self._release_wait(tick, k, LEVEL_REGION)[region]))
            preempting = actions["group"][acting] != GROUP_SHRINK
            lost = float(actions["cost"][acting][preempting].sum())
            options.append((wait, len(set(actions["job"][acting].tolist())), lost, len(options), None, None))
        if not options:
            return None
        return min(options, key=lambda option: (float(_wait_steps(tick, j, option[0])),) + option[1:4])[4:]

    def _start_on_whole_nodes(self, tick, j: int, need: int, within, level: int):
        """Starts job j on the fewest nodes its size allows (scheduler.placement_cost.min_nodes,
        when that is 2 or more) by preempting whole jobs on those nodes; returns True, or None
        (nothing changed) if no such set of nodes can be freed within one entity of `level`
        in one region, or the per-tick budget does not allow it.

        A gang larger than a node placed on devices that preemption freed here and there runs
        spread out (x scheduler.placement_cost.SPREAD_EFFICIENCY), which alone misses a 95% SLA
        from its first second. Nodes are taken in order of (most devices that idle devices and
        eligible victims give, soonest free for a Premium job: its slowest victim's checkpoint or
        device still releasing, fewest victims, least lost work); the entity whose m best nodes
        are free soonest (Premium), then need the fewest victims, then the least lost work, wins. Victims are those
        `_choose_in_one` may take (borrowed or lower priority, no approval needed, not just
        started), preempted whole: shrinking keeps a victim's devices on its fullest nodes.
        """
        jobs, state, settings = tick.snapshot.jobs, tick.state, tick.snapshot.settings
        k, team = int(jobs.type_id[j]), int(jobs.team[j])
        largest = state.max_node_free[k]
        m = min_nodes(need, largest)
        if m < 2:
            return None
        premium = int(jobs.tier[j]) == PREMIUM
        soonest = int(jobs.tier[j]) in settings.soonest_room_tiers
        order_index = ORDER_BY_RELEASE_TIME if premium else ORDER_BY_COST
        by_cost = self._candidates(tick, k)[order_index]
        if by_cost["job"].size == 0:
            return None
        reclaim = by_cost["borrower"] & (by_cost["team"] != team)
        eligible = (~tick.touched[by_cost["job"]] & (reclaim | _lower_priority(tick, j, by_cost))
                    & ~by_cost["recent"] & ~by_cost["needs_approval"])
        devices = self._devices_by_entity(tick, k, 0, order_index)  # level 0: entity = node
        keep = eligible[devices["row"]]
        node, row, first = devices["entity"][keep], devices["row"][keep], devices["first"][keep]
        n_nodes = state.n_nodes
        gives = state.free_count[0][:, k] + np.bincount(node, minlength=n_nodes)
        gives = np.minimum(gives, state.capacity[0][:, k])
        victims = np.bincount(node[first], minlength=n_nodes)
        wait = np.zeros(n_nodes)
        if soonest:
            # seconds until a node's devices are free: its slowest victim's checkpoint, or a
            # device still releasing there (checkpoints are written in parallel)
            np.maximum.at(wait, node[first], by_cost["ckpt_s"][row[first]])
            wait = np.maximum(wait, self._release_wait(tick, k, 0))
        lost = np.bincount(node[first], weights=by_cost["lost"][row[first]], minlength=n_nodes)
        nodes = np.flatnonzero(gives > 0)
        if nodes.size < m:
            return None
        entity = state.node_entity[level][nodes]
        steps = _wait_steps(tick, j, wait[nodes])
        order = np.lexsort((nodes, lost[nodes], victims[nodes], steps, -gives[nodes], entity))
        nodes, entity = nodes[order], entity[order]
        start = _segment_starts(entity)
        top = (np.arange(entity.size) - start) < m  # each entity's m best nodes
        n_ent = state.n_entities[level]
        total = np.bincount(entity[top], weights=gives[nodes[top]], minlength=n_ent)
        n_victims = np.bincount(entity[top], weights=victims[nodes[top]], minlength=n_ent)
        wait_most = np.zeros(n_ent)
        np.maximum.at(wait_most, entity[top], wait[nodes[top]])
        lost_total = np.bincount(entity[top], weights=lost[nodes[top]], minlength=n_ent)
        fits = np.flatnonzero(total >= need)
        if fits.size == 0:
            return None
        # the room ready soonest (Premium; 0 for others), then the fewest victims, the least lost work
        steps = _wait_steps(tick, j, wait_most[fits])
        best = int(fits[np.lexsort((fits, lost_total[fits], n_victims[fits], steps))[0]])
        chosen = nodes[top & (entity == best)]
        if tick.victims_used + int(n_victims[best]) > settings.max_preemptions_per_tick:
            return None
        region = int(state.entity_region[level][best])
        mark = tick.mark()
        done = []
        left = need
        for n in chosen.tolist():
            target = min(int(gives[n]), left)
            left -= target
            for r in row[(node == n) & first].tolist():
                if int(state.free_count[0][n, k]) >= target:
                    break
                v = int(by_cost["job"][r])
                if state.alloc[v] == 0:
                    continue  # preempted already for another of the chosen nodes
                group = GROUP_RECLAIM if reclaim[r] else GROUP_PREEMPT
                done.append(self._preempt(tick, j, v, group))
        blocked = np.ones(n_nodes, np.bool_)
        blocked[chosen] = False
        placement = tick.policy.place.place(tick, j, within, region=region, blocked_nodes=blocked)
        if placement is None or is_spread(len(placement), state.n_nodes_of(placement.devices), largest):
            tick.rollback(mark)
            return None
        self._start(tick, j, placement, region, done)
        return True

    def _start(self, tick, j: int, placement, region: int, done: list) -> None:
        """Gives job j `placement` and records its Start after the victims in `done`."""
        jobs = tick.snapshot.jobs
        tick.give(j, placement.devices)
        starts_at, note = tick.releasing_note(placement.devices)
        tick.decisions.append(Start(
            job=j, job_id=int(jobs.ids[j]), devices=tuple(placement.devices.tolist()),
            code=REASON_PLACED_BY_PREEMPTION,
            reason=(f"{len(placement)} {tick.type_name(j)} in {tick.snapshot.region_names[region]} after "
                    + ", ".join(done[:3]) + (f" and {len(done) - 3} more" if len(done) > 3 else "")
                    + note), starts_at=starts_at))
        tick.waiting.pop(j, None)

    # --- computing (no side effects) -------------------------------------------------------
    @staticmethod
    def _candidates(tick, k: int) -> "_Tables":
        """Returns per-tick facts about the jobs holding type k, in the presorted orders of `_Tables`.

        Computed once per type and tick; a call then only masks out jobs touched since (a
        touched job is never a victim again in the same tick) and those the preemptor may not
        take, which keeps each preemptor's cost linear with a small constant.
        """
        cache = tick.__dict__.setdefault("_preemption_candidates", {})
        if k in cache:
            return cache[k]
        snap, jobs, settings, state = tick.snapshot, tick.snapshot.jobs, tick.snapshot.settings, tick.state
        cand = np.flatnonzero((state.alloc > 0) & (tick.usable_alloc > 0) & (jobs.type_id == k) & ~tick.touched
                              & ~jobs.preemption_denied)
        tier = jobs.tier[cand].astype(np.int64)
        ideal = jobs.ideal_device_seconds[cand]
        fraction = np.where(ideal > 0, jobs.attained_device_seconds[cand] / np.where(ideal > 0, ideal, 1), 1.0)
        facts = dict(
            job=cand, tier=tier, team=jobs.team[cand], borrower=tick.borrower[cand],
            needs_approval=~jobs.preemption_approved[cand] & (
                (tier == PREMIUM) | ((tier == STANDARD) & (fraction < settings.standard_sla_floor))),
            recent=(snap.now - jobs.last_start_time[cand]) < settings.min_run_seconds,
            usable=tick.usable_alloc[cand],
            shrink=np.clip(state.alloc[cand] - tick.floor_count[cand], 0, tick.usable_alloc[cand]),
            region=_job_regions(tick, cand),
            lost=tick.lost_work_seconds(cand),
            ckpt=jobs.checkpoint_bytes[cand].astype(np.float64),
            # seconds until the devices it gives up are free (placement_cost, as the simulator)
            ckpt_s=checkpoint_seconds(jobs.checkpoint_bytes[cand].astype(np.float64) / 1e9),
            queue=las_queue(jobs.attained_device_seconds[cand], settings),
            protected=_most_progressed(tick, cand, tier, k),
        )
        cache[k] = _Tables(facts, jobs.ids[cand])
        return cache[k]

    def _actions(self, tick, j: int):
        """Returns the candidate actions for job j as arrays sorted by (region, group, cost),
        or None if there are none."""
        jobs = tick.snapshot.jobs
        k, tier, team = int(jobs.type_id[j]), int(jobs.tier[j]), int(jobs.team[j])
        tables = self._candidates(tick, k)
        if tier == PREMIUM:
            by_cost, by_release = tables[ORDER_BY_RELEASE_TIME], tables[ORDER_BY_WAIT]
        else:
            by_cost, by_release = tables[ORDER_BY_COST], tables[ORDER_BY_RELEASE]
        if by_cost["job"].size == 0:
            return None
        # groups 0 (reclaim borrowed), 2 (preempt), 3 (needs approval), in cost order
        live = ~tick.touched[by_cost["job"]]
        reclaim = by_cost["borrower"] & (by_cost["team"] != team)
        lower = _lower_priority(tick, j, by_cost)
        base = live & (reclaim | lower) & ~by_cost["recent"]
        protected = by_cost["needs_approval"]
        group = np.where(protected, GROUP_APPROVAL, np.where(reclaim, GROUP_RECLAIM, GROUP_PREEMPT))
        pick = np.flatnonzero(base)
        # group 1 (shrink), in release order
        live_b = ~tick.touched[by_release["job"]]
        shrinkable = (live_b & _lower_priority(tick, j, by_release)
                      & ~(by_release["borrower"] & (by_release["team"] != team))
                      & ~by_release["needs_approval"] & (by_release["shrink"] > 0))
        pick_b = np.flatnonzero(shrinkable)
        if pick.size == 0 and pick_b.size == 0:
            return None
        # a preemption after a shrink of the same job releases only what the shrink left
        shrunk_first = (group == GROUP_PREEMPT) & lower & (by_cost["shrink"] > 0)
        release = np.where(shrunk_first, by_cost["usable"] - by_cost["shrink"], by_cost["usable"])
        actions = {
            "job": np.concatenate((by_cost["job"][pick], by_release["job"][pick_b])),
            "group": np.concatenate((group[pick], np.full(pick_b.size, GROUP_SHRINK))),
            "release": np.concatenate((release[pick], by_release["shrink"][pick_b])),
            "cost": np.concatenate((by_cost["lost"][pick], np.zeros(pick_b.size))),
            "region": np.concatenate((by_cost["region"][pick], by_release["region"][pick_b])),
            "wait": np.concatenate((by_cost["ckpt_s"][pick], by_release["ckpt_s"][pick_b])),
        }
        keep = actions["release"] > 0
        key = actions["region"] * 4 + actions["group"]
        small = np.int16 if key.size == 0 or key.max() < 32767 else np.int32  # int16: a radix sort
        order = np.argsort(key[keep].astype(small), kind="stable")  # stable: keeps cost order
        rows = np.flatnonzero(keep)[order]
        if rows.size == 0:
            return None
        return {name: col[rows] for name, col in actions.items()}

    @staticmethod
    def _devices_by_entity(tick, k: int, level: int, order_index: int = ORDER_BY_COST) -> dict:
        """Returns the devices of type-k candidates sorted by (entity of `level`, victim rank
        in `_candidates`' table `order_index`), with a flag on each victim's first device per
        entity; once per tick."""
        cache = tick.__dict__.setdefault("_preemption_devices", {})
        if (k, level, order_index) in cache:
            return cache[(k, level, order_index)]
        by_cost = SlaPreemption._candidates(tick, k)[order_index]
        state = tick.state
        row_of = np.full(state.n_jobs, -1, np.int64)
        row_of[by_cost["job"]] = np.arange(by_cost["job"].size)
        devices = np.flatnonzero((state.holder >= 0) & state.usable & (state.type_id == k))
        rows = row_of[state.holder[devices]]
        devices, rows = devices[rows >= 0], rows[rows >= 0]
        entity = state.node_entity[level][state.node[devices]]
        order = np.lexsort((devices, rows, entity))
        entity, rows = entity[order], rows[order]
        first = (np.r_[True, (entity[1:] != entity[:-1]) | (rows[1:] != rows[:-1])] if rows.size
                 else np.zeros(0, np.bool_))
        cache[(k, level, order_index)] = {"entity": entity, "row": rows, "first": first}
        return cache[(k, level, order_index)]

    @staticmethod
    def _release_wait(tick, k: int, level: int) -> np.ndarray:
        """Returns, per entity of `level`, the most seconds a type-k device counted free there
        still waits for its last holder's checkpoint (Accelerators.releasing_until; 0 where
        none): a job placed there starts no sooner. Once per tick, level and type; the devices
        a preemption releases in this tick are not in it (their wait is the victim's
        `ckpt_s`)."""
        cache = tick.__dict__.setdefault("_preemption_release_wait", {})
        if (k, level) in cache:
            return cache[(k, level)]
        state, snap = tick.state, tick.snapshot
        out = np.zeros(state.n_entities[level])
        releasing = state.releasing
        if releasing.size:
            releasing = releasing[state.free[releasing] & (state.type_id[releasing] == k)]
            left = snap.accelerators.releasing_until[releasing] - snap.now
            np.maximum.at(out, state.node_entity[level][state.node[releasing]], np.maximum(left, 0.0))
        cache[(k, level)] = out
        return out

    def _choose_in_one(self, tick, j: int, need: int, level: int):
        """Returns (region, rows, actions, (level, entity), wait) preempting whole jobs to free
        `need` devices within one node / rack / cluster, or None; `wait` as `_shrink_in_one`'s.

        Among entities where the idle devices plus those of eligible victims (borrowed or
        lower tier, no approval needed, not just started) reach `need`, the one needing the
        fewest preemptions, then the least lost work, wins (for a Premium preemptor the room
        ready soonest comes first); victims go cheapest first.
        """
        jobs, state = tick.snapshot.jobs, tick.state
        k, team = int(jobs.type_id[j]), int(jobs.team[j])
        premium = int(jobs.tier[j]) == PREMIUM
        soonest = int(jobs.tier[j]) in tick.snapshot.settings.soonest_room_tiers
        order_index = ORDER_BY_RELEASE_TIME if premium else ORDER_BY_COST
        by_cost = self._candidates(tick, k)[order_index]
        reclaim = by_cost["borrower"] & (by_cost["team"] != team)
        eligible = (~tick.touched[by_cost["job"]] & (reclaim | _lower_priority(tick, j, by_cost))
                    & ~by_cost["recent"] & ~by_cost["needs_approval"])
        devices = self._devices_by_entity(tick, k, level, order_index)
        keep = eligible[devices["row"]]
        if not keep.any():
            return None
        entity, row, first = devices["entity"][keep], devices["row"][keep], devices["first"][keep]
        start = _segment_starts(entity)
        freed = _cumsum_by_segment(np.ones(entity.size, np.int64), start)  # victim devices so far, per entity
        reached = state.free_count[level][entity, k] + freed >= need
        if not reached.any():
            return None
        hit = np.flatnonzero(reached)
        hit_entity, first_hit = np.unique(entity[hit], return_index=True)
        ends = hit[first_hit]
        n_victims = _cumsum_by_segment(first.astype(np.int64), start)[ends]
        lost = _cumsum_by_segment(np.where(first, by_cost["lost"][row], 0.0), start)[ends]
        if soonest:
            # a Premium preemptor starts when the slowest of its victims' checkpoints is written
            # (they are written in parallel) and the devices still releasing there are free:
            # the soonest room wins, then the fewest victims, then the least lost work
            wait = np.maximum(_max_in_ranges(np.where(first, by_cost["ckpt_s"][row], 0.0), start[ends], ends),
                              self._release_wait(tick, k, level)[hit_entity])
            pick = int(np.lexsort((hit_entity, lost, n_victims, _wait_steps(tick, j, wait)))[0])
        else:
            wait = np.zeros(ends.size)
            pick = int(np.lexsort((hit_entity, lost, n_victims))[0])
        best, best_wait = int(ends[pick]), float(wait[pick])
        segment = np.arange(int(start[best]), best + 1)
        victims = row[segment[first[segment]]]
        actions = {
            "job": by_cost["job"][victims],
            "group": np.where(reclaim[victims], GROUP_RECLAIM, GROUP_PREEMPT),
            "release": by_cost["usable"][victims],
            "cost": by_cost["lost"][victims],
            "region": by_cost["region"][victims],
        }
        chosen = int(entity[best])
        return (int(state.entity_region[level][chosen]), list(range(victims.size)), actions, (level, chosen),
                best_wait)

    def _shrink_in_one(self, tick, j: int, need: int, level: int):
        """Returns (region, victims, level, entity, wait) where shrinking elastic victims alone
        frees `need` devices within one node / rack / cluster of `level`, or None; `wait` is
        the seconds a Premium preemptor would wait there for its devices (0 for other tiers).

        Victims are those `_actions` would shrink (lower tier, not reclaimed borrowers, no
        approval needed); each gives at most min(its devices there, what it can shrink by).
        The entity needing the fewest shrinks (for a Premium preemptor: the soonest ready, then
        the fewest shrinks), then the fewest devices taken, then the lowest index wins; victims are
        listed biggest release there first (smallest checkpoint first for Premium; `victims`
        are rows of the by-cost candidate table).
        """
        jobs, state = tick.snapshot.jobs, tick.state
        k, tier, team = int(jobs.type_id[j]), int(jobs.tier[j]), int(jobs.team[j])
        by_cost = self._candidates(tick, k)[ORDER_BY_COST]
        shrinkable = (~tick.touched[by_cost["job"]] & _lower_priority(tick, j, by_cost)
                      & ~(by_cost["borrower"] & (by_cost["team"] != team))
                      & ~by_cost["needs_approval"] & (by_cost["shrink"] > 0))
        if not shrinkable.any():
            return None
        devices = self._devices_by_entity(tick, k, level)
        keep = shrinkable[devices["row"]]
        if not keep.any():
            return None
        entity, row, first = devices["entity"][keep], devices["row"][keep], devices["first"][keep]
        starts = np.flatnonzero(first)  # one group per (entity, victim)
        g_entity, g_row = entity[starts], row[starts]
        g_release = np.minimum(np.diff(np.r_[starts, entity.size]), by_cost["shrink"][g_row])
        # a Premium preemptor waits for its victims' cut: smallest checkpoint first (as `_actions`);
        # a shrunk victim's devices stay busy until its checkpoint is written, as a preempted one's
        soonest = tier in tick.snapshot.settings.soonest_room_tiers
        g_wait = by_cost["ckpt_s"][g_row] if soonest or tier == PREMIUM else np.zeros(g_row.size)
        order = np.lexsort((g_row, -g_release, g_wait, g_entity))
        g_entity, g_row, g_release, g_wait = g_entity[order], g_row[order], g_release[order], g_wait[order]
        start = _segment_starts(g_entity)
        within = _cumsum_by_segment(g_release, start)
        free = state.free_count[level][g_entity, k]
        reached = free + within >= need
        if not reached.any():
            return None
        hit = np.flatnonzero(reached)
        hit_entity, first_hit = np.unique(g_entity[hit], return_index=True)
        ends = hit[first_hit]
        n_shrinks = ends - start[ends] + 1
        if soonest:
            # the soonest room first (the slowest victim's checkpoint, the devices still
            # releasing there), then the fewest shrinks
            wait = np.maximum(_max_in_ranges(g_wait, start[ends], ends), self._release_wait(tick, k, level)[hit_entity])
            pick = int(np.lexsort((hit_entity, within[ends], n_shrinks, _wait_steps(tick, j, wait)))[0])
        else:
            wait = np.zeros(ends.size)
            pick = int(np.lexsort((hit_entity, within[ends], n_shrinks))[0])
        best = int(ends[pick])
        chosen = int(g_entity[best])
        victims = g_row[int(start[best]):best + 1].tolist()
        return int(state.entity_region[level][chosen]), victims, level, chosen, float(wait[pick])

    def _apply_shrinks_in(self, tick, j: int, victims: list, level: int, entity: int, need: int) -> list:
        """Shrinks the victims (rows of the by-cost table) in order, giving up their devices in
        the entity first, until `need` devices are free there. Returns one phrase per victim."""
        jobs, state = tick.snapshot.jobs, tick.state
        k = int(jobs.type_id[j])
        by_cost = self._candidates(tick, k)[ORDER_BY_COST]
        done = []
        for r in victims:
            missing = need - int(state.free_count[level][entity, k])
            if missing <= 0:
                break
            v = int(by_cost["job"][r])
            devices = state.job_devices(v)
            inside = (state.node_entity[level][state.node[devices]] == entity) & state.usable[devices]
            have, n_inside = devices.size, int(inside.sum())
            smaller = [c for c in tick.run_counts(v) if c < have]
            enough = [c for c in smaller if min(n_inside, have - c) >= missing]
            keep_count = max(enough) if enough else min(smaller)
            done.append(self._shrink(tick, j, v, keep_count, give_first=inside))
        return done

    def _shrink(self, tick, j: int, v: int, keep_count: int, give_first=None) -> str:
        """Shrinks victim v to keep_count devices for job j (a Resize); returns the phrase for
        j's reason. `give_first` (bool per device of v) marks devices to give up first."""
        jobs = tick.snapshot.jobs
        devices = tick.state.job_devices(v)
        have = devices.size
        keep = self._keep_after_shrink(tick, v, keep_count, give_first)
        tick.take(v, np.setdiff1d(devices, keep))
        tick.decisions.append(Resize(
            job=v, job_id=int(jobs.ids[v]), devices=tuple(keep.tolist()), code=REASON_SHRUNK,
            reason=f"shrunk from {have} to {keep.size} devices for {tick.job_label(j)}",
            for_job=j, for_job_id=int(jobs.ids[j])))
        tick.victims_used += 1
        return f"shrinking {tick.job_label(v)} to {keep.size}"

    def _choose(self, tick, j: int, actions: dict, need: int, with_approval: bool):
        """Returns (region, action rows in order) of the cheapest way to free `need`, or None.

        `actions` are sorted by (region, group, cost); the region needing the fewest
        preemptions, then the least lost work, then the fewest actions, wins.
        """
        k = int(tick.snapshot.jobs.type_id[j])
        idx = np.arange(actions["job"].size) if with_approval else \
            np.flatnonzero(actions["group"] != GROUP_APPROVAL)
        if idx.size == 0:
            return None
        region = actions["region"][idx]
        free = tick.state.region_free(k)
        release = actions["release"][idx]
        is_preempt = (actions["group"][idx] != GROUP_SHRINK).astype(np.int64)
        lost = np.where(is_preempt == 1, actions["cost"][idx], 0.0)
        start = _segment_starts(region)  # running totals below restart at each region's first row
        reached = _cumsum_by_segment(release, start) + free[region] >= need
        if not reached.any():
            return None
        hit = np.flatnonzero(reached)
        hit_region, first_hit = np.unique(region[hit], return_index=True)
        ends = hit[first_hit]
        n_pre = _cumsum_by_segment(is_preempt, start)[ends]
        lost_total = _cumsum_by_segment(lost, start)[ends]
        n_rows = ends - start[ends] + 1
        best = np.lexsort((hit_region, n_rows, lost_total, n_pre))[0]
        end = int(ends[best])
        return int(hit_region[best]), [int(r) for r in idx[int(start[end]):end + 1]]

    # --- acting ---------------------------------------------------------------------------
    def _apply(self, tick, j: int, actions: dict, rows: list, region: int, need: int, scope=None) -> list:
        """Shrinks and preempts the chosen victims in order, each only as far as still needed.

        Returns what was done, one phrase per victim, for the preemptor's reason."""
        jobs = tick.snapshot.jobs
        k = int(jobs.type_id[j])
        preempted = {int(actions["job"][r]) for r in rows if actions["group"][r] != GROUP_SHRINK}
        done = []  # "preempting job b (Basic)", for the preemptor's reason
        for r in rows:
            # scope = (level, entity) when room is made within one node / rack / cluster
            free = (tick.state.free_count[scope[0]][scope[1], k] if scope is not None
                    else tick.state.region_free(k)[region])
            missing = need - int(free)
            if missing <= 0:
                break
            v, group = int(actions["job"][r]), int(actions["group"][r])
            devices = tick.state.job_devices(v)
            if group == GROUP_SHRINK and v not in preempted:
                have = devices.size
                smaller = [c for c in tick.run_counts(v) if c < have]
                enough = [c for c in smaller if have - c >= missing]
                keep_count = max(enough) if enough else min(smaller)
                done.append(self._shrink(tick, j, v, keep_count))
            elif group != GROUP_SHRINK:
                done.append(self._preempt(tick, j, v, group))
        return done

    @staticmethod
    def _preempt(tick, j: int, v: int, group: int) -> str:
        """Preempts victim v (whole) for job j; returns the phrase for j's reason."""
        jobs = tick.snapshot.jobs
        devices = tick.state.job_devices(v)
        tick.take(v, devices)
        code = REASON_RECLAIMED if group == GROUP_RECLAIM else REASON_PREEMPTED
        why = (f"borrowed devices reclaimed for {tick.job_label(j)} of team "
               f"{tick.snapshot.teams.names[int(jobs.team[j])]}, which is within its quota"
               if group == GROUP_RECLAIM else f"preempted for {tick.job_label(j)}")
        if group != GROUP_RECLAIM and jobs.tier[v] == jobs.tier[j]:
            code = REASON_PREEMPTED_LESS_SERVED
            why += ", which has had less service (attained-service queues)"
        step = int(jobs.last_checkpoint_step[v])
        tick.decisions.append(Preempt(
            job=v, job_id=int(jobs.ids[v]), code=code,
            reason=f"{why}; least lost work among candidates; resumes from its checkpoint",
            released=tuple(devices.tolist()), for_job=j, for_job_id=int(jobs.ids[j])))
        tick.requeued[v] = (code, f"{why}; back in line, resumes from step {step} or later")
        tick.victims_used += 1
        verb = "reclaiming borrowed devices from" if group == GROUP_RECLAIM else "preempting"
        return f"{verb} {tick.job_label(v)}"

    @staticmethod
    def _keep_after_shrink(tick, v: int, keep_count: int, give_first=None) -> np.ndarray:
        """Returns the devices job v keeps: those not marked `give_first` (bool per device),
        then those on the nodes where it has the most devices."""
        devices = tick.state.job_devices(v)
        nodes = tick.state.node[devices]
        per_node = np.bincount(nodes)[nodes]
        if give_first is None:
            order = np.lexsort((devices, -per_node))
        else:
            order = np.lexsort((devices, -per_node, give_first))
        return np.sort(devices[order[:keep_count]])

    def _ask_approval(self, tick, j: int, actions: dict, chosen) -> bool:
        """Emits needs_approval Preempts for the SLA-protected victims; j waits. Returns False.

        Nothing else is done this tick: the unprotected victims of the same choice are only
        preempted once the approval has arrived (the next snapshot carries it).
        """
        _, rows = chosen
        jobs, floor = tick.snapshot.jobs, tick.snapshot.settings.standard_sla_floor
        names = []
        for r in rows:
            if actions["group"][r] != GROUP_APPROVAL:
                continue
            v = int(actions["job"][r])
            names.append(jobs.name(v))
            tick.approval_waiters.setdefault(v, set()).add(j)
            if v in tick.approval_asked:
                continue
            tick.approval_asked.add(v)
            if jobs.tier[v] == PREMIUM:
                why = "Premium is never preempted without an approved request"
            else:
                ideal = jobs.ideal_device_seconds[v]
                fraction = jobs.attained_device_seconds[v] / ideal if ideal > 0 else 1.0
                why = (f"{TIER_NAMES[int(jobs.tier[v])]} at {fraction:.0%} of its ideal device-time, "
                       f"below the {floor:.0%} floor")
            tick.decisions.append(Preempt(
                job=v, job_id=int(jobs.ids[v]), code=REASON_NEEDS_APPROVAL, needs_approval=True,
                reason=f"{tick.job_label(j)} needs its devices; {why}", for_job=j, for_job_id=int(jobs.ids[j])))
        base = tick.waiting.get(j, (REASON_WAITING_FOR_APPROVAL, ""))[1]
        why = "waiting for approval to preempt job " + ", ".join(names)
        tick.waiting[j] = (REASON_WAITING_FOR_APPROVAL, f"{base}; {why}" if base else why)
        return False

    def _explain(self, tick, j: int, code: str, why: str) -> bool:
        """Appends why preemption did not help to j's wait reason. Returns False.

        The code stays the placement's ("no room", "over quota") when preemption merely found
        nothing to take; it becomes REASON_BUDGET_SPENT when that is what stopped it.
        """
        base_code, base = tick.waiting.get(j, (code, ""))
        if code != REASON_NOTHING_TO_PREEMPT:
            base_code = code
        tick.waiting[j] = (base_code, f"{base}; {why}" if base else why)
        return False
