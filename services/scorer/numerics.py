"""How far a change of kernel path moves a turn's evidence, measured against the deadband.

Two kernel paths A and B (unpacked SDPA or packed flex attention, chunked or fused LM
head, ...) give every scored token slightly different log-probs in bf16. With
Delta^s_k = l^s_B(k) - l^s_A(k) for the student's token k and Delta^p_k likewise for the
teacher's token phi(k), a turn of n tokens (evidence s = mean_k (l^p_k - l^s_k)) moves by::

    same path (A for both, then B for both):   d_same  = 1/n sum_k (Delta^p_k - Delta^s_k)
    mixed     (student on A, teacher on B):    d_mixed = 1/n sum_k Delta^p_k

The scorer keeps every call on one path, so d_same is the noise a path adds to the
evidence; d_mixed is what a length-dependent choice of path would add on top. Either
matters when it is comparable to the deadband [-eps-, eps+] = [-0.003, 0.001] of
:func:`pbsd.credit.turn_weights`, inside which a turn keeps w = 1.

Turns here are consecutive runs of ``n`` scored tokens within one trajectory (the last
partial run dropped), so per-token errors that are correlated along a sequence stay so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pbsd.credit import DEFAULT_EPS_NEG, DEFAULT_EPS_POS

__all__ = ["TurnShift", "token_differences", "turn_shifts"]


@dataclass(frozen=True)
class TurnShift:
    """The distribution of one kind of shift over the turns of ``turn_tokens`` tokens."""

    turn_tokens: int
    turns: int
    median_abs: float
    p99_abs: float
    max_abs: float
    over_eps_pos: float  # fraction of turns moved by more than eps+ (0.001)
    over_eps_neg: float  # ... by more than eps- (0.003)


def token_differences(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> dict[str, float]:
    """Per-token |l_B - l_A| over all requests: largest, mean, and the mean signed difference."""
    d = np.concatenate(
        [np.asarray(y, np.float64) - np.asarray(x, np.float64) for x, y in zip(a, b, strict=True)]
    )
    if d.size == 0:
        return {"tokens": 0, "max_abs": 0.0, "mean_abs": 0.0, "mean": 0.0}
    return {
        "tokens": int(d.size),
        "max_abs": float(np.abs(d).max()),
        "mean_abs": float(np.abs(d).mean()),
        "mean": float(d.mean()),
    }


def _turn_means(values: np.ndarray, n: int) -> np.ndarray:
    whole = values.size // n
    return values[: whole * n].reshape(whole, n).mean(axis=1)


def turn_shifts(
    student_delta: Sequence[np.ndarray],
    teacher_delta: Sequence[np.ndarray],
    turn_tokens: Sequence[int] = (16, 64, 256, 1024),
    *,
    mixed: bool = False,
    eps_pos: float = DEFAULT_EPS_POS,
    eps_neg: float = DEFAULT_EPS_NEG,
) -> list[TurnShift]:
    """d_same (or, with ``mixed``, d_mixed) over every turn of each length in ``turn_tokens``.
    ``student_delta[j][k]`` and ``teacher_delta[j][k]`` are trajectory j's differences at its k-th
    scored token and at that token's teacher position."""
    out = []
    for n in turn_tokens:
        shifts = [
            _turn_means(np.asarray(t, np.float64) - (0.0 if mixed else np.asarray(s, np.float64)), n)
            for s, t in zip(student_delta, teacher_delta, strict=True)
        ]
        d = np.abs(np.concatenate(shifts)) if shifts else np.zeros(0)
        out.append(
            TurnShift(
                turn_tokens=n,
                turns=int(d.size),
                median_abs=float(np.median(d)) if d.size else float("nan"),
                p99_abs=float(np.quantile(d, 0.99)) if d.size else float("nan"),
                max_abs=float(d.max()) if d.size else float("nan"),
                over_eps_pos=float((d > eps_pos).mean()) if d.size else float("nan"),
                over_eps_neg=float((d > eps_neg).mean()) if d.size else float("nan"),
            )
        )
    return out
