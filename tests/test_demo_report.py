"""The demo's report and its figures, from made-up metrics and evaluations (no run needed)."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.container import BarContainer

from demo.config import ASSETS, DemoConfig
from demo.figures import before_after_chart, charts, reward_chart
from demo.report import eval_set, write_report
from pbsd.accuracy import accuracy_interval, compare
from services.trainer.viewer import load_metrics


def _metrics(steps: int, reward=lambda acc: acc) -> dict[str, list[dict[str, float]]]:
    rows = []
    for step in range(1, steps + 1):
        acc = (step % 4) / 32
        rows.append(
            {
                "step": float(step),
                "accuracy": acc,
                "reward_mean": reward(acc),
                "turns_mean": 6.0 - step / 10,
                "tokens_mean": 3000.0,
                "generated_tokens_mean": 600.0,
                "teacher_higher_frac": 0.25,
                "mean_abs_gap": 0.02,
                "grounded_queries_frac": 0.9,
                "grounded_reads_frac": 0.95,
                "grounded_answers_frac": 0.8,
            }
        )
    return {"pbsd": rows}


def _evaluation(correct: list[bool], before: dict | None = None) -> dict:
    report = {
        "questions": len(correct),
        "samples": 1,
        "accuracy": {"all": {"mean@1": float(np.mean(correct)), "pass@k": {"1": float(np.mean(correct))}}},
        "per_question": {f"q{i}": {"correct": [c]} for i, c in enumerate(correct)},
        "mean_turns": 6.0,
        "mean_generated_tokens": 500.0,
        "finish_reasons": {"answer": len(correct)},
        "grounding": {
            k: {"total": 4, "grounded": 3, "fraction": 0.75} for k in ("queries", "reads", "answers")
        },
    }
    if before is not None:
        report["change"] = compare(before, report)
    return report


def _integers(ticks) -> bool:
    return all(float(t).is_integer() for t in ticks)


def test_binary_rewards_are_one_series_and_steps_have_integer_ticks():
    chart = reward_chart(_metrics(16), batch=32)
    (ax,) = chart.figure.axes
    assert [line.get_label() for line in ax.get_lines()] == ["PBSD"]
    assert "also the mean reward" in chart.caption and "32 trajectories" in chart.caption
    chart.figure.canvas.draw()
    assert _integers(ax.get_xticks()) and len(ax.get_xticks()) > 3

    partial = reward_chart(_metrics(16, reward=lambda acc: acc + 0.1), batch=32)
    (ax,) = partial.figure.axes
    assert [line.get_label() for line in ax.get_lines()] == ["PBSD mean reward", "PBSD accuracy"]
    assert "between 0 and 1" in partial.caption


def test_every_step_axis_has_integer_ticks_and_every_figure_a_caption():
    evals = {"before": _evaluation([True] * 2 + [False] * 46)}
    made = charts(_metrics(16), np.linspace(-0.05, 0.05, 200), (0.001, 0.003), evals, samples=1, batch=32)
    assert [c.name for c in made] == [
        "reward_accuracy",
        "grounding",
        "turns_tokens",
        "credit_signal",
        "evidence",
        "before_after",
    ]
    for chart in made:
        chart.figure.canvas.draw()
        assert len(chart.caption.split()) >= 12  # a sentence that says what it shows, not a name
        for ax in chart.figure.axes:
            if ax.get_xlabel() == "training step":
                assert _integers(ax.get_xticks()), chart.name
    (hist,) = next(c for c in made if c.name == "evidence").figure.axes
    assert _integers(hist.get_yticks())  # counts of turns


def test_before_and_after_bars_carry_their_interval_and_the_paired_change():
    before = _evaluation([True] * 2 + [False] * 46)
    after = _evaluation([True] * 4 + [False] * 44, before)
    chart = before_after_chart({"before": before, "after-pbsd": after}, 1)
    (ax,) = chart.figure.axes
    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [b.get_height() for b in bars] == pytest.approx([2 / 48, 4 / 48])
    (segments,) = bars.errorbar.lines[2]
    spans = np.array([seg[:, 1] for seg in segments.get_segments()])
    np.testing.assert_allclose(spans, [accuracy_interval(r) for r in (before, after)], atol=1e-12)
    assert spans[0][0] == 0.0  # 2 of 48: an interval that reaches 0
    assert "95% interval" in chart.caption and "after-pbsd: +0.042 (95% CI " in chart.caption


def test_the_report_renders_its_figures_with_captions(tmp_path):
    (tmp_path / "policy-sft").symlink_to(ASSETS)  # its tokenizer
    before = _evaluation([True] + [False] * 3)
    evals = {"before": before, "after-pbsd": _evaluation([True, True, False, False], before)}
    config = DemoConfig(eval_questions=4, eval_samples=1)
    page = write_report(tmp_path, config, {}, evals, elapsed=60.0).read_text()
    assert page.count("<figcaption>") == page.count("<img") >= 3
    assert "1 sample each" in page and "1 samples" not in page
    assert "4 easy questions set aside" in page
    assert (tmp_path / "figures" / "before_after.png").stat().st_size > 1000


def test_the_evaluation_is_described_in_whole_words():
    assert "1 easy question set aside" in eval_set(DemoConfig(), 1)
    validation = eval_set(DemoConfig(eval_split="validation", eval_samples=2), 7)
    assert (
        validation.startswith("7 easy+medium questions of the world's validation split")
        and "2 samples" in validation
    )


def test_a_runs_metrics_are_its_steps_in_order_and_none_before_the_first(tmp_path):
    assert load_metrics(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1.0, "loss": 0.5}\n{"step": 2.0, "loss": 0.25}\n')
    assert load_metrics(tmp_path) == [{"step": 1.0, "loss": 0.5}, {"step": 2.0, "loss": 0.25}]
