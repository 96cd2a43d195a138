"""pbsd.credit: hand-worked values, invariants, and a literal Algorithm 1 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pbsd import credit


# -- hand-worked values -------------------------------------------------------------
def test_group_advantages_by_hand():
    # mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = credit.group_advantages([1, 0, 0, 0], eps=0.0)
    np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5])
    adv = credit.group_advantages([1, 0, 0, 0])
    np.testing.assert_allclose(adv, np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6))


@pytest.mark.parametrize("rewards", [[1, 1, 1, 1], [0, 0], [0.3], [0.7] * 8])
def test_equal_rewards_give_exact_zeros(rewards):
    adv = credit.group_advantages(rewards)
    assert adv.shape == (len(rewards),)
    assert np.all(adv == 0.0)


def test_turn_evidence_by_hand():
    student = [-1.0, -2.0, -3.0, -1.0]
    teacher = [-0.5, -1.5, math.nan, -0.9]  # token 2 has no privileged position
    turns = [0, 0, 1, 2]
    mean = credit.turn_evidence(student, teacher, turns)
    np.testing.assert_allclose(mean, [0.5, np.nan, 0.1], equal_nan=True)
    total = credit.turn_evidence(student, teacher, turns, reduce="sum")
    np.testing.assert_allclose(total, [1.0, np.nan, 0.1], equal_nan=True)
    padded = credit.turn_evidence(student, teacher, turns, num_turns=5)
    assert padded.shape == (5,) and np.isnan(padded[3:]).all()


def test_turn_weights_by_hand_with_deadband_boundaries():
    s = [0.05, -0.05, 0.0005, -0.002, 0.001, -0.003, 0.0011, math.nan]
    expected_pos = [1.1, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0 + math.tanh(0.011), 1.0]
    np.testing.assert_allclose(credit.turn_weights(s, 1.5), expected_pos, rtol=0, atol=1e-12)
    expected_neg = [0.9, 1.1, 1.0, 1.0, 1.0, 1.0, 1.0 - math.tanh(0.011), 1.0]
    np.testing.assert_allclose(credit.turn_weights(s, -0.2), expected_neg, rtol=0, atol=1e-12)
    # boundaries are inclusive in the deadband: exactly 1, not merely close
    w = credit.turn_weights([0.001, -0.003], 2.0)
    assert w[0] == 1.0 and w[1] == 1.0


def test_turn_weights_unclipped_tanh():
    w = credit.turn_weights([0.5, -0.25], 1.0, delta=1.0, clip=1.0)
    np.testing.assert_allclose(w, [1 + math.tanh(0.5), 1 - math.tanh(0.25)])


def test_zero_advantage_gives_unit_weights():
    assert np.all(credit.turn_weights([0.4, -0.4, 0.0], 0.0) == 1.0)


def test_token_advantages_by_hand():
    out = credit.token_advantages(2.0, [1.1, 0.9, 1.0], [0, 0, 1, 2, 2])
    np.testing.assert_allclose(out, [2.2, 2.2, 1.8, 2.0, 2.0])


# -- invariants -----------------------------------------------------------------------
def test_advantages_sum_to_zero_and_are_scale_free():
    rng = np.random.default_rng(0)
    for _ in range(100):
        r = rng.integers(0, 2, size=8).astype(float)
        adv = credit.group_advantages(r)
        assert abs(adv.sum()) < 1e-9
        np.testing.assert_allclose(
            credit.group_advantages(r * 3 + 5, eps=0), credit.group_advantages(r, eps=0)
        )


def test_weights_stay_in_band_and_sign_symmetry():
    rng = np.random.default_rng(1)
    s = rng.normal(scale=0.05, size=1000)
    for c in (0.05, 0.1, 0.3):
        for a in (-2.0, -0.1, 0.1, 2.0):
            w = credit.turn_weights(s, a, clip=c)
            assert np.all(w >= 1 - c - 1e-12) and np.all(w <= 1 + c + 1e-12)
    # flipping the advantage's sign mirrors the modulation around 1
    w_pos = credit.turn_weights(s, 1.0)
    w_neg = credit.turn_weights(s, -1.0)
    np.testing.assert_allclose(w_pos - 1, -(w_neg - 1))
    # symmetric deadband + odd tanh: flipping s mirrors too
    w_flip = credit.turn_weights(-s, 1.0, eps_pos=0.002, eps_neg=0.002)
    np.testing.assert_allclose(w_flip - 1, -(credit.turn_weights(s, 1.0, eps_pos=0.002, eps_neg=0.002) - 1))


def test_weights_monotone_in_evidence_for_positive_advantage():
    s = np.linspace(-1, 1, 2001)
    w = credit.turn_weights(s, 1.0)
    assert np.all(np.diff(w[(s > 0.001)]) >= 0) and np.all(np.diff(w[s < -0.003]) >= 0)


def test_accepts_lists_arrays_and_torch():
    s = [-1.0, -2.0]
    t = [-0.5, -2.0]
    turns = [0, 1]
    ref = credit.turn_evidence(s, t, turns)
    np.testing.assert_allclose(credit.turn_evidence(np.array(s), np.array(t), np.array(turns)), ref)
    np.testing.assert_allclose(
        credit.turn_evidence(torch.tensor(s), torch.tensor(t), torch.tensor(turns)), ref
    )
    np.testing.assert_allclose(
        credit.group_advantages(torch.tensor([1.0, 0.0])), credit.group_advantages([1, 0])
    )
    assert isinstance(np.asarray(credit.turn_weights(torch.tensor([0.2]), 1.0)), np.ndarray)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="align"):
        credit.turn_evidence([0.0], [0.0, 1.0], [0])
    with pytest.raises(ValueError, match="reduce"):
        credit.turn_evidence([0.0], [0.0], [0], reduce="max")
    with pytest.raises(ValueError, match="NaN"):
        credit.turn_evidence([math.nan], [0.0], [0])
    with pytest.raises(ValueError, match="delta"):
        credit.turn_weights([0.1], 1.0, delta=0)
    with pytest.raises(ValueError, match="finite"):
        credit.group_advantages([1.0, math.inf])
    with pytest.raises(ValueError, match="index"):
        credit.token_advantages(1.0, [1.0], [0, 1])


# -- slow reference: Algorithm 1 with section 3's deadband, written as loops ----------
def _reference(rewards, students, teachers, turn_ids, delta, clip, eps_pos, eps_neg, eps=1e-6):
    g = len(rewards)
    mu = sum(rewards) / g
    var = sum((r - mu) ** 2 for r in rewards) / (g - 1) if g > 1 else 0.0
    if all(r == rewards[0] for r in rewards):
        adv = [0.0] * g
    else:
        adv = [(r - mu) / (math.sqrt(var) + eps) for r in rewards]
    out = []
    for j in range(g):
        a_hat = [adv[j]] * len(students[j])
        for k in range(max(turn_ids[j]) + 1 if turn_ids[j] else 0):
            positions = [i for i, t in enumerate(turn_ids[j]) if t == k]
            aligned = [i for i in positions if not math.isnan(teachers[j][i])]
            if not aligned:
                rho = 1.0
            else:
                delta_jk = sum(teachers[j][i] - students[j][i] for i in aligned) / len(aligned)
                if -eps_neg <= delta_jk <= eps_pos:
                    rho = 1.0
                else:
                    c = min(max(math.tanh(delta_jk / delta), -clip), clip)
                    sgn = (adv[j] > 0) - (adv[j] < 0)
                    rho = 1.0 + sgn * c
            for i in positions:
                a_hat[i] = rho * adv[j]
        out.append(a_hat)
    return out


def test_matches_reference_on_random_groups():
    rng = np.random.default_rng(42)
    for trial in range(60):
        g = int(rng.integers(1, 9))
        rewards = rng.integers(0, 2, size=g).astype(float).tolist()
        students, teachers, turns = [], [], []
        for _ in range(g):
            n_turns = int(rng.integers(1, 6))
            lengths = rng.integers(1, 12, size=n_turns)
            tt = np.repeat(np.arange(n_turns), lengths)
            st = rng.normal(-2, 1, size=tt.size)
            scale = [0.001, 0.01, 0.1, 1.0][trial % 4]
            te = st + rng.normal(0, scale, size=tt.size)
            te[rng.random(tt.size) < 0.15] = np.nan  # some tokens lost to truncation
            students.append(st.tolist())
            teachers.append(te.tolist())
            turns.append(tt.tolist())
        params = dict(delta=0.1, clip=0.1, eps_pos=0.001, eps_neg=0.003)
        expected = _reference(rewards, students, teachers, turns, **params)
        adv = credit.group_advantages(rewards)
        for j in range(g):
            s = credit.turn_evidence(students[j], teachers[j], turns[j])
            w = credit.turn_weights(s, adv[j], **params)
            got = credit.token_advantages(adv[j], w, turns[j])
            np.testing.assert_allclose(got, expected[j], rtol=1e-12, atol=1e-12)
