"""pbsd.losses: hand-worked values, aggregation modes, gradients, and a loop reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pbsd.losses import aggregation_weights, clipped_policy_loss, kl_penalty


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def test_hand_worked_single_sequence():
    # ratios 1, 1.5, 0.5 with advantages +1, +1, -1 and clip [0.8, 1.28]:
    #   token 0: -min(1, 1) = -1;   token 1: -min(1.5, 1.28) = -1.28 (clipped high)
    #   token 2: -min(-0.5, -0.8) = 0.8 (clipped low)
    logp = _t([0.0, math.log(1.5), math.log(0.5)], grad=True)
    old = _t([0.0, 0.0, 0.0])
    adv = _t([1.0, 1.0, -1.0])
    mask = torch.ones(3, dtype=torch.bool)
    out = clipped_policy_loss(logp.unsqueeze(0), old.unsqueeze(0), adv.unsqueeze(0), mask.unsqueeze(0))
    assert out.loss.item() == pytest.approx((-1 - 1.28 + 0.8) / 3)
    assert out.clip_frac.item() == pytest.approx(2 / 3)
    assert out.clip_frac_high.item() == pytest.approx(1 / 3)
    assert out.clip_frac_low.item() == pytest.approx(1 / 3)
    out.loss.backward()
    # only the unclipped token carries gradient: d/dlogp (-A * exp(logp)) / 3 = -1/3
    np.testing.assert_allclose(logp.grad.numpy(), [-1 / 3, 0.0, 0.0], atol=1e-12)


def test_ratio_one_clip_region_is_open_for_recovery():
    # ratio below 1 - eps_low with A > 0 is NOT clipped (min picks the unclipped term)
    logp = _t([[math.log(0.5)]], grad=True)
    out = clipped_policy_loss(logp, _t([[0.0]]), _t([[1.0]]), torch.ones(1, 1, dtype=torch.bool))
    assert out.loss.item() == pytest.approx(-0.5)
    assert out.clip_frac.item() == 0.0
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(-0.5)


def test_aggregations_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    tm = aggregation_weights(mask, mode="token-mean")
    np.testing.assert_allclose(tm.numpy(), np.array([[1, 1, 1, 0], [1, 0, 0, 0]]) / 4)
    sm = aggregation_weights(mask, mode="seq-mean-token-mean")
    np.testing.assert_allclose(sm.numpy(), [[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0]])
    ss = aggregation_weights(mask, mode="seq-mean-token-sum")
    np.testing.assert_allclose(ss.numpy(), [[0.5, 0.5, 0.5, 0], [0.5, 0, 0, 0]])
    c = aggregation_weights(mask, mode="constant", constant=8)
    np.testing.assert_allclose(c.numpy(), mask.numpy() / 8)
    with pytest.raises(ValueError):
        aggregation_weights(mask, mode="constant")
    with pytest.raises(ValueError):
        aggregation_weights(mask, mode="bogus")


def test_packed_equals_padded_and_micro_batches_sum_to_batch():
    rng = np.random.default_rng(0)
    lengths = [5, 3, 7, 2]
    T = max(lengths)
    logp = rng.normal(-1, 0.3, size=(4, T))
    old = logp + rng.normal(0, 0.2, size=(4, T))
    adv = rng.normal(size=(4, T))
    mask = np.zeros((4, T), dtype=bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    for agg in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum"):
        padded = clipped_policy_loss(_t(logp), _t(old), _t(adv), torch.tensor(mask), agg=agg).loss.item()
        # packed: the valid tokens of every row concatenated, with sequence ids
        sel = mask.reshape(-1)
        seq = np.repeat(np.arange(4), T)[sel]
        packed = clipped_policy_loss(
            _t(logp.reshape(-1)[sel]),
            _t(old.reshape(-1)[sel]),
            _t(adv.reshape(-1)[sel]),
            torch.ones(sel.sum(), dtype=torch.bool),
            agg=agg,
            seq_ids=torch.tensor(seq),
        ).loss.item()
        assert packed == pytest.approx(padded, rel=1e-12)
        # two micro-batches with the global counts sum to the whole batch
        parts = 0.0
        for rows in ([0, 1], [2, 3]):
            parts += clipped_policy_loss(
                _t(logp[rows]),
                _t(old[rows]),
                _t(adv[rows]),
                torch.tensor(mask[rows]),
                agg=agg,
                num_tokens=int(mask.sum()),
                num_sequences=4,
            ).loss.item()
        assert parts == pytest.approx(padded, rel=1e-12)


def test_masked_positions_never_leak_even_if_nan():
    logp = _t([[0.1, float("nan")]], grad=True)
    old = _t([[0.0, float("nan")]])
    adv = _t([[1.0, float("nan")]])
    mask = torch.tensor([[True, False]])
    out = clipped_policy_loss(logp, old, adv, mask)
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0


def test_truncated_importance_sampling_weights():
    logp = _t([[0.0, 0.0]], grad=True)
    old = _t([[0.0, 0.0]])
    rollout = _t([[math.log(0.5), math.log(0.1)]])  # behaviour ratios 2 and 10, capped at 3
    adv = _t([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = clipped_policy_loss(logp, old, adv, mask, agg="token-mean", rollout_logprobs=rollout, tis_cap=3.0)
    assert out.loss.item() == pytest.approx((-2.0 - 3.0) / 2)
    with pytest.raises(ValueError):
        clipped_policy_loss(logp, old, adv, mask, tis_cap=3.0)


def test_kl_estimators_by_hand():
    lp, ref = _t([0.0]), _t([math.log(0.5)])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1)
    logp = _t([[0.0]], grad=True)
    base = clipped_policy_loss(logp, _t([[0.0]]), _t([[1.0]]), torch.ones(1, 1, dtype=torch.bool))
    with_kl = clipped_policy_loss(
        logp,
        _t([[0.0]]),
        _t([[1.0]]),
        torch.ones(1, 1, dtype=torch.bool),
        ref_logprobs=_t([[math.log(0.5)]]),
        kl_coef=0.1,
    )
    assert with_kl.loss.item() == pytest.approx(base.loss.item() + 0.1 * (0.5 + math.log(2) - 1))
    assert with_kl.kl_ref is not None


def _reference_loss(logp, old, adv, mask, eps_low, eps_high):
    """The paper's J (negated) with seq-mean-token-mean, as explicit loops."""
    total, n_seq = 0.0, 0
    for i in range(len(logp)):
        toks = [k for k in range(len(logp[i])) if mask[i][k]]
        if not toks:
            continue
        n_seq += 1
        s = 0.0
        for k in toks:
            rho = math.exp(logp[i][k] - old[i][k])
            s += min(rho * adv[i][k], min(max(rho, 1 - eps_low), 1 + eps_high) * adv[i][k])
        total += s / len(toks)
    return -total / n_seq


def test_matches_loop_reference():
    rng = np.random.default_rng(7)
    for _ in range(30):
        B, T = int(rng.integers(1, 6)), int(rng.integers(1, 20))
        logp = rng.normal(-1, 0.5, size=(B, T))
        old = logp + rng.normal(0, 0.4, size=(B, T))
        adv = rng.normal(size=(B, T))
        mask = rng.random((B, T)) < 0.7
        mask[0, 0] = True
        got = clipped_policy_loss(_t(logp), _t(old), _t(adv), torch.tensor(mask)).loss.item()
        assert got == pytest.approx(_reference_loss(logp, old, adv, mask, 0.2, 0.28), rel=1e-10)
