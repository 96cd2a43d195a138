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


def test_batch_metrics_by_hand(tiny_checkpoint):
    """Accuracy over the trajectories that did not fail; staleness against the trainer's version;
    the filtered fraction weighted by each group's scored turns."""
    import numpy as np

    from agent.chat import ChatTokenizer
    from proto.messages import ScoreDiagnostics
    from proto.runs import PbsdSpec
    from services.trainer.dynamics import batch_metrics
    from tests.test_scorer import _group
    from tests.test_trainer_policy import _scored

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    g1 = _group(tok, PbsdSpec(), rewards=(1.0, 0.0, 0.0), finishes=["answer", "answer", "error"])
    g2 = _group(tok, PbsdSpec(), rewards=(1.0, 1.0, 0.0))
    evidence = np.zeros(0, np.float32)
    one = ScoreDiagnostics(turns=6, scored_turns=1, filtered_frac=1.0, evidence=evidence)
    three = ScoreDiagnostics(turns=6, scored_turns=3, filtered_frac=0.0, evidence=evidence)
    s1 = _scored(g1).model_copy(update={"diagnostics": one})
    s2 = _scored(g2).model_copy(update={"diagnostics": three})
    out = batch_metrics([s1, s2], version=2)
    assert out["accuracy"] == pytest.approx(3 / 5)  # the failed one left out
    assert out["staleness_mean"] == pytest.approx(2.0)  # sampled at version 0, trained at 2
    assert out["filtered_frac"] == pytest.approx(0.25)  # 1 of 4 scored turns
