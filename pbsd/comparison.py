r"""Comparing training variants run several times each: mean@k with two-level paired-bootstrap intervals.

A comparison trains R_v runs (seeds) of each variant v from the same warm policy and evaluates
every final policy on the same Q held-out questions with the same sampling seeds. Per variant
its data is a matrix a_v of shape (R_v, Q): a_v[r, q] is run r's accuracy on question q over
its k samples. The variant's figure is mean@k over runs and questions::

    m_v = 1 / (R_v Q) * sum_r sum_q a_v[r, q]

Two things stand between m_v and what a repetition of the comparison would measure: which
questions were drawn, and how the runs went (their seeds decide the sampled trajectories and
the data order). Run-to-run variance is usually the larger part, and a bootstrap over questions
alone would leave it out. So each resample b draws both levels with replacement::

    Q_b      Q question indices: the same for every variant and for the warm policy (paired)
    R_b      R run indices, the same for every variant run with the same seeds (paired by seed)
    m_{v,b} = 1 / (R_v Q) * sum_{i in R_b} sum_{j in Q_b} a_v[i, j]

and the 95% interval is the 2.5th and 97.5th percentiles of m_{v,b} over the resamples
(percentile bootstrap, ``np.percentile``'s linear interpolation). A difference against a
baseline variant, m_{v,b} - m_{base,b}, and a variant's change from the warm policy, whose one
evaluation w (a vector over the same questions) gives w_b = 1/Q * sum_{j in Q_b} w[j], are
taken within each resample, so what a question's difficulty adds to both cancels, and so does
what a seed adds to both runs of that seed.

Pairing by seed follows the design: run s of every variant starts from the same warm policy
with the same sampling seeds, so the variants' first batches are the same trajectories and
later ones differ only as far as the policies have moved apart (common random numbers). Two
variants are paired by seed when they were run with the same list of seeds (rows in that
order); a variant with other seeds gets run draws of its own, and its differences are paired
by question only (``paired_by_seed`` says which). Pairing two independent sets of runs would
not bias the interval either: resampling pairs of independent runs gives the difference the
variance independent resampling gives it.

Reproducible: the question draws come from ``np.random.default_rng(seed)``
(``integers(0, Q, (resamples, Q))``), the run draws of a variant run with seeds ``s_1..s_R``
from ``np.random.default_rng([seed, zlib.crc32(repr([s_1, ..., s_R]).encode())])``
(``integers(0, R, (resamples, R))``), so a variant's figures do not depend on which other
variants are compared.

Each run's own figure (its mean over questions, with the interval of the question level alone)
is reported too.

With few runs the two-level bootstrap is too narrow (a resample of 3 runs repeats one in nine
times) or too wide, depending on how much the seeds differ. So a difference paired by seed also
carries the Student t interval over the per-seed differences d_s = mean_q a_v[s] - mean_q a_base[s],
d_bar +- t_{0.975, R-1} sd(d) / sqrt(R): it holds the questions fixed and takes the seeds as
the only sampling, the reading docs/compare.md gives beside the bootstrap's. A change from the
warm policy carries the same over the runs' changes.

Differences below 1e-9 are ties: the sums that give two resamples' means are rounded apart when
k is not a power of two, and a tie must not count as above 0. Pure functions of arrays, no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["DEFAULT_RESAMPLES", "compare_variants", "resample_counts", "t975", "t_interval"]

DEFAULT_RESAMPLES = 10_000
TIE = 1e-9  # far below any real difference of means: at least 1 / (k Q R)

# Student t's 97.5th percentile by degrees of freedom (1..30); past 30, Cornish-Fisher's expansion
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(df: int) -> float:
    """The 97.5th percentile of Student's t with ``df`` degrees of freedom (to 3 decimals)."""
    if df < 1:
        raise ValueError("a t interval needs at least 2 values")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float]) -> dict[str, Any]:
    """The mean of ``values`` (per-seed differences) with its Student t 95% interval."""
    d = np.asarray(values, dtype=float)
    half = t975(d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
    return {
        "mean": float(d.mean()),
        "ci95": [float(d.mean() - half), float(d.mean() + half)],
        "values": d.tolist(),
    }


def resample_counts(draws: np.ndarray, n: int) -> np.ndarray:
    """``draws`` (resamples, m) of indices in [0, n) as counts (resamples, n): how often each index was drawn."""
    b = draws.shape[0]
    flat = (draws + n * np.arange(b)[:, None]).ravel()
    return np.bincount(flat, minlength=b * n).reshape(b, n)


def _interval(samples: np.ndarray) -> list[float]:
    low, high = np.percentile(samples, [2.5, 97.5])
    return [float(low), float(high)]


def _matrix(name: str, values: Any) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{name}: expected a non-empty (runs, questions) matrix, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: accuracies must be finite")
    return a


def compare_variants(
    accuracy: Mapping[str, Any],
    *,
    seeds: Mapping[str, Sequence[int]] | None = None,
    baseline: str | None = None,
    before: Any = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """Mean@k of each variant (``accuracy``: name -> (runs, questions) matrix of per-question
    accuracy, every variant on the same questions in the same order; ``seeds``: name -> the seed
    of each row, default 0..R-1) with its two-level bootstrap 95% interval; with ``baseline`` (one of the names) each other variant's difference
    from it; with ``before`` (the warm policy's per-question accuracy) each variant's change
    from it. ``above_zero`` is the fraction of resamples in which a difference or change is
    positive: a description of the bootstrap distribution, not a p-value."""
    if resamples < 1:
        raise ValueError("resamples must be at least 1")
    matrices = {name: _matrix(name, values) for name, values in accuracy.items()}
    if not matrices:
        raise ValueError("no variants to compare")
    sizes = {a.shape[1] for a in matrices.values()}
    if len(sizes) != 1:
        raise ValueError(
            f"every variant must be evaluated on the same questions, got {sorted(sizes)} of them"
        )
    (q,) = sizes
    run_seeds = {name: list(range(a.shape[0])) for name, a in matrices.items()} | {
        name: [int(x) for x in v] for name, v in (seeds or {}).items()
    }
    for name, a in matrices.items():
        if len(run_seeds[name]) != a.shape[0] or len(set(run_seeds[name])) != a.shape[0]:
            raise ValueError(f"{name}: {a.shape[0]} runs need as many distinct seeds, got {run_seeds[name]}")
    if baseline is not None and baseline not in matrices:
        raise ValueError(f"baseline {baseline!r} is not among the variants {sorted(matrices)}")
    # counts, divided once after the sums: two resamples whose totals are equal have equal means
    question_counts = resample_counts(np.random.default_rng(seed).integers(0, q, (resamples, q)), q)

    def paired(samples: np.ndarray, reference: np.ndarray, point: float) -> dict[str, Any]:
        d = samples - reference
        d[np.abs(d) < TIE] = 0.0
        return {"mean": point, "ci95": _interval(d), "above_zero": float((d > 0).mean())}

    out: dict[str, Any] = {"questions": q, "resamples": resamples, "seed": seed, "variants": {}}
    before_b = None
    if before is not None:
        w = np.asarray(before, dtype=float)
        if w.shape != (q,) or not np.isfinite(w).all():
            raise ValueError(f"before: expected {q} finite per-question accuracies, got shape {w.shape}")
        before_b = question_counts @ w / q
        out["before"] = {"mean": float(w.mean()), "ci95": _interval(before_b)}
    samples: dict[str, np.ndarray] = {}
    for name, a in matrices.items():
        runs = a.shape[0]
        rng = np.random.default_rng([seed, zlib.crc32(repr(run_seeds[name]).encode())])
        run_counts = resample_counts(rng.integers(0, runs, (resamples, runs)), runs)
        totals = question_counts @ a.T  # (resamples, runs): each run's sum over the resampled questions
        per_run_b = totals / q
        # one division after every sum: equal totals give equal means, so a tie is not counted above 0
        samples[name] = (totals * run_counts).sum(axis=1) / (q * runs)
        out["variants"][name] = {
            "runs": runs,
            "seeds": run_seeds[name],
            "mean": float(a.mean()),
            "ci95": _interval(samples[name]),
            "per_run": [
                {"mean": float(a[r].mean()), "ci95": _interval(per_run_b[:, r])} for r in range(runs)
            ],
        }
        if before_b is not None:
            change = paired(samples[name], before_b, float(a.mean() - w.mean()))
            if runs > 1:  # over the runs, the questions held fixed
                change["over_seeds"] = t_interval(a.mean(axis=1) - w.mean())
            out["variants"][name]["change"] = change
    if baseline is not None:
        base = matrices[baseline].mean()
        for name, a in matrices.items():
            if name != baseline:
                by_seed = run_seeds[name] == run_seeds[baseline]
                difference = {
                    "against": baseline,
                    **paired(samples[name], samples[baseline], float(a.mean() - base)),
                    "paired_by_seed": by_seed,
                }
                if by_seed and a.shape[0] > 1:
                    difference["over_seeds"] = t_interval(a.mean(axis=1) - matrices[baseline].mean(axis=1))
                out["variants"][name]["difference"] = difference
    return out
