"""The running totals per segment that the preemption plugin ranks places and regions by."""
import numpy as np
import pytest

from scheduler.plugins.preemption import _cumsum_by_segment, _segment_starts

CASES = [
    # (keys, values, segment starts, running totals restarted per segment)
    ([7], [5], [0], [5]),
    ([1, 1, 1], [1, 2, 3], [0, 0, 0], [1, 3, 6]),
    ([0, 0, 3, 3, 3, 9], [1, 1, 1, 1, 1, 1], [0, 0, 2, 2, 2, 5], [1, 2, 1, 2, 3, 1]),
    ([2, 4, 4], [0.5, 1.5, 2.0], [0, 1, 1], [0.5, 1.5, 3.5]),
]


@pytest.mark.parametrize(("keys", "values", "starts", "totals"), CASES,
                         ids=["one-row", "one-segment", "three-segments", "floats"])
def test_running_totals_restart_at_each_segment(keys, values, starts, totals):
    start = _segment_starts(np.array(keys))
    assert start.tolist() == starts
    assert _cumsum_by_segment(np.array(values), start).tolist() == pytest.approx(totals)


def test_they_match_a_loop_over_segments():
    rng = np.random.default_rng(7)
    keys = np.sort(rng.integers(0, 6, 200))
    values = rng.integers(0, 9, 200)
    expected = [int(values[(keys == keys[i]) & (np.arange(200) <= i)].sum()) for i in range(200)]
    assert _cumsum_by_segment(values, _segment_starts(keys)).tolist() == expected
