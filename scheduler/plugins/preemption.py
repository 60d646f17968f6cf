"""SLA tiers and cost-aware victims: make room for a job by shrinking, then preempting, others.

Called for the job at the head of the line when it does not fit in idle devices. Victims
must hold its accelerator type, be in one region (a gang never spans regions), and be:
  - borrowing over their team's quota while the preemptor's team is within its own: those
    devices are reclaimed first, whatever the victim's tier (except Premium, see below); or
  - of a lower tier than the preemptor.
Within a region, actions are taken in this order until enough devices are free:
  1. reclaim borrowed devices (preempt borrowers, least lost work first);
  2. shrink elastic victims (splicing: no work is lost), Basic before Standard, biggest
     possible release first, each to the largest allowed count that still frees enough;
  3. preempt victims, Basic before Standard, least lost work first (device-seconds since
     the last checkpoint), then smallest checkpoint.
The region needing the fewest preemptions, then the least lost work, wins.

SLA rules: Premium is never preempted or shrunk unless Jobs.preemption_approved; Standard
may be while attained/ideal >= PolicySettings.standard_sla_floor (else only with approval);
Basic freely. If the only way to fit needs an approval, the plan carries Preempt decisions
with needs_approval=True for those victims (nothing else happens) and the job waits for the
approval. No thrash: a job (re)started less than PolicySettings.min_run_seconds ago is not
preempted (it may still be shrunk). The preemptor never borrows by preempting: a job whose
team would go over quota fits only into idle devices.
"""
from __future__ import annotations

import numpy as np

from scheduler.plan import Preempt, Resize, Start
from scheduler.snapshot import BASIC, PREMIUM, STANDARD, TIER_NAMES

NAME = "preempt.sla_cost_aware"
REASON_PLACED_BY_PREEMPTION = "placed by preemption"  # Start after making room
REASON_SHRUNK = "shrunk for a higher tier"  # Resize of a victim
REASON_PREEMPTED = "preempted for a higher tier"  # Preempt of a victim
REASON_RECLAIMED = "borrowed devices reclaimed"  # Preempt of a borrower
REASON_NEEDS_APPROVAL = "needs approval"  # Preempt that would break an SLA
REASON_WAITING_FOR_APPROVAL = "waiting for approval"  # wait reason of the preemptor
REASON_NOTHING_TO_PREEMPT = "nothing to preempt"  # wait reason: no eligible victims suffice
REASON_BUDGET_SPENT = "preemption budget spent"  # wait reason: PolicySettings.max_preemptions_per_tick

GROUP_RECLAIM, GROUP_SHRINK, GROUP_PREEMPT, GROUP_APPROVAL = 0, 1, 2, 3


