"""The comparison's statistics (pbsd/comparison.py): hand-worked numbers, invariants, and a slow
reference implementation of the two-level bootstrap."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pbsd.comparison import compare_variants, resample_counts


def test_point_figures_worked_by_hand():
    grpo = [[1.0, 0.5, 0.0], [0.0, 0.5, 0.0]]  # mean 2/6; runs 0.5 and 1/6
    pbsd = [[1.0, 1.0, 0.5]]  # mean 2.5/3
    before = [0.5, 0.0, 0.0]  # mean 1/6
    out = compare_variants({"grpo": grpo, "pbsd": pbsd}, baseline="grpo", before=before, resamples=200)
    g, p = out["variants"]["grpo"], out["variants"]["pbsd"]
    assert out["questions"] == 3 and g["runs"] == 2 and p["runs"] == 1
    assert g["mean"] == pytest.approx(1 / 3) and p["mean"] == pytest.approx(5 / 6)
    assert [r["mean"] for r in g["per_run"]] == pytest.approx([0.5, 1 / 6])
    assert p["difference"]["against"] == "grpo" and p["difference"]["mean"] == pytest.approx(5 / 6 - 1 / 3)
    assert "difference" not in g
    assert out["before"]["mean"] == pytest.approx(1 / 6)
    assert g["change"]["mean"] == pytest.approx(1 / 3 - 1 / 6)
    assert p["change"]["mean"] == pytest.approx(5 / 6 - 1 / 6)


def test_two_questions_one_run_give_the_extremes():
    """One run, questions a=1 and b=0: the resampled mean is 1, 1/2 or 0 with probabilities 1/4,
    1/2, 1/4, so the 2.5th and 97.5th percentiles are 0 and 1."""
    out = compare_variants({"v": [[1.0, 0.0]]})
    assert out["variants"]["v"]["ci95"] == [0.0, 1.0]


def test_two_runs_and_two_questions_match_the_exact_bootstrap_distribution():
    """Run 0 answers question 0, nothing else is correct: a resample's mean is (run 0 drawn
    i times of 2) / 2 * (question 0 drawn j times of 2) / 2, i and j independent Binomial(2, 1/2).
    By hand: P(0) = 1 - (3/4)^2 = 7/16, P(1/4) = 1/4, P(1/2) = 1/4, P(1) = 1/16; mean 1/4,
    E[m^2] = (3/8)^2 = 9/64, so the standard deviation is sqrt(5/64)."""
    a = np.array([[1.0, 0.0], [0.0, 0.0]])
    out = compare_variants({"v": a}, resamples=10_000, seed=3)
    assert out["variants"]["v"]["mean"] == 0.25
    assert out["variants"]["v"]["ci95"] == [0.0, 1.0]  # 7/16 of the mass at 0, 1/16 at 1
    samples = _slow_bootstrap(a, [0, 1], 10_000, seed=3)
    assert samples.mean() == pytest.approx(0.25, abs=0.01)
    assert samples.std() == pytest.approx(np.sqrt(5 / 64), abs=0.01)
    values, counts = np.unique(samples, return_counts=True)
    assert values.tolist() == [0.0, 0.25, 0.5, 1.0]
    assert (counts / counts.sum()) == pytest.approx([7 / 16, 1 / 4, 1 / 4, 1 / 16], abs=0.015)


def _slow_bootstrap(a: np.ndarray, seeds: list[int], resamples: int, seed: int) -> np.ndarray:
    """The two-level bootstrap written out one resample at a time, with the documented draws."""
    runs, q = a.shape
    questions = np.random.default_rng(seed).integers(0, q, (resamples, q))
    rng = np.random.default_rng([seed, zlib.crc32(repr(seeds).encode())])
    picked = rng.integers(0, runs, (resamples, runs))
    return np.array([a[np.ix_(picked[b], questions[b])].mean() for b in range(resamples)])


def test_the_fast_bootstrap_equals_the_slow_reference():
    rng = np.random.default_rng(0)
    grpo = rng.random((3, 7))
    pbsd = rng.random((2, 7))
    before = rng.random(7)
    out = compare_variants(
        {"grpo": grpo, "pbsd": pbsd}, baseline="grpo", before=before, resamples=500, seed=11
    )
    slow_g = _slow_bootstrap(grpo, [0, 1, 2], 500, 11)
    slow_p = _slow_bootstrap(pbsd, [0, 1], 500, 11)
    questions = np.random.default_rng(11).integers(0, 7, (500, 7))
    slow_before = before[questions].mean(axis=1)

    def pct(x):
        return np.percentile(x, [2.5, 97.5]).tolist()

    assert out["variants"]["grpo"]["ci95"] == pytest.approx(pct(slow_g))
    assert out["variants"]["pbsd"]["ci95"] == pytest.approx(pct(slow_p))
    assert out["variants"]["pbsd"]["difference"]["ci95"] == pytest.approx(pct(slow_p - slow_g))
    assert out["variants"]["pbsd"]["difference"]["above_zero"] == pytest.approx((slow_p > slow_g).mean())
    assert out["variants"]["grpo"]["change"]["ci95"] == pytest.approx(pct(slow_g - slow_before))
    assert out["before"]["ci95"] == pytest.approx(pct(slow_before))
    # each run's own interval: its questions resampled, the same draws
    assert out["variants"]["grpo"]["per_run"][1]["ci95"] == pytest.approx(
        pct(grpo[1][questions].mean(axis=1))
    )


def test_run_to_run_variance_widens_the_interval_that_questions_alone_would_not():
    """Two runs, one right on all 50 questions and one wrong on all: each run's own interval is a
    point, but the variant's spans 0 to 1 (which run comes out is the uncertainty)."""
    a = np.vstack([np.ones(50), np.zeros(50)])
    v = compare_variants({"v": a})["variants"]["v"]
    assert [r["ci95"] for r in v["per_run"]] == [[1.0, 1.0], [0.0, 0.0]]
    assert v["mean"] == 0.5 and v["ci95"] == [0.0, 1.0]


