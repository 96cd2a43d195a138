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


def test_a_skipped_update_is_counted_for_prometheus():
    """An update skipped because the gradient was not finite was only in the step's record: a
    run that skipped every update looked healthy on the dashboards."""
    from prometheus_client import REGISTRY

    from services.trainer.metrics import export_step

    def count() -> float:
        return REGISTRY.get_sample_value("pbsd_trainer_skipped_updates_total")

    before = count()
    export_step({"step": 1.0, "step_s": 1.0, "skipped_update": 0.0})
    export_step({"step": 2.0, "step_s": 1.0})  # a record from before the key existed
    assert count() == before
    export_step({"step": 3.0, "step_s": 1.0, "skipped_update": 1.0})
    assert count() == before + 1
