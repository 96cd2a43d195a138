"""The trainer's per-step stage timings: rollout busy time is the union of the groups' sampling intervals."""

import pytest

from services.trainer.dynamics import covered_seconds


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([], 0.0),
        ([(0.0, 2.0)], 2.0),
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlapping groups count once
        ([(5.0, 6.0), (0.0, 1.0)], 2.0),  # disjoint, in any order
        ([(0.0, 10.0), (2.0, 3.0), (4.0, 12.0)], 12.0),  # nested and chained
    ],
)
def test_covered_seconds(intervals, expected):
    assert covered_seconds(intervals) == pytest.approx(expected)
