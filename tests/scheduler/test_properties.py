"""Properties over random fleets and job mixes (hypothesis), and determinism.

Each example builds a random fleet (regions, clusters, racks, nodes, 1-2 accelerator types,
some nodes draining or lost, some devices failed, maybe a drained region), random teams with
quotas, and random jobs, some already running on valid device sets; then runs three ticks,
applying each plan, and checks after every tick:
  - apply_plan accepts the plan (no device given twice, every start/migrate/resize a whole
    gang of an allowed count in one region, devices usable and of the right type) and the
    result validates;
  - every device set respects the job's max_spread (one node / rack / cluster / region);
  - Premium is never preempted, shrunk or moved for defragmentation without an approval
    (a job whose node or device died is restarted, not preempted: that is allowed);
  - no job started less than min_run_seconds ago is preempted (same exception);
  - Standard below its floor is preempted only with an approval;
  - a job whose preemption was denied is neither preempted, shrunk nor asked about;
  - quotas hold except for borrowing the plan states (Start/Resize.borrowed);
  - every pending job has exactly one wait reason, places are 1..n;
  - work conservation: no waiting job (region-wide, not just preempted, not of a packed
    tier) has its smallest allowed count (W for a full-size tier) free in one region after
    the tick, counting devices still being released and, for Premium, those kept for it;
  - the same snapshot gives the same plan.
"""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scheduler
from scheduler import (
    BASIC,
    NODE_DRAINING,
    NODE_LOST,
    NODE_READY,
    PENDING,
    PREMIUM,
    RUNNING,
    SPREAD_REGION,
    STANDARD,
    UNLIMITED,
    Accelerators,
    Jobs,
    Migrate,
    PolicySettings,
    Preempt,
    Resize,
    Snapshot,
    Start,
    Teams,
    placement_cost,
)
from scheduler.snapshot import allowed_counts

WORLD_SIZES = [1, 1, 1, 2, 2, 3, 4, 4, 6, 8, 8, 12, 16]


