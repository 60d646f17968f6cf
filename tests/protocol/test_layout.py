"""How W ranks lie on d devices (protocol.layout), and that every former copy of the rule agrees with it."""
import re

import pytest
from django.core.exceptions import ValidationError
from hypothesis import given
from hypothesis import strategies as st

from fleet.accelerator_types import ACCELERATOR_TYPES
from jobs.models import Job
from jobs.services import job_spec_clean
from protocol.layout import (
    LayoutError,
    device_counts_allowed,
    layout_check,
    layout_fits,
    rank_device,
    rank_devices,
)
from runtime.splice import device_map
from scheduler import rank_layout
from scheduler.snapshot import allowed_counts

COUNTS_CASES = [
    # (world_size, at_least, at_most, expected)
    (1, 1, None, (1,)),
    (8, 1, None, (1, 2, 4, 8)),
    (12, 1, None, (1, 2, 3, 4, 6, 12)),
    (7, 1, None, (1, 7)),
    (12, 3, None, (3, 4, 6, 12)),
    (12, 5, None, (6, 12)),
    (12, 1, 5, (1, 2, 3, 4)),
    (12, 2, 6, (2, 3, 4, 6)),
    (12, 0, None, (1, 2, 3, 4, 6, 12)),
    (12, 1, 100, (1, 2, 3, 4, 6, 12)),
    (12, 7, 11, ()),
    (0, 1, None, ()),
]


@pytest.mark.parametrize(
    ("world_size", "at_least", "at_most", "expected"),
    COUNTS_CASES,
    ids=[f"W{w}-from{lo}-to{hi}" for w, lo, hi, _ in COUNTS_CASES],
)
def test_device_counts_allowed_are_the_divisors_within_bounds(world_size, at_least, at_most, expected):
    assert device_counts_allowed(world_size, at_least=at_least, at_most=at_most) == expected


CHECK_CASES = [
    # (world_size, devices, error or None)
    (4, 1, None),
    (4, 2, None),
    (4, 4, None),
    (4, 3, "3 devices do not divide the world size 4, so they cannot evenly run its 4 ranks: "
           "choose d among [1, 2, 4]"),
    (4, 8, "8 devices do not divide the world size 4"),
    (4, 0, "need at least one rank and one device"),
    (0, 1, "need at least one rank and one device"),
]


@pytest.mark.parametrize(
    ("world_size", "devices", "error"),
    CHECK_CASES,
    ids=[f"W{w}-on-{d}" for w, d, _ in CHECK_CASES],
)
def test_layout_check_accepts_divisors_and_names_the_choices_otherwise(world_size, devices, error):
    assert layout_fits(world_size, devices) is (error is None)
    if error is None:
        layout_check(world_size, devices)
        return
    with pytest.raises(LayoutError, match=re.escape(error)):
        layout_check(world_size, devices)


def test_a_layout_error_is_a_value_error_so_existing_handlers_catch_it():
    with pytest.raises(ValueError):
        layout_check(6, 4)


RANK_CASES = [
    # (world_size, devices, device of each rank)
    (4, 1, (0, 0, 0, 0)),
    (4, 2, (0, 0, 1, 1)),
    (4, 4, (0, 1, 2, 3)),
    (6, 3, (0, 0, 1, 1, 2, 2)),
    (6, 2, (0, 0, 0, 1, 1, 1)),
]


@pytest.mark.parametrize(
    ("world_size", "devices", "expected"),
    RANK_CASES,
    ids=[f"W{w}-on-{d}" for w, d, _ in RANK_CASES],
)
def test_ranks_go_in_contiguous_blocks(world_size, devices, expected):
    assert rank_devices(world_size, devices) == expected
    assert tuple(rank_device(r, world_size, devices) for r in range(world_size)) == expected


def test_rank_device_refuses_a_rank_outside_the_job():
    with pytest.raises(IndexError, match="rank 4 is not among the 4 ranks"):
        rank_device(4, 4, 2)
    with pytest.raises(LayoutError):
        rank_device(0, 4, 3)


def _spec_accepts(world_size: int, min_devices: int) -> bool:
    spec = {"name": "n", "tier": "basic", "accelerator_type": next(iter(ACCELERATOR_TYPES)), "world_size": world_size,
            "min_devices": min_devices, "entrypoint": "train.py"}
    try:
        job_spec_clean(spec)
    except ValidationError:
        return False
    return True


def _device_map_accepts(world_size: int, devices: int) -> bool:
    try:
        device_map(world_size=world_size, devices=devices, cores=[0])
    except ValueError:
        return False
    return True


def _rank_layout_accepts(world_size: int, devices: int) -> bool:
    try:
        rank_layout(range(devices), world_size)
    except ValueError:
        return False
    return True


@given(world_size=st.integers(min_value=1, max_value=64), min_devices=st.integers(min_value=1, max_value=64))
def test_every_former_copy_of_the_rule_agrees_with_the_layout_module(world_size, min_devices):
    """The scheduler snapshot, the scheduler's rank layout, the Job model, the submit check and
    the runtime's device map all say the same about W ranks on d devices."""
    allowed = device_counts_allowed(world_size, at_least=min_devices)
    assert allowed_counts(world_size, min_devices) == allowed[::-1]
    job = Job(world_size=world_size, min_devices=min_devices)
    assert job.allowed_device_counts() == list(allowed)
    if min_devices <= world_size:
        assert _spec_accepts(world_size, min_devices) is layout_fits(world_size, min_devices)
    devices = min_devices
    fits = layout_fits(world_size, devices)
    assert _rank_layout_accepts(world_size, devices) is fits
    assert _device_map_accepts(world_size, devices) is fits
    if fits:
        indices = rank_devices(world_size, devices)
        assert rank_layout(range(devices), world_size) == indices
        ranks = device_map(world_size=world_size, devices=devices, cores=[0])["ranks"]
        assert tuple(ranks[str(r)] for r in range(world_size)) == indices