def test_a_variant_whose_runs_agree_differs_from_its_shifted_twin_by_exactly_the_shift():
    """Paired questions: the same questions shift both means alike, so the difference of a matrix
    and the matrix plus 0.1 (runs identical, so their draws do not matter) is 0.1 in every resample."""
    row = np.random.default_rng(1).random(20) * 0.8
    out = compare_variants({"grpo": [row, row], "pbsd": [row + 0.1] * 3}, baseline="grpo")
    diff = out["variants"]["pbsd"]["difference"]
    assert diff["mean"] == pytest.approx(0.1)
    assert diff["ci95"] == pytest.approx([0.1, 0.1]) and diff["above_zero"] == 1.0
    assert out["variants"]["grpo"]["ci95"][0] < out["variants"]["grpo"]["ci95"][1]  # questions vary


def test_runs_of_the_same_seeds_are_paired():
    """Seed s lifts both variants alike (what a seed adds cancels) and PBSD adds 0.1 to every run:
    paired by seed, the difference is 0.1 in every resample; with other seeds for PBSD its runs
    are drawn on their own and the seeds' spread enters the difference."""
    rng = np.random.default_rng(4)
    questions = rng.random(30) * 0.5
    lift = np.array([0.0, 0.3, 0.45])[:, None]
    grpo, pbsd = questions + lift, questions + lift + 0.1
    paired = compare_variants({"grpo": grpo, "pbsd": pbsd}, baseline="grpo")["variants"]["pbsd"]
    assert paired["difference"]["paired_by_seed"] and paired["seeds"] == [0, 1, 2]
    assert paired["difference"]["ci95"] == pytest.approx([0.1, 0.1])
    apart = compare_variants({"grpo": grpo, "pbsd": pbsd}, seeds={"pbsd": [3, 4, 5]}, baseline="grpo")[
        "variants"
    ]["pbsd"]["difference"]
    assert not apart["paired_by_seed"] and apart["mean"] == pytest.approx(0.1)
    assert apart["ci95"][0] < 0 < 0.2 < apart["ci95"][1]


def test_seeded_and_independent_of_the_other_variants():
    rng = np.random.default_rng(2)
    a, b = rng.random((3, 9)), rng.random((3, 9))
    alone = compare_variants({"a": a}, seed=5)
    both = compare_variants({"b": b, "a": a}, seed=5)
    assert alone["variants"]["a"] == both["variants"]["a"]
    assert compare_variants({"a": a}, seed=6)["variants"]["a"]["ci95"] != alone["variants"]["a"]["ci95"]


