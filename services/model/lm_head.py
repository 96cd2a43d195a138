"""Log-probabilities of realised tokens from the LM head, a chunk of rows at a time.

For hidden states h (one row per position that predicts a token) and the realised
next tokens y::

    log p(y | h) = z_y - logsumexp(z),   z = lm_head(h) / T   (T = 1 unless the caller sampled at T)

Full-vocabulary float32 logits for every row would cost rows x vocabulary x 4 bytes
(40 GB for 64K rows of Qwen3's 151,936 tokens), so rows go through the head
``chunk_size`` at a time. Two reductions of a chunk's logits exist:

* ``chunked``: the logits upcast to float32, then a gather and ``torch.logsumexp``
  (pure torch, any device, differentiable: the trainer's path);
* ``fused`` (CUDA with Triton, no gradients: the scorer's): one Triton kernel reads each
  row of the head's own-dtype logits once and returns z_y and logsumexp(z) in float32
  (:mod:`services.model.lse_kernel`). No float32 copy of the logits is written and read
  back, which is what separates the chunked scorer from its bound (the logits alone) on a
  large vocabulary. Both reductions see the same logits and accumulate in float32; they
  differ only in summation order.

The head is always called as a module (not through its weight) so that ZeRO-3 gathers it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["HeadPath", "chunk_logprobs", "fused_head_available", "logprob_rows", "realised_logprobs"]

HeadPath = Literal["chunked", "fused"]


def chunk_logprobs(
    head: nn.Module, rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(head(rows) / T)[targets] of one chunk, in float32 (differentiable)."""
    logits = head(rows).float()
    if temperature != 1.0:  # as the rollout engine sampled: softmax(logits / T)
        logits = logits / temperature
    return logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def logprob_rows(model: nn.Module, ids: list[int], positions) -> torch.Tensor:
    """log p(. | ids[:p]) over the whole vocabulary at each of ``positions``, in float32: one whole
    forward of ``ids`` without gradient, the log-softmax at those positions only. For analyses of a
    few short sequences on the CPU (the probe, the drift), not the scorer's batched path."""
    logits = model(torch.tensor([ids])).logits[0, torch.as_tensor(positions) - 1].float()
    return torch.log_softmax(logits, -1)


def fused_head_available(device: torch.device | str) -> bool:
    """The fused reduction runs where Triton has a GPU backend: CUDA with a CUDA build of torch."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    from services.model.lse_kernel import triton_available

    return triton_available()


@torch.no_grad()
def realised_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    chunk_size: int,
    path: HeadPath = "chunked",
) -> torch.Tensor:
    """log softmax(head(hidden))[targets] for every row, ``chunk_size`` rows of logits alive at once."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    if path == "fused":
        from services.model.lse_kernel import logit_and_logsumexp
    for start in range(0, hidden.shape[0], chunk_size):
        rows, chosen = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if path == "fused":
            z_y, lse = logit_and_logsumexp(head(rows), chosen)
            out[start : start + chunk_size] = z_y - lse
        else:
            out[start : start + chunk_size] = chunk_logprobs(head, rows, chosen)
    return out