@st.composite
def snapshots(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_regions = draw(st.integers(1, 3))
    n_types = draw(st.integers(1, 2))
    type_id, node, rack, cluster, region = [], [], [], [], []
    n_node = n_rack = n_cluster = 0
    for r in range(n_regions):
        for _ in range(int(rng.integers(1, 3))):
            for _ in range(int(rng.integers(1, 3))):
                for _ in range(int(rng.integers(1, 4))):
                    per_node = int(rng.choice([1, 2, 4, 8]))
                    t = int(rng.integers(0, n_types))
                    type_id += [t] * per_node
                    node += [n_node] * per_node
                    rack += [n_rack] * per_node
                    cluster += [n_cluster] * per_node
                    region += [r] * per_node
                    n_node += 1
                n_rack += 1
            n_cluster += 1
    n_dev = len(type_id)
    node_status = rng.choice([NODE_READY] * 8 + [NODE_DRAINING, NODE_LOST], n_node).astype(np.int8)
    healthy = rng.random(n_dev) > 0.05
    drained = rng.random(n_regions) < 0.1
    n_teams = int(rng.integers(1, 4))
    quota = np.where(rng.random((n_teams, n_types)) < 0.5, UNLIMITED,
                     rng.integers(0, n_dev + 1, (n_teams, n_types)))
    decayed = rng.random((n_teams, n_types)) * 1e6
    n_jobs = draw(st.integers(0, 24))
    world = rng.choice(WORLD_SIZES, n_jobs)
    min_dev = np.array([int(rng.choice(allowed_counts(int(w), 1))) for w in world], np.int64)
    tier = rng.choice([PREMIUM, STANDARD, BASIC], n_jobs)
    jtype = rng.integers(0, n_types, n_jobs)
    now = 100_000.0
    spread = rng.choice([0, 1, 2, 3, 3, 3, 3, 3], n_jobs)
    holder = np.full(n_dev, -1, np.int32)
    state = np.zeros(n_jobs, np.int8)
    dev_type = np.asarray(type_id)
    levels = (np.asarray(node), np.asarray(rack), np.asarray(cluster), np.asarray(region))
    for j in range(n_jobs):
        if rng.random() < 0.6:
            # a running job on a valid set: an allowed count, one region, within its max_spread
            counts = allowed_counts(int(world[j]), int(min_dev[j]))
            c = int(rng.choice(counts))
            column = levels[int(spread[j])]
            ok = (holder == -1) & (dev_type == jtype[j])
            entities, sizes = np.unique(column[ok], return_counts=True)
            entities = entities[sizes >= c]
            if entities.size:
                free = np.flatnonzero(ok & (column == rng.choice(entities)))
                holder[rng.choice(free, c, replace=False)] = j
                state[j] = RUNNING
    # some free devices are still being released by a previous holder (up to 2 min more)
    releasing_until = np.where(rng.random(n_dev) < 0.2, now + rng.random(n_dev) * 120, -np.inf)
    acc = Accelerators(type_id=type_id, node=node, rack=rack, cluster=cluster, region=region,
                       healthy=healthy, holder=holder, releasing_until=releasing_until)
    jobs = Jobs(
        ids=np.arange(100, 100 + n_jobs), team=rng.integers(0, n_teams, n_jobs), tier=tier, type_id=jtype,
        world_size=world, min_devices=min_dev, state=state,
        submit_time=now - rng.random(n_jobs) * 5000,
        attained_device_seconds=rng.random(n_jobs) * 1000, ideal_device_seconds=np.full(n_jobs, 1000.0),
        last_checkpoint_time=now - rng.random(n_jobs) * 3000, last_checkpoint_step=rng.integers(0, 10**6, n_jobs),
        checkpoint_bytes=rng.integers(0, 10**10, n_jobs),
        last_start_time=np.where(state == RUNNING, now - rng.random(n_jobs) * 2000, -np.inf),
        last_resize_time=np.where(rng.random(n_jobs) < 0.3, now - rng.random(n_jobs) * 1200, -np.inf),
        preemption_approved=rng.random(n_jobs) < 0.15,
        preemption_denied=rng.random(n_jobs) < 0.1,
        max_spread=spread)
    teams = Teams(names=[f"t{i}" for i in range(n_teams)], quota=quota, decayed_usage=decayed)
    policy_settings = PolicySettings(min_run_seconds=float(rng.choice([0, 600, 1200])),
                                     allow_borrowing=bool(rng.random() < 0.7),
                                     max_preemptions_per_tick=int(rng.choice([1, 4, 256])),
                                     max_defrag_migrations_per_tick=int(rng.choice([0, 2, 16])),
                                     premium_reserve_devices=int(rng.choice([0, 0, 1, 2])),
                                     premium_reserve_fraction=float(rng.choice([0.0, 0.01, 0.1])),
                                     full_size_tiers=((PREMIUM,), ())[int(rng.integers(0, 2))],
                                     packed_tiers=((PREMIUM,), ())[int(rng.integers(0, 2))],
                                     floor_speed_tiers=((STANDARD,), ())[int(rng.integers(0, 2))],
                                     soonest_room_tiers=((PREMIUM, STANDARD), (PREMIUM,), ())[
                                         int(rng.integers(0, 3))])
    return Snapshot(accelerators=acc, jobs=jobs, teams=teams, now=now,
                    type_names=["H100-80GB", "A100-40GB"][:n_types], node_status=node_status,
                    region_drained=drained, settings=policy_settings).validate()


def dead_jobs(snap):
    """Returns the set of jobs holding a device that died (lost node or failed device)."""
    acc = snap.accelerators
    dead = (snap.node_status[acc.node] == NODE_LOST) | ~acc.healthy
    return set(acc.holder[dead & (acc.holder >= 0)].tolist())


def spread_ok(snap, j, devices):
    acc = snap.accelerators
    level = int(snap.jobs.max_spread[j])
    column = (acc.node, acc.rack, acc.cluster, acc.region)[level]
    return np.unique(column[np.asarray(devices)]).size == 1


def check_tick(snap, plan):
    jobs, s = snap.jobs, snap.settings
    dead = dead_jobs(snap)
    after = scheduler.apply_plan(snap, plan, snap.now + 60).validate()
    alloc_before = snap.allocation_counts()
    borrowed = np.zeros((len(snap.teams), snap.n_types), np.int64)
    for d in plan.decisions:
        j = d.job
        if isinstance(d, (Start, Migrate, Resize)):
            assert spread_ok(snap, j, d.devices), d
            if isinstance(d, (Start, Resize)):
                borrowed[jobs.team[j], jobs.type_id[j]] += d.borrowed
        protected = jobs.tier[j] == PREMIUM and not jobs.preemption_approved[j]
        if isinstance(d, Preempt) and j not in dead or (isinstance(d, Resize) and len(d.devices) < alloc_before[j]):
            assert not jobs.preemption_denied[j], f"a denied job was touched: {d}"
        if isinstance(d, Preempt) and not d.needs_approval and j not in dead:
            assert not protected, f"Premium preempted without approval: {d}"
            assert snap.now - jobs.last_start_time[j] >= s.min_run_seconds, f"thrash: {d}"
            if jobs.tier[j] == STANDARD and not jobs.preemption_approved[j]:
                assert jobs.attained_device_seconds[j] / jobs.ideal_device_seconds[j] >= s.standard_sla_floor, d
        if isinstance(d, Resize) and len(d.devices) < alloc_before[j]:
            assert not protected, f"Premium shrunk without approval: {d}"
        if isinstance(d, Migrate) and d.code == "moved to defragment":
            assert not protected, d
    # quotas hold except stated borrowing (and what was already borrowed before the tick)
    usage_before, usage_after = snap.team_usage(), after.team_usage()
    quota = snap.teams.quota
    excess_before = np.maximum(usage_before - quota, 0)
    assert (usage_after <= quota + excess_before + borrowed).all()
    # every pending job has exactly one reason and a place
    pending = set(np.flatnonzero(after.jobs.state == PENDING).tolist())
    waiting = [w.job for w in plan.waiting]
    assert sorted(waiting) == sorted(pending)
    assert [w.place for w in plan.waiting] == list(range(1, len(waiting) + 1))
    assert all(w.reason and w.code for w in plan.waiting)
    # work conservation: nothing that could start waits while its size is idle in one region
    acc = after.accelerators
    usable = acc.healthy & (after.node_status[acc.node] == NODE_READY) & ~after.region_drained[acc.region]
    free = usable & (acc.holder < 0)
    n_regions = int(acc.region.max()) + 1 if len(acc) else 0
    requeued = {d.job for d in plan.decisions if isinstance(d, Preempt) and not d.needs_approval}
    for w in plan.waiting:
        j = w.job
        if j in requeued or jobs.max_spread[j] != SPREAD_REGION or jobs.tier[j] in s.packed_tiers:
            continue  # pinned tighter than a region (by max_spread or by its tier's packing)
        if not s.allow_borrowing and usage_after[jobs.team[j], jobs.type_id[j]] >= quota[jobs.team[j], jobs.type_id[j]]:
            continue
        if not s.allow_borrowing:
            continue  # quota may block even with idle devices
        need = min(allowed_counts(int(jobs.world_size[j]), int(jobs.min_devices[j])))
        if jobs.tier[j] in s.full_size_tiers:
            need = int(jobs.world_size[j])  # its tier starts only at W
        elif jobs.tier[j] in s.floor_speed_tiers:  # only at counts that keep its SLA floor speed
            fast = min(placement_cost.counts_at_speed(
                int(jobs.world_size[j]), allowed_counts(int(jobs.world_size[j]), int(jobs.min_devices[j])),
                s.standard_sla_floor))
            capacity = np.bincount(acc.region[usable & (acc.type_id == jobs.type_id[j])], minlength=n_regions)
            need = fast if fast <= capacity.max(initial=0) else need  # else it may run below its floor
        per_region = np.bincount(acc.region[free & (acc.type_id == jobs.type_id[j])], minlength=n_regions)
        usable_region = np.bincount(acc.region[usable & (acc.type_id == jobs.type_id[j])], minlength=n_regions)
        kept = np.maximum(s.premium_reserve_devices,  # idle for Premium only
                          np.floor(usable_region * s.premium_reserve_fraction).astype(np.int64))
        if jobs.tier[j] == PREMIUM:
            kept = 0
        assert (per_region < need + kept).all(), f"job {j} waits ({w.reason}) with {per_region} free"
    return after


# derandomize: CI runs the same 60 examples every time (no flaky red build); run with a
# larger max_examples and derandomize=False locally to search further
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_three_ticks_keep_every_invariant(snap):
    for _ in range(3):
        plan = scheduler.schedule(snap)
        assert scheduler.schedule(snap) == plan  # determinism
        snap = check_tick(snap, plan)


def test_the_same_snapshot_rebuilt_gives_the_same_plan():
    rng = np.random.default_rng(3)
    n = 64
    acc = Accelerators(type_id=np.zeros(n), node=np.arange(n) // 8, rack=np.arange(n) // 32,
                       cluster=np.zeros(n), region=np.zeros(n))
    jobs = Jobs(ids=np.arange(40), team=rng.integers(0, 3, 40), tier=rng.integers(0, 3, 40),
                type_id=np.zeros(40), world_size=rng.choice([1, 2, 4, 8], 40),
                submit_time=rng.random(40) * 100)
    build = lambda: Snapshot(accelerators=acc, jobs=jobs, teams=Teams(names=["a", "b", "c"]),  # noqa: E731
                             now=1000.0, type_names=["H100-80GB"])
    plans = [scheduler.schedule(build()) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    assert plans[0].decisions and plans[0].waiting