def test_a_resample_where_the_variants_tie_is_not_counted_above_zero():
    """Three seeds whose gains and losses net to nothing: the share of resamples above 0 is the exact
    count's. Dividing each run's mean before the sum over runs made some ties differ by one rounding
    unit, counted above 0 (0.4086 here, against 0.3964)."""
    runs, q, resamples = 3, 48, 10_000
    a = (np.random.default_rng(1).random((runs, q)) < 0.1).astype(float)
    b = a.copy()
    for run, gained, lost in ((0, 0, None), (1, None, 1), (2, 2, 3)):
        if gained is not None:
            a[run, gained], b[run, gained] = 0, 1
        if lost is not None:
            a[run, lost], b[run, lost] = 1, 0
    questions = resample_counts(np.random.default_rng(0).integers(0, q, (resamples, q)), q)
    seeds = np.random.default_rng([0, zlib.crc32(repr(list(range(runs))).encode())])
    seed_counts = resample_counts(seeds.integers(0, runs, (resamples, runs)), runs)
    exact = ((questions @ (b - a).T.astype(np.int64)) * seed_counts).sum(axis=1)
    out = compare_variants({"g": a, "p": b}, baseline="g", resamples=resamples)
    assert out["variants"]["p"]["difference"]["above_zero"] == (exact > 0).mean()
    assert (exact == 0).mean() > 0.1  # ties are common here: the case this is about


def test_resample_counts():
    counts = resample_counts(np.array([[0, 0, 2], [1, 2, 1]]), 4)
    assert counts.tolist() == [[2, 0, 1, 0], [0, 2, 1, 0]]


@pytest.mark.parametrize(
    ("accuracy", "kwargs", "message"),
    [
        ({"a": [[1.0, 0.0]], "b": [[1.0]]}, {}, "same questions"),
        ({"a": [[1.0, 0.0]]}, {"baseline": "grpo"}, "baseline 'grpo'"),
        ({"a": [[1.0, 0.0]]}, {"before": [1.0]}, "before"),
        ({"a": [[]]}, {}, "non-empty"),
        ({"a": [[float("nan")]]}, {}, "finite"),
        ({}, {}, "no variants"),
        ({"a": [[1.0], [0.0]]}, {"seeds": {"a": [1, 1]}}, "distinct seeds"),
    ],
)
def test_bad_input_is_refused(accuracy, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare_variants(accuracy, **kwargs)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_a_variant_equal_to_the_warm_policy_or_the_baseline_is_never_above_zero(k):
    """With k samples a question accuracies are multiples of 1/k; for k = 3 or 5 the warm policy's
    mean and a variant's, summed in other orders, were rounded apart, and an unchanged variant
    showed a third of its resamples above 0 (a 4-run twin of a 3-run baseline a fifth)."""
    rng = np.random.default_rng(k)
    before = rng.integers(0, k + 1, 40) / k
    same = np.tile(before, (3, 1))
    out = compare_variants(
        {"base": same, "twin": np.tile(before, (4, 1)), "same": same},
        baseline="base",
        before=before,
        seeds={"twin": [0, 1, 2, 3]},
        resamples=2_000,
    )
    for name in ("base", "twin", "same"):
        change = out["variants"][name]["change"]
        assert change["above_zero"] == 0 and change["ci95"] == [0.0, 0.0], (name, change)
    for name in ("twin", "same"):
        assert out["variants"][name]["difference"]["above_zero"] == 0


def test_a_difference_paired_by_seed_carries_the_t_interval_over_its_seeds():
    """The per-seed differences of the benchmarks' first comparison (+0.063, +0.028, +0.020): the
    bootstrap gave +0.003 to +0.070, the t interval over three seeds -0.020 to +0.094."""
    q = 1000
    base = np.zeros((3, q))
    pbsd = np.zeros((3, q))
    for run, d in enumerate((0.063, 0.028, 0.020)):
        pbsd[run, : round(d * q)] = 1.0
    out = compare_variants({"grpo": base, "pbsd": pbsd}, baseline="grpo", before=np.zeros(q), resamples=200)
    over = out["variants"]["pbsd"]["difference"]["over_seeds"]
    assert over["values"] == pytest.approx([0.063, 0.028, 0.020])
    assert over["mean"] == pytest.approx(0.037) and over["ci95"] == pytest.approx([-0.0198, 0.0938], abs=1e-4)
    assert out["variants"]["pbsd"]["change"]["over_seeds"]["mean"] == pytest.approx(0.037)
    # a variant run with other seeds is not paired with the baseline's: no t interval over seeds
    other = compare_variants(
        {"grpo": base, "pbsd": pbsd}, baseline="grpo", seeds={"pbsd": [5, 6, 7]}, resamples=50
    )
    assert "over_seeds" not in other["variants"]["pbsd"]["difference"]


def test_t_percentiles():
    from pbsd.comparison import t975

    assert [t975(df) for df in (1, 2, 4, 30)] == [12.706, 4.303, 2.776, 2.042]
    assert t975(60) == pytest.approx(2.000, abs=2e-3) and t975(10_000) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError):
        t975(0)
