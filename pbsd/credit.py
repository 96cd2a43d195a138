r"""Turn-level credit assignment of PBSD (paper, section 3 and Algorithm 1).

For a prompt x with verified answer y*, the policy samples G trajectories tau_i,
each a sequence of assistant turns a_{i,1..T_i}; a verifier gives reward r_i.

Group advantage (GRPO, paper section 3.1; Algorithm 1 line 6)::

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)

``std`` is the sample standard deviation (Bessel's correction, ``ddof=1``), as in
verl's and TRL's GRPO; a group whose rewards are all equal has no signal and gets
A_i = 0 exactly.

Turn-level Bayesian evidence (section 3.2)::

    s_{i,t} = log p(a_{i,t} | x*, tau_{i,<t}) - log p(a_{i,t} | x, tau_{i,<t})

where x* is x with y* added by a teacher-only template. Algorithm 1 estimates it
per turn as the *mean* over the turn's loss tokens i whose privileged position
phi(i) exists::

    Delta_{j,k} = 1/|I_{j,k}| * sum_{i in I_{j,k}} (l^p_{j,phi(i)} - l^s_{j,i})

``reduce="sum"`` gives section 3's sum (the exact log-likelihood ratio of the turn).

Evidence-calibrated weight with the low-SNR deadband (section 3.2)::

    w_{i,t} = 1 + sign(A_i) * clip(tanh(s_{i,t} / delta), -c, c)   if s > eps+ or s < -eps-
    w_{i,t} = 1                                                    if -eps- <= s <= eps+

so w lies in [1 - c, 1 + c]. A turn without aligned tokens (Algorithm 1:
I_{j,k} empty) gets w = 1. Paper defaults: delta 0.1, c 0.1, eps+ 0.001, eps- 0.003.

Token advantage (Algorithm 1, inner loop)::

    A_hat_{i,k} = w_{i,t(k)} * A_i   for every loss token k of turn t(k)

Everything here is a pure function of arrays; inputs may be Python sequences,
NumPy arrays or CPU torch tensors, and outputs are NumPy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_DELTA",
    "DEFAULT_EPS_NEG",
    "DEFAULT_EPS_POS",
    "group_advantages",
    "token_advantages",
    "turn_evidence",
    "turn_weights",
]

DEFAULT_DELTA = 0.1
DEFAULT_CLIP = 0.1
DEFAULT_EPS_POS = 0.001
DEFAULT_EPS_NEG = 0.003

ArrayLike = Sequence[float] | np.ndarray  # torch tensors are accepted as well


def _as_array(x, dtype) -> np.ndarray:
    """Convert a sequence, ndarray or CPU torch tensor to a 1-D ndarray."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        x = x.detach().cpu().numpy()
    arr = np.asarray(x, dtype=dtype)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {arr.shape}")
    return arr


def group_advantages(rewards: ArrayLike, *, eps: float = 1e-6) -> np.ndarray:
    """A_i = (r_i - mean(r)) / (std(r) + eps) over one group; all-equal rewards give zeros."""
    r = _as_array(rewards, np.float64)
    if r.size == 0:
        return r
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    if r.size == 1 or np.all(r == r[0]):
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=1) + eps)


def turn_evidence(
    student_logprobs: ArrayLike,
    teacher_logprobs: ArrayLike,
    token_turns: ArrayLike,
    *,
    reduce: Literal["mean", "sum"] = "mean",
    num_turns: int | None = None,
) -> np.ndarray:
    """Per-turn evidence s_t from per-loss-token log-probs.

    ``student_logprobs[k]`` is log p(z_k | x, z_<k), ``teacher_logprobs[k]`` is
    log p(z_k | x*, z_<k) at the privileged position phi(k), or NaN when phi(k) does
    not exist (the token fell outside the teacher context); such tokens are left out.
    ``token_turns[k]`` is the 0-based assistant turn of token k. The result has
    ``num_turns`` entries (default: max turn + 1); a turn with no aligned token is NaN.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    s = _as_array(student_logprobs, np.float64)
    p = _as_array(teacher_logprobs, np.float64)
    turns = _as_array(token_turns, np.int64)
    if not (s.shape == p.shape == turns.shape):
        raise ValueError(
            f"student ({s.shape}), teacher ({p.shape}) and token_turns ({turns.shape}) must align"
        )
    if turns.size and turns.min() < 0:
        raise ValueError("token_turns must be >= 0")
    n = int(turns.max()) + 1 if turns.size else 0
    if num_turns is not None:
        if num_turns < n:
            raise ValueError(f"num_turns={num_turns} but token_turns reaches turn {n - 1}")
        n = num_turns
    if np.isnan(s).any():
        raise ValueError("student log-probs must not be NaN (every loss token has a student position)")

    aligned = ~np.isnan(p)
    gaps = np.where(aligned, p - s, 0.0)
    total = np.bincount(turns, weights=gaps, minlength=n)
    count = np.bincount(turns, weights=aligned.astype(np.float64), minlength=n)
    out = np.full(n, np.nan)
    has = count > 0
    out[has] = total[has] / count[has] if reduce == "mean" else total[has]
    return out


def turn_weights(
    evidence: ArrayLike,
    advantage: float,
    *,
    delta: float = DEFAULT_DELTA,
    clip: float = DEFAULT_CLIP,
    eps_pos: float = DEFAULT_EPS_POS,
    eps_neg: float = DEFAULT_EPS_NEG,
) -> np.ndarray:
    """w_t = 1 + sign(A) clip(tanh(s_t/delta), -clip, clip) outside the deadband [-eps_neg, eps_pos], else 1."""
    if delta <= 0:
        raise ValueError("delta must be > 0")
    if clip < 0 or eps_pos < 0 or eps_neg < 0:
        raise ValueError("clip, eps_pos and eps_neg must be >= 0")
    s = _as_array(evidence, np.float64)
    a = float(advantage)
    if not np.isfinite(a):
        raise ValueError("advantage must be finite")
    informative = (s > eps_pos) | (s < -eps_neg)  # NaN compares False: weight 1
    modulation = np.clip(np.tanh(np.where(informative, s, 0.0) / delta), -clip, clip)
    return np.where(informative, 1.0 + np.sign(a) * modulation, 1.0)


def token_advantages(advantage: float, weights: ArrayLike, token_turns: ArrayLike) -> np.ndarray:
    """A_hat_k = w_{t(k)} * A for every loss token k."""
    w = _as_array(weights, np.float64)
    turns = _as_array(token_turns, np.int64)
    if turns.size and (turns.min() < 0 or turns.max() >= w.size):
        raise ValueError(f"token_turns must index into {w.size} turn weights")
    return w[turns] * float(advantage)
