"""Log-probabilities of realised tokens from the LM head, a chunk of rows at a time.

For hidden states h (one row per position that predicts a token) and the realised
next tokens y::

    log p(y | h) = z_y - logsumexp(z),   z = lm_head(h) / T   (T = 1 unless the caller sampled at T)

Full-vocabulary float32 logits for every row would cost rows x vocabulary x 4 bytes
(40 GB for 64K rows of Qwen3's 151,936 tokens), so rows go through the head
``chunk_size`` at a time. Two reductions of a chunk's logits exist:

* ``chunked``: the float32 logits' gather and ``torch.logsumexp``
  (pure torch, any device, differentiable: the trainer's path);
* ``fused`` (CUDA with Triton, no gradients: the scorer's): one Triton kernel reads each
  row of logits once and returns z_y and logsumexp(z) in float32
  (:mod:`services.model.lse_kernel`), instead of a gather, a max and a sum of exponentials
  that each read the chunk again. Both reductions see the same logits and accumulate in
  float32; they differ only in summation order.

The logits are float32 straight out of the matrix product (:func:`float32_logits`), never
rounded to a half-precision model's dtype: the scorer calls it on the head's weight, and the
trainer's head, made to do the same by :func:`float32_output`, is still called as a module so
that ZeRO-3 gathers it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = [
    "Float32Head",
    "HeadPath",
    "chunk_logprobs",
    "float32_logits",
    "float32_output",
    "float32_product",
    "fused_head_available",
    "logprob_rows",
    "realised_logprobs",
]

HeadPath = Literal["chunked", "fused"]

# Devices where torch.mm takes out_dtype (aten::mm.dtype, torch >= 2.8): half-precision inputs
# on tensor cores, float32 accumulation and output. "meta" has the kernel too, which lets a CPU
# test check the call's shapes and types.
_MM_OUT_DTYPE_DEVICES = ("cuda", "meta") if "dtype" in torch.ops.aten.mm.overloads() else ()


def float32_logits(head: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """head(rows) as float32 logits that were never rounded to the model's dtype.

    A bfloat16 logit between 16 and 32 lies on a grid of 0.125, so the realised token's
    log-prob is off by up to 0.06 nats. Worse for the evidence: a student and a teacher pass
    whose hidden states differ by a kernel's rounding land on the same grid point or on
    neighbouring ones, which turns a difference of 0.001 into one of 0 or 0.125. So the head's
    product is accumulated and kept in float32 (:func:`float32_product`). A head that is not a
    plain linear layer is called as it is."""
    if not isinstance(head, nn.Linear):
        return head(rows).float()
    return float32_product(rows, head.weight, head.bias)


def float32_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(rows, weight, bias) in float32: on CUDA by torch.mm's ``out_dtype`` for
    half-precision operands (what SGLang's ``--enable-fp32-lm-head`` does, at half-precision
    matmul speed), elsewhere on float32 operands (a float32 model's own call, unchanged)."""
    if _half(rows, weight) and rows.device.type in _MM_OUT_DTYPE_DEVICES:
        logits = torch.mm(rows.reshape(-1, rows.shape[-1]), weight.T, out_dtype=torch.float32)
        logits = logits.reshape(*rows.shape[:-1], weight.shape[0])
        return logits if bias is None else logits + bias.float()
    return nn.functional.linear(rows.float(), weight.float(), None if bias is None else bias.float())


def _half(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    return rows.dtype == weight.dtype and rows.dtype in (torch.bfloat16, torch.float16)


class _Float32Logits(torch.autograd.Function):
    """rows @ weight.T (+ bias) kept in float32; the backward as the model's dtype runs it (the
    float32 gradient of the logits rounded to that dtype, then the two products), which is what
    autograd does for ``head(rows).float()``. torch.mm's ``out_dtype`` has no derivative."""

    @staticmethod
    def forward(ctx, rows, weight, bias):
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return float32_product(rows, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        grad = grad.to(rows.dtype)
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        flat_grad, flat_rows = grad.reshape(-1, grad.shape[-1]), rows.reshape(-1, rows.shape[-1])
        grad_weight = flat_grad.T @ flat_rows if ctx.needs_input_grad[1] else None
        grad_bias = flat_grad.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias


class Float32Head(nn.Linear):
    """A linear head whose half-precision product comes out in float32 (:func:`float32_output`)."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if not _half(rows, self.weight):
            return super().forward(rows)
        return _Float32Logits.apply(rows, self.weight, self.bias)


def float32_output(head: nn.Module) -> nn.Module:
    """Make a half-precision linear head return float32 logits when called as a module: the
    trainer's log-probs then carry no bfloat16 rounding of the logits, as the scorer's do not
    and as SGLang's do not with ``--enable-fp32-lm-head``, so that the ratio to the rollout's
    log-probs measures the policy's change and not two roundings. The head becomes a
    :class:`Float32Head` (its class changes, its parameters and hooks stay), so it is still
    called as a module and ZeRO-3's hooks gather its weight for the forward and the backward;
    it pickles and copies as a module does. A float32 head (every CPU run) and a head that is
    not a plain linear layer are left as they are."""
    if type(head) is nn.Linear and head.weight.dtype in (torch.bfloat16, torch.float16):
        head.__class__ = Float32Head
    return head


def chunk_logprobs(
    head: nn.Module, rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(head(rows) / T)[targets] of one chunk, in float32 (differentiable)."""
    logits = head(rows).float()
    if temperature != 1.0:  # as the rollout engine sampled: softmax(logits / T)
        logits = logits / temperature
    return _log_softmax_at(logits, targets)


def _log_softmax_at(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
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
    """log softmax(head(hidden))[targets] for every row, ``chunk_size`` rows of logits alive at
    once, the logits in float32 (:func:`float32_logits`)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    if path == "fused":
        from services.model.lse_kernel import logit_and_logsumexp
    for start in range(0, hidden.shape[0], chunk_size):
        rows, chosen = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        logits = float32_logits(head, rows)
        if path == "fused":
            z_y, lse = logit_and_logsumexp(logits, chosen)
            out[start : start + chunk_size] = z_y - lse
        else:
            out[start : start + chunk_size] = _log_softmax_at(logits, chosen)
    return out