class SlaPreemption:
    """Finds the cheapest set of shrinks/preemptions that makes a job fit, and applies it."""

    NAME = NAME

    def run(self, tick, j: int) -> bool:
        """Returns True if job j was started after shrinking/preempting others.

        Otherwise leaves everything as it was and adds to j's wait reason why preemption
        did not help.
        """
        snap, jobs, settings = tick.snapshot, tick.snapshot.jobs, tick.snapshot.settings
        counts = jobs.allowed_counts(j)
        within, _ = tick.policy.quota.counts_allowed(tick, j, counts)
        if not within:
            return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT,
                                 "its team is at its quota, so it may only borrow idle devices")
        if tick.victims_used >= settings.max_preemptions_per_tick:
            return self._explain(tick, j, REASON_BUDGET_SPENT,
                                 f"the preemption budget of {settings.max_preemptions_per_tick} "
                                 f"victims per tick is spent; next tick")
        actions = self._actions(tick, j)
        if actions is None:
            who = "borrowed devices" if jobs.tier[j] == BASIC else "lower-tier jobs or borrowed devices"
            return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT, f"no {who} of its type to take")
        need = min(within)
        chosen = self._choose(tick, j, actions, need, with_approval=False)
        if chosen is None:
            chosen = self._choose(tick, j, actions, need, with_approval=True)
            if chosen is None:
                return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT,
                                     "shrinking or preempting every eligible job would not free "
                                     f"{need} {tick.type_name(j)} together in one region")
            return self._ask_approval(tick, j, actions, chosen)
        region, rows = chosen
        if tick.victims_used + len(np.unique(actions["job"][rows])) > settings.max_preemptions_per_tick:
            return self._explain(tick, j, REASON_BUDGET_SPENT,
                                 f"making room needs more victims than the per-tick budget of "
                                 f"{settings.max_preemptions_per_tick} has left; next tick")
        mark = tick.mark()
        self._apply(tick, j, actions, rows, region, need)
        placement = tick.policy.place.place(tick, j, within, region=region)
        if placement is None:  # the job's max_spread is tighter than what was freed
            tick.rollback(mark)
            return self._explain(tick, j, REASON_NOTHING_TO_PREEMPT,
                                 "preemption frees room in the region but not within one "
                                 + ("node", "rack", "cluster", "region")[int(jobs.max_spread[j])])
        tick.give(j, placement.devices)
        n_pre = sum(1 for r in rows if actions["group"][r] != GROUP_SHRINK)
        n_shrink = len(rows) - n_pre
        tick.decisions.append(Start(
            job=j, job_id=int(jobs.ids[j]), devices=tuple(placement.devices.tolist()),
            code=REASON_PLACED_BY_PREEMPTION,
            reason=(f"{len(placement)} {tick.type_name(j)} in {snap.region_names[region]} after "
                    f"preempting {n_pre} and shrinking {n_shrink} lower-priority jobs")))
        tick.waiting.pop(j, None)
        return True

    # --- computing (no side effects) -------------------------------------------------------
    def _actions(self, tick, j: int):
        """Returns the candidate actions against other jobs as arrays, or None if there are none."""
        snap, jobs, settings = tick.snapshot, tick.snapshot.jobs, tick.snapshot.settings
        state = tick.state
        k, tier, team = int(jobs.type_id[j]), int(jobs.tier[j]), int(jobs.team[j])
        held = np.flatnonzero((state.alloc > 0) & (tick.usable_alloc > 0))
        cand = held[(jobs.type_id[held] == k) & ~tick.touched[held]]
        reclaim = tick.borrower[cand] & (jobs.team[cand] != team)
        lower = jobs.tier[cand] > tier
        cand, reclaim = cand[reclaim | lower], reclaim[reclaim | lower]
        if cand.size == 0:
            return None
        if cand.size > settings.max_victim_scan:
            # keep the cheapest (lowest tier first, least lost work) to bound the work per preemptor
            cost = tick.lost_work_seconds(cand)
            keep = np.lexsort((cost, -jobs.tier[cand]))[:settings.max_victim_scan]
            keep.sort()
            cand, reclaim = cand[keep], reclaim[keep]
        c_tier = jobs.tier[cand]
        ideal = jobs.ideal_device_seconds[cand]
        fraction = np.where(ideal > 0, jobs.attained_device_seconds[cand] / np.where(ideal > 0, ideal, 1), 1.0)
        approved = jobs.preemption_approved[cand]
        needs_approval = ~approved & ((c_tier == PREMIUM) | ((c_tier == STANDARD) &
                                                             (fraction < settings.standard_sla_floor)))
        recent = (snap.now - jobs.last_start_time[cand]) < settings.min_run_seconds
        alloc = state.alloc[cand]
        usable = tick.usable_alloc[cand]
        region = self._regions(tick, cand)
        lost = tick.lost_work_seconds(cand)
        ckpt = jobs.checkpoint_bytes[cand].astype(np.float64)
        # smallest allowed count of each candidate: the largest divisor-gap shrink possible
        min_count = tick.min_count[cand]

        rows = []
        # 0. reclaim borrowed (whole job), unless that needs an approval
        g0 = reclaim & ~needs_approval & ~recent
        rows.append((cand[g0], np.full(g0.sum(), GROUP_RECLAIM), usable[g0], lost[g0], region[g0], c_tier[g0], ckpt[g0]))
        # 1. shrink elastic lower-tier jobs (no approval needed, not borrowers)
        shrinkable = ~reclaim & ~needs_approval & (alloc > min_count)
        release = np.minimum(alloc - min_count, usable)
        g1 = shrinkable & (release > 0)
        rows.append((cand[g1], np.full(g1.sum(), GROUP_SHRINK), release[g1], -release[g1].astype(np.float64),
                     region[g1], c_tier[g1], ckpt[g1]))
        # 2. preempt lower-tier jobs: what a shrink did not already release
        g2 = ~reclaim & ~needs_approval & ~recent
        rest = usable - np.where(g1, release, 0)
        rows.append((cand[g2], np.full(g2.sum(), GROUP_PREEMPT), rest[g2], lost[g2], region[g2], c_tier[g2], ckpt[g2]))
        # 3. preemptions that need an approval
        g3 = needs_approval & ~recent
        rows.append((cand[g3], np.full(g3.sum(), GROUP_APPROVAL), usable[g3], lost[g3], region[g3], c_tier[g3], ckpt[g3]))
        cols = [np.concatenate([r[i] for r in rows]) for i in range(7)]
        names = ("job", "group", "release", "cost", "region", "tier", "ckpt")
        actions = dict(zip(names, cols))
        keep = actions["release"] > 0
        if not keep.any():
            return None
        return {name: col[keep] for name, col in actions.items()}

    @staticmethod
    def _regions(tick, cand: np.ndarray) -> np.ndarray:
        """Returns the region of each candidate job (vectorised over the devices they hold)."""
        if not hasattr(tick, "_job_region"):
            holder = tick.state.holder
            held = np.flatnonzero(holder >= 0)
            region = np.full(tick.state.n_jobs, -1, np.int64)
            region[holder[held]] = tick.snapshot.accelerators.region[held]
            tick._job_region = region  # untouched jobs keep their region all tick
        return tick._job_region[cand]

    def _choose(self, tick, j: int, actions: dict, need: int, with_approval: bool):
        """Returns (region, action rows in order) of the cheapest way to free `need`, or None."""
        k = int(tick.snapshot.jobs.type_id[j])
        sel = np.ones(actions["job"].size, np.bool_) if with_approval else actions["group"] != GROUP_APPROVAL
        idx = np.flatnonzero(sel)
        if idx.size == 0:
            return None
        region = actions["region"][idx]
        free = tick.state.region_free(k)
        order = np.lexsort((actions["job"][idx], actions["ckpt"][idx], actions["cost"][idx],
                            -actions["tier"][idx], actions["group"][idx], region))
        idx, region = idx[order], region[order]
        release = actions["release"][idx]
        is_preempt = (actions["group"][idx] != GROUP_SHRINK).astype(np.int64)
        lost = np.where(is_preempt == 1, actions["cost"][idx], 0.0)
        cum = np.cumsum(release)
        cum_pre = np.cumsum(is_preempt)
        cum_lost = np.cumsum(lost)
        first = np.r_[True, region[1:] != region[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(idx.size), 0))

        def within_region(c):  # running totals restarted at each region's first row
            return c - np.where(start > 0, c[start - 1], 0)

        freed = within_region(cum)
        reached = freed + free[region] >= need
        if not reached.any():
            return None
        hit = np.flatnonzero(reached)
        hit_region, first_hit = np.unique(region[hit], return_index=True)
        ends = hit[first_hit]
        n_pre = within_region(cum_pre)[ends]
        lost_total = within_region(cum_lost)[ends]
        n_rows = ends - start[ends] + 1
        best = np.lexsort((hit_region, n_rows, lost_total, n_pre))[0]
        end = int(ends[best])
        rows = idx[int(start[end]):end + 1]
        return int(hit_region[best]), [int(r) for r in rows]

    # --- acting ---------------------------------------------------------------------------
    def _apply(self, tick, j: int, actions: dict, rows: list, region: int, need: int) -> None:
        """Shrinks and preempts the chosen victims in order, each only as far as still needed."""
        jobs = tick.snapshot.jobs
        k = int(jobs.type_id[j])
        preempted = {int(actions["job"][r]) for r in rows if actions["group"][r] != GROUP_SHRINK}
        for r in rows:
            missing = need - int(tick.state.region_free(k)[region])
            if missing <= 0:
                break
            v, group = int(actions["job"][r]), int(actions["group"][r])
            devices = tick.state.job_devices(v)
            if group == GROUP_SHRINK and v not in preempted:
                have = devices.size
                smaller = [c for c in jobs.allowed_counts(v) if c < have]
                enough = [c for c in smaller if have - c >= missing]
                keep_count = max(enough) if enough else min(smaller)
                keep = self._keep_after_shrink(tick, v, keep_count)
                tick.take(v, np.setdiff1d(devices, keep))
                tick.decisions.append(Resize(
                    job=v, job_id=int(jobs.ids[v]), devices=tuple(keep.tolist()), code=REASON_SHRUNK,
                    reason=f"shrunk from {have} to {keep.size} devices for {tick.job_label(j)}"))
                tick.victims_used += 1
            elif group != GROUP_SHRINK:
                tick.take(v, devices)
                code = REASON_RECLAIMED if group == GROUP_RECLAIM else REASON_PREEMPTED
                why = ("borrowed devices reclaimed by team " + tick.snapshot.teams.names[int(jobs.team[j])]
                       if group == GROUP_RECLAIM else f"preempted for {tick.job_label(j)}")
                step = int(jobs.last_checkpoint_step[v])
                tick.decisions.append(Preempt(
                    job=v, job_id=int(jobs.ids[v]), code=code,
                    reason=f"{why}; least lost work among candidates; resumes from its checkpoint",
                    released=tuple(devices.tolist())))
                tick.requeued[v] = (code, f"{why}; back in line, resumes from step {step} or later")
                tick.victims_used += 1

    @staticmethod
    def _keep_after_shrink(tick, v: int, keep_count: int) -> np.ndarray:
        """Returns the devices job v keeps: those on the nodes where it has the most devices."""
        devices = tick.state.job_devices(v)
        nodes = tick.state.node[devices]
        per_node = np.bincount(nodes)[nodes]
        order = np.lexsort((devices, -per_node))
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
                reason=f"{tick.job_label(j)} needs its devices; {why}"))
        base = tick.waiting.get(j, (REASON_WAITING_FOR_APPROVAL, ""))[1]
        why = "waiting for approval to preempt job " + ", ".join(names)
        tick.waiting[j] = (REASON_WAITING_FOR_APPROVAL, f"{base}; {why}" if base else why)
        return False

    def _explain(self, tick, j: int, code: str, why: str) -> bool:
        base = tick.waiting.get(j, (code, ""))[1]
        tick.waiting[j] = (code, f"{base}; {why}" if base else why)
        return False
