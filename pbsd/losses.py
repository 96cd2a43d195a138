r"""Token-level clipped policy-gradient loss (GRPO/DAPO form) with PBSD advantages.

For loss token k of trajectory i with advantage A_{i,k} (GRPO: A_i; PBSD:
w_{i,t(k)} A_i, see :mod:`pbsd.credit`)::

    rho_{i,k} = exp(log pi_theta(z_k | .) - log pi_old(z_k | .))
    l_{i,k}   = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)

(paper section 3.1 with asymmetric clipping, eps_low 0.2 and eps_high 0.28 as in
section 4.1). On-policy, pi_old is the rollout engine's log-prob of the sampled
token. If the trainer recomputes pi_old itself, the mismatch with the engine can
be corrected by truncated importance sampling (TIS)::

    l_{i,k} <- min(exp(log pi_old - log pi_rollout), C) * l_{i,k}     (weight detached)

An optional KL penalty to a reference policy adds beta * KL_k with Schulman's
estimators: k1 = log pi - log pi_ref, k2 = (log pi - log pi_ref)^2 / 2,
k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1. The paper omits it (beta 0).

Aggregation. The paper's objective is

    J = 1/G sum_i 1/|tau_i| sum_k (...)

i.e. tokens are averaged inside each trajectory, then trajectories are averaged:
``"seq-mean-token-mean"`` (the default). Alternatives: ``"token-mean"`` pools every
loss token of the batch (DAPO), ``"seq-mean-token-sum"`` sums tokens and averages
trajectories, ``"constant"`` divides the token sum by a fixed constant (Dr. GRPO).

Gradient accumulation: every mode is a weighted token sum, sum_k c_k l_k. Pass the
global counts of the whole optimiser batch (``num_tokens``, ``num_sequences``) so
that summing the losses of micro-batches gives exactly the batch loss. A single
trajectory is never split across micro-batches, so |tau_i| is local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["AGGREGATIONS", "PolicyLoss", "aggregation_weights", "clipped_policy_loss", "kl_penalty"]

Aggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "constant"]
AGGREGATIONS: tuple[str, ...] = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "constant")
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass(frozen=True)
class PolicyLoss:
    """The differentiable loss and detached diagnostics over the loss tokens."""

    loss: torch.Tensor
    clip_frac: torch.Tensor  # fraction of loss tokens where the clipped branch was taken
    clip_frac_low: torch.Tensor  # ... because rho < 1 - eps_low with A < 0
    clip_frac_high: torch.Tensor  # ... because rho > 1 + eps_high with A > 0
    approx_kl_old: torch.Tensor  # k3 estimate of KL(pi_old || pi_theta), a staleness check
    ratio_mean: torch.Tensor
    kl_ref: torch.Tensor | None = None

    def metrics(self) -> dict[str, float]:
        out = {
            "loss": float(self.loss.detach()),
            "clip_frac": float(self.clip_frac),
            "clip_frac_low": float(self.clip_frac_low),
            "clip_frac_high": float(self.clip_frac_high),
            "approx_kl_old": float(self.approx_kl_old),
            "ratio_mean": float(self.ratio_mean),
        }
        if self.kl_ref is not None:
            out["kl_ref"] = float(self.kl_ref)
        return out


def _sequence_ids(mask: torch.Tensor, seq_ids: torch.Tensor | None) -> torch.Tensor:
    if seq_ids is not None:
        if seq_ids.shape != mask.shape:
            raise ValueError(f"seq_ids shape {tuple(seq_ids.shape)} != mask shape {tuple(mask.shape)}")
        return seq_ids.long()
    if mask.dim() == 2:  # [batch, time]: one sequence per row
        return torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)
    raise ValueError("seq_ids is required for 1-D (packed) inputs with a sequence-level aggregation")


def aggregation_weights(
    mask: torch.Tensor,
    *,
    mode: Aggregation = "seq-mean-token-mean",
    seq_ids: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    constant: float | None = None,
) -> torch.Tensor:
    """Per-token coefficients c_k with loss = sum_k c_k l_k for the chosen aggregation.

    Counts default to the ones in ``mask``; pass the optimiser batch's global counts
    when accumulating gradients over micro-batches.
    """
    m = mask.to(torch.float64)  # exact counts; cast to the loss dtype by the caller
    if mode == "token-mean":
        n = float(m.sum()) if num_tokens is None else float(num_tokens)
        return m / max(n, 1.0)
    if mode == "constant":
        if constant is None or constant <= 0:
            raise ValueError("mode 'constant' needs a positive constant")
        return m / float(constant)
    if mode not in ("seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")
    seq = _sequence_ids(mask, seq_ids).reshape(-1)
    flat = m.reshape(-1)
    uniq, inverse = torch.unique(seq, return_inverse=True)
    lengths = torch.zeros(uniq.numel(), dtype=m.dtype, device=m.device).index_add_(0, inverse, flat)
    n_seq = float((lengths > 0).sum()) if num_sequences is None else float(num_sequences)
    n_seq = max(n_seq, 1.0)
    if mode == "seq-mean-token-sum":
        return m / n_seq
    per_token_len = lengths[inverse].clamp_min(1.0).reshape(m.shape)
    return m / (per_token_len * n_seq)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from sampled-token log-probs."""
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        neg = (-diff).clamp(max=20.0)  # exp overflow guard; the true value is astronomically large anyway
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    agg: Aggregation = "seq-mean-token-mean",
    seq_ids: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    constant: float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
) -> PolicyLoss:
    """Clipped surrogate loss (to minimise) over the tokens where ``mask`` is true.

    All token tensors share one shape: [batch, time], or 1-D packed with ``seq_ids``.
    ``advantages`` are per token (already multiplied by the PBSD turn weights).
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError("logprobs, old_logprobs, advantages and mask must share one shape")
    if eps_low < 0 or eps_high < 0:
        raise ValueError("clip ranges must be >= 0")
    valid = mask.bool()
    coef = aggregation_weights(
        valid,
        mode=agg,
        seq_ids=seq_ids,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        constant=constant,
    ).to(logprobs.dtype)

    # Masked positions may hold anything (padding, NaN): zero them before they touch the graph.
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(valid, advantages.to(logprobs.dtype), zero).detach()
    log_ratio = torch.where(valid, logprobs - old_logprobs.to(logprobs.dtype).detach(), zero)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)

    if tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap needs rollout_logprobs")
        behaviour = torch.where(valid, old_logprobs - rollout_logprobs.to(old_logprobs.dtype), zero)
        per_token = per_token * torch.exp(behaviour).clamp(max=tis_cap).detach()

    kl_value = None
    if ref_logprobs is not None and kl_coef != 0.0:
        kl_tok = torch.where(valid, kl_penalty(logprobs, ref_logprobs.to(logprobs.dtype), kl_estimator), zero)
        per_token = per_token + kl_coef * kl_tok
        kl_value = _masked_mean(kl_tok.detach(), valid)

    loss = (coef * per_token).sum()

    with torch.no_grad():
        took_clip = (clipped > unclipped) & valid
        low = took_clip & (ratio < 1.0 - eps_low)
        high = took_clip & (ratio > 1.0 + eps_high)
        approx_kl = torch.exp(-log_ratio) - 1.0 + log_ratio  # k3 of KL(old || new)
        return PolicyLoss(
            loss=loss,
            clip_frac=_masked_mean(took_clip.float(), valid),
            clip_frac_low=_masked_mean(low.float(), valid),
            clip_frac_high=_masked_mean(high.float(), valid),
            approx_kl_old=_masked_mean(approx_kl, valid),
            ratio_mean=_masked_mean(ratio.detach(), valid),
            kl_ref=kl_value,
        )


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return (values.float() * mask).sum() / n
