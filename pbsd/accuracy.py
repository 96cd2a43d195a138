"""Accuracy of an evaluation: mean@k and pass@k per difficulty, and the paired change between two.

mean@k is the accuracy averaged over the k samples of each question, then over
questions (the paper reports mean@4). pass@k is the unbiased estimator of Chen et
al. (2021) from n = K samples with c correct::

    pass@k = 1 - C(n - c, k) / C(n, k)

Two evaluations of the same questions (before and after training, or two variants) are
compared per question: d_q = after_q - before_q, each the question's accuracy over its
samples. The change is mean(d), and its 95% interval the 2.5th and 97.5th percentiles of
mean(d) over questions resampled with replacement (a paired bootstrap: it keeps what a
question's difficulty shares between the two, which a comparison of two unpaired means
would count as noise).

Pure functions of plain data, no I/O: the rollout's ``pbsd eval``, the trainer's validation
rounds and the demo all count the same way.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from math import comb
from typing import Any

import numpy as np

__all__ = [
    "NotComparable",
    "accuracy_interval",
    "check_comparable",
    "compare",
    "describe_change",
    "pass_at_k",
    "signed",
    "summarise",
]


class NotComparable(ValueError):
    """An evaluation that cannot be compared question by question with another."""


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarise(
    results: dict[str, list[bool]], difficulty: dict[str, str | None], samples: int
) -> dict[str, Any]:
    """``results``: question id -> correctness of each of its samples."""
    groups: dict[str, list[str]] = defaultdict(list)
    for qid in results:
        groups["all"].append(qid)
        if difficulty.get(qid):
            groups[str(difficulty[qid])].append(qid)
    out = {}
    for name, qids in sorted(groups.items()):
        out[name] = {
            "questions": len(qids),
            f"mean@{samples}": statistics.fmean(sum(results[q]) / samples for q in qids),
            "pass@k": {
                str(k): statistics.fmean(pass_at_k(samples, sum(results[q]), k) for q in qids)
                for k in range(1, samples + 1)
            },
        }
    return out


def compare(
    before: Mapping[str, Any], after: Mapping[str, Any], *, resamples: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """The change from ``before`` to ``after``, two reports of :func:`evaluate` on the same
    questions: mean accuracy difference, its paired-bootstrap 95% interval, and how many
    questions got better or worse."""
    check_comparable(before, after["per_question"])
    ids = list(before["per_question"])

    def accuracy(report: Mapping[str, Any]) -> np.ndarray:
        return np.array([np.mean(report["per_question"][q]["correct"]) for q in ids], dtype=float)

    d = accuracy(after) - accuracy(before)
    return {
        "questions": len(d),
        "difference": float(d.mean()),
        "ci95": _bootstrap95(d, resamples, seed),
        "better": int((d > 0).sum()),
        "worse": int((d < 0).sum()),
    }


def accuracy_interval(report: Mapping[str, Any], *, resamples: int = 10_000, seed: int = 0) -> list[float]:
    """The 95% interval of one report's mean accuracy (mean@k): the 2.5th and 97.5th percentiles
    of the mean over its questions resampled with replacement, each question's accuracy over its
    samples. It says how far the figure could move on other questions like these; whether two
    reports differ is :func:`compare`'s paired interval."""
    per_question = report["per_question"]
    return _bootstrap95(np.array([np.mean(r["correct"]) for r in per_question.values()]), resamples, seed)


def _bootstrap95(values: np.ndarray, resamples: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    return [float(x) for x in np.percentile(means, [2.5, 97.5])]


def check_comparable(before: Any, questions: Iterable[str]) -> None:
    """Raise :class:`NotComparable` unless ``before`` is a report of :func:`evaluate` of exactly
    the question ids ``questions``: the rule :func:`compare` holds two reports to, checked on its
    own so that an evaluation can be refused before it runs."""
    per_question = before.get("per_question") if isinstance(before, Mapping) else None
    if not isinstance(per_question, Mapping) or not all(
        isinstance(r, Mapping) and isinstance(r.get("correct"), list) and r["correct"]
        for r in per_question.values()
    ):
        raise NotComparable("not a report of an evaluation: it has no per-question results")
    theirs, ours = set(per_question), set(questions)
    if theirs != ours or not ours:
        raise NotComparable(
            f"compare needs two evaluations of the same (non-empty) set of questions: {len(ours - theirs)} "
            f"of the {len(ours)} evaluated here are not among its {len(theirs)}, and {len(theirs - ours)} "
            "of its are not evaluated here"
        )


def signed(x: float) -> str:
    """``x`` to 3 decimals with its sign, "+0.000" for what rounds to 0 (never "-0.000")."""
    return f"{round(x, 3) + 0.0:+.3f}"


def describe_change(change: Mapping[str, Any]) -> str:
    """One line: "+0.021 (95% CI -0.042 to +0.083; 3 questions better, 2 worse)"."""
    low, high = change["ci95"]
    better = change["better"]
    return (
        f"{signed(change['difference'])} (95% CI {signed(low)} to {signed(high)}; "
        f"{better} question{'' if better == 1 else 's'} better, {change['worse']} worse)"
    )
