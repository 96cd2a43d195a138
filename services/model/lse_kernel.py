"""One pass over a row of logits: the realised token's logit and the row's logsumexp, in float32.

For logits z (rows x vocabulary: float32 from the scorer, any float dtype) and targets y::

    chosen[r] = float32(z[r, y[r]])
    lse[r]    = log sum_v exp(float32(z[r, v]))

The Triton kernel gives each row one program that streams the row in ``BLOCK``-wide
tiles and keeps the running maximum m and the running sum s of exp(z - m) (the online
logsumexp: when a tile raises the maximum to m', s becomes s * exp(m - m') + the tile's
sum). The row is read once; torch's route reads it for the gather, again for the maximum
and again for the sum of exponentials (and, for half-precision logits, writes an upcast copy).

:func:`reference_logit_and_logsumexp` is the same quantity in plain torch; tests compare
the two (on CUDA, and on CPU under Triton's interpreter, ``TRITON_INTERPRET=1``).

Triton ships with the CUDA builds of torch; on a CPU build it is usually absent and the
module still imports (the kernel is simply not defined).
"""

from __future__ import annotations

import torch

__all__ = ["logit_and_logsumexp", "reference_logit_and_logsumexp", "triton_available"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None


def triton_available() -> bool:
    return triton is not None


def reference_logit_and_logsumexp(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    full = logits.float()
    return full.gather(1, targets[:, None])[:, 0], torch.logsumexp(full, dim=-1)


if triton is not None:

    @triton.jit
    def _logit_lse_kernel(
        logits_ptr, row_stride, targets_ptr, chosen_ptr, lse_ptr, vocab, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        start_of_row = logits_ptr + row.to(tl.int64) * row_stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(start_of_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            m_next = tl.maximum(m, tl.max(z, 0))
            s = s * tl.exp(m - m_next) + tl.sum(tl.exp(z - m_next), 0)
            m = m_next
        tl.store(lse_ptr + row, m + tl.log(s))
        target = tl.load(targets_ptr + row)
        tl.store(chosen_ptr + row, tl.load(start_of_row + target).to(tl.float32))


def logit_and_logsumexp(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_y, logsumexp(z)) per row, float32, by the Triton kernel."""
    if triton is None:
        raise RuntimeError("the fused LM-head reduction needs Triton (it ships with CUDA builds of torch)")
    if logits.ndim != 2 or logits.stride(1) != 1:
        logits = logits.reshape(-1, logits.shape[-1]).contiguous()
    rows, vocab = logits.shape
    chosen = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(8192, triton.next_power_of_2(vocab))
        _logit_lse_kernel[(rows,)](
            logits, logits.stride(0), targets.contiguous(), chosen, lse, vocab, BLOCK=block, num_warps=8
        )
    return chosen, lse
