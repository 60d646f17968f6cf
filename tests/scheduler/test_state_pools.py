"""WorkingState's free counts stay exact through any sequence of pool opens and closes,
allocations, releases and rollbacks: checked against a recount from scratch after every step.

Opening and closing a pool (the devices still being released, the Premium reserve) adds or
subtracts the pool's per-entity counts in whole-array steps; these tests are what says that
this gives the counts a device-by-device recount gives, and that the one-node best-fit
buckets still find the node a brute-force search finds.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import PREMIUM
from scheduler.builders import make_fleet, make_job, make_snapshot, make_team
from scheduler.snapshot import NO_JOB
from scheduler.state import LEVELS, POOL_RELEASING, POOL_RESERVE, WorkingState

NOW = 1000.0
# 2 regions x 2 clusters x 2 racks x 2 nodes x 4 devices = 64 devices, two types (one per region)
N_DEVICES = 64


def a_snapshot(held: list[int], unhealthy: list[int], releasing: list[int], reserve: int):
    """Returns a snapshot of the 64-device fleet where job "r<i>" holds device held[i] (when
    free and healthy), `unhealthy` devices are broken, `releasing` ones are still being released,
    and `reserve` devices per region and type are kept for Premium jobs."""
    fleet = (make_fleet().region("eu", clusters=2, racks=2, nodes=2, devices=4, type="H100-80GB")
             .region("us", clusters=2, racks=2, nodes=2, devices=4, type="A100-40GB"))
    builder = (make_snapshot().fleet(fleet).team(make_team("A").quota("H100-80GB", 64).quota("A100-40GB", 64))
               .now(NOW).settings(premium_reserve_devices=reserve, premium_reserve_fraction=0.0))
    broken = set(unhealthy)
    for i, device in enumerate(sorted(set(held) - broken)):
        type_name = "H100-80GB" if device < N_DEVICES // 2 else "A100-40GB"
        builder = builder.job(make_job(f"r{i}").team("A").type(type_name).ranks(1).on_devices(device))
    for i in range(8):  # pending jobs the steps allocate to
        builder = builder.job(make_job(f"p{i}").team("A").tier(PREMIUM).ranks(4))
    if broken:
        builder = builder.unhealthy(*sorted(broken))
    free_releasing = sorted(set(releasing) - set(held) - broken)
    if free_releasing:
        builder = builder.releasing(*free_releasing, until=NOW + 60.0)
    return builder.build()


class Model:
    """The free mask by the rules, device by device: what the counts must agree with."""

    def __init__(self, state: WorkingState):
        self.free = state.free.copy()
        self.journal: list = []

    def open(self, state: WorkingState, name: str) -> None:
        pool = state.pools[name]
        self.free[pool[state.holder[pool] == NO_JOB]] = True

    def close(self, state: WorkingState, name: str) -> None:
        self.free[state.pools[name]] = False


def recount(state: WorkingState, free: np.ndarray) -> list[np.ndarray]:
    """Returns free[level][entity, type] counted device by device from the mask `free`."""
    counts = []
    for level in LEVELS:
        table = np.zeros((state.n_entities[level], state.k), np.int64)
        for device in np.flatnonzero(free).tolist():
            table[state.node_entity[level][state.node[device]], state.type_id[device]] += 1
        counts.append(table)
    return counts


def check(state: WorkingState, model: Model) -> None:
    assert np.array_equal(state.free, model.free)
    assert not (state.free & (state.holder != NO_JOB)).any()
    assert not (state.free & ~state.usable).any()
    for level, expected in zip(LEVELS, recount(state, model.free)):
        assert np.array_equal(state.free_count[level], expected), f"level {level}"
    for k in range(state.k):
        col = state.free_count[0][:, k]
        for d in range(1, state.max_node_free[k] + 1):
            fits = np.flatnonzero(col >= d)
            expected = None if fits.size == 0 else int(fits[np.argmin(col[fits])])
            assert state._best_node(k, d) == expected, f"type {k}, {d} devices"


steps = st.lists(st.tuples(st.sampled_from(["open", "close", "close_all", "allocate", "release", "mark",
                                            "rollback"]),
                           st.integers(0, 10_000), st.integers(1, 6)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(held=st.lists(st.integers(0, N_DEVICES - 1), max_size=24),
       unhealthy=st.lists(st.integers(0, N_DEVICES - 1), max_size=6),
       releasing=st.lists(st.integers(0, N_DEVICES - 1), max_size=16),
       reserve=st.integers(0, 10), steps=steps)
def test_free_counts_equal_a_recount_after_any_steps(held, unhealthy, releasing, reserve, steps):
    state = WorkingState(a_snapshot(held, unhealthy, releasing, reserve))
    model = Model(state)
    marks: list[tuple[int, int]] = []  # (state journal mark, model journal length)
    check(state, model)
    for op, a, b in steps:
        names = (POOL_RELEASING, POOL_RESERVE)
        if op == "open":
            name = names[a % 2]
            was_open = name in state.open_pools
            opened = state.open_pool(name)
            assert opened == (not was_open and state.pools[name].size > 0)
            if opened:
                model.open(state, name)
        elif op == "close":
            name = names[a % 2]
            if name in state.open_pools:
                model.close(state, name)
            state.close_pools(names=(name,))
            assert name not in state.open_pools
        elif op == "close_all":
            for name in sorted(state.open_pools):
                model.close(state, name)
            state.close_pools()
            assert not state.open_pools
        elif op == "allocate":
            free = np.flatnonzero(state.free)
            if free.size == 0:
                continue
            j = a % state.n_jobs
            devs = np.sort(np.random.default_rng(a).choice(free, min(b, free.size), replace=False))
            state.allocate(j, devs)
            model.free[devs] = False
            model.journal.append(("allocate", devs))
        elif op == "release":
            holders = np.flatnonzero(state.alloc > 0)
            if holders.size == 0:
                continue
            j = int(holders[a % holders.size])
            mine = state.job_devices(j)
            devs = np.sort(np.random.default_rng(a).choice(mine, min(b, mine.size), replace=False))
            state.release(j, devs)
            back = devs[state.usable[devs]]
            model.free[back] = True
            model.journal.append(("release", back))
        elif op == "mark":
            marks.append((state.mark(), len(model.journal)))
        elif op == "rollback" and marks:
            mark, length = marks.pop()
            state.rollback(mark)
            while len(model.journal) > length:
                kind, devs = model.journal.pop()
                model.free[devs] = kind == "allocate"  # an undone allocate frees, an undone release holds
        check(state, model)


def test_a_pool_opened_and_closed_again_leaves_the_counts_as_they_were():
    snap = a_snapshot(held=[0, 5, 9, 40], unhealthy=[3], releasing=[1, 2, 33], reserve=3)
    state = WorkingState(snap)
    before = [c.copy() for c in state.free_count]
    assert state.reserve.size and state.releasing.size
    for name in (POOL_RESERVE, POOL_RELEASING):
        assert state.open_pool(name)
        assert not state.open_pool(name)  # open already
    assert state.free_count[3].sum() == before[3].sum() + state.reserve.size + state.releasing.size
    state.close_pools()
    assert all(np.array_equal(a, b) for a, b in zip(state.free_count, before))


def test_a_reserve_device_taken_while_open_stays_out_when_the_pool_closes():
    state = WorkingState(a_snapshot(held=[], unhealthy=[], releasing=[], reserve=2))
    free_before = int(state.free_count[3].sum())
    state.open_pool(POOL_RESERVE)
    taken = state.reserve[:1]
    state.allocate(0, taken)  # job 0 is "p0": no job holds a device
    state.close_pools()
    assert int(state.free_count[3].sum()) == free_before
    state.open_pool(POOL_RESERVE)  # only the reserve devices still unheld come back
    assert int(state.free_count[3].sum()) == free_before + state.reserve.size - 1

