"""What a teacher that reads x* shows in its sanity figures, as checks a policy can pass or fail.

The figures (:class:`proto.sanity.TeacherSanity`, ``figures()``) come from the scorer; these are
the marks ``pbsd teacher check`` and the demo report hold them to (docs/credit-signal.md):

- answer-free turns: |mean s| inside the deadband, ``-eps- <= mean <= eps+``, so that turns that
  say nothing about the answer keep weight 1 on average instead of a global rescaling;
- correct final answers: at least ``min_fraction`` (0.9) with s > eps+;
- wrong final answers: at least ``min_fraction`` with s < -eps-;
- actions: for each kind of action (search, read, answer) that has both, the grounded ones (taken
  from what the agent read) with a higher mean s than the made-up ones. Kind by kind, because
  the kinds differ in evidence and in how often they are made up: pooled, a policy that makes up
  more searches than reads would look as if made-up actions were disfavoured.

A check whose figure has no turns behind it is neither met nor failed (``met`` None).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ACTION_KINDS", "MIN_FRACTION", "checks", "grounded_gaps"]

MIN_FRACTION = 0.9
ACTION_KINDS = ("queries", "reads", "answers")


def grounded_gaps(figures: dict[str, float]) -> dict[str, float]:
    """Per kind of action with both: mean s of the grounded ones minus that of the made-up ones."""
    return {
        kind: figures[f"evidence_{kind}_grounded_mean_s"] - figures[f"evidence_{kind}_made_up_mean_s"]
        for kind in ACTION_KINDS
        if f"evidence_{kind}_grounded_mean_s" in figures and f"evidence_{kind}_made_up_mean_s" in figures
    }


def checks(
    figures: dict[str, float], *, eps_pos: float, eps_neg: float, min_fraction: float = MIN_FRACTION
) -> list[dict[str, Any]]:
    """One entry per mark: the figure's name, the target in words, its value and whether it is met."""

    def mark(figure: str, target: str, value: float | None, test) -> dict[str, Any]:
        return {
            "figure": figure,
            "target": target,
            "value": value,
            "met": None if value is None else test(value),
        }

    free = figures.get("answer_free_mean_s")
    gaps = grounded_gaps(figures).values()
    return [
        mark(
            "answer_free_mean_s", f"in [-{eps_neg:g}, {eps_pos:g}]", free, lambda v: -eps_neg <= v <= eps_pos
        ),
        mark(
            "correct_final_favoured_frac",
            f">= {min_fraction:g}",
            figures.get("correct_final_favoured_frac"),
            lambda v: v >= min_fraction,
        ),
        mark(
            "wrong_final_disfavoured_frac",
            f">= {min_fraction:g}",
            figures.get("wrong_final_disfavoured_frac"),
            lambda v: v >= min_fraction,
        ),
        mark(
            "grounded_minus_made_up_mean_s", "> 0 for every action", min(gaps, default=None), lambda v: v > 0
        ),
    ]
