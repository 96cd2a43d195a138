"""Log-probabilities of realised tokens, fast: packed sequences, token budgets, one kernel path.

``sequence_logprobs(model, requests)`` returns, for each request ``(ids, positions)``,
``log p(ids[p] | ids[:p])`` at the requested positions. Student and teacher
sequences go through this one procedure together, so both passes share weights,
kernels and numerics; their difference measures the privileged context and nothing else.

The kernel path (:class:`KernelPath`: attention implementation, packed or not, LM-head
reduction, dtype) is chosen once per call, from the model and the settings, never per
sequence: a student and its teacher differ in length, and a length-dependent choice would
put a kernel difference into their log-ratio (benchmarks/README.md quantifies it: in bf16
it is of the order of the deadband).

How it stays fast and small:

* Batches are filled up to ``token_budget`` tokens, longest first. When the attention
  implementation has a packed kernel (flex attention with a document mask, or flash
  attention's varlen), a batch is one *packed* forward: sequences concatenated,
  ``position_ids`` restarting at 0, each token attending causally within its own
  sequence only. Otherwise (SDPA on CPU, where a packed mask is dense and costs the
  square of the packed length) each sequence runs alone, and no pad token is computed.
* A flex-attention forward is padded to one of four lengths per doubling
  (:func:`static_length`) and compiled for that static shape: Inductor's symbolic-length
  flex kernels fail to build (no valid template in bf16 on an H100 with torch 2.11, a C++
  compile error on CPU with torch 2.13), and a few static shapes compile once each. The
  padding is a sequence of its own that no real token sees.
* Only the hidden states that predict a requested token are kept, and they go through
  the LM head ``chunk_size`` rows at a time (:mod:`services.model.lm_head`): each
  chunk's float32 logits are reduced to the realised token's logit and ``logsumexp`` at
  once (a fused Triton kernel on CUDA), so full-vocabulary logits never exist for more
  than one chunk.
* ``torch.no_grad`` and the model's own dtype throughout, except the LM head's product,
  accumulated and kept in float32 (:func:`services.model.lm_head.float32_logits`), and the
  reduction, in float32.
* MoE routing is computed fresh: any routing replay installed on the model's routers
  is lifted for the duration (:func:`fresh_routing`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from services.model.lm_head import HeadPath, fused_head_available, realised_logprobs
from services.model.routing import moe_routers

__all__ = [
    "KernelPath",
    "decoder_hidden_states",
    "document_block_mask",
    "fresh_routing",
    "kernel_path",
    "packed_batches",
    "scoring_attention",
    "sequence_logprobs",
    "static_length",
]


@dataclass(frozen=True)
class KernelPath:
    """How one scoring call computes every one of its log-probs."""

    attention: str  # the model's attention implementation: sdpa, flex_attention, flash_attention_2, ...
    pack: bool  # several sequences per forward (document mask or varlen) or one per forward
    head: HeadPath  # the LM head's reduction: "chunked" (torch) or "fused" (Triton)
    dtype: torch.dtype


def packs_without_dense_mask(attention: str) -> bool:
    """Attention implementations whose packed forward costs what its sequences cost alone."""
    return attention == "flex_attention" or attention.startswith("flash")


def kernel_path(model: nn.Module, *, pack: bool | None = None, head: HeadPath | None = None) -> KernelPath:
    """The path a call takes: ``pack`` and ``head`` as given, else the best this model and device have."""
    parameter = next(model.parameters())
    attention = model.config._attn_implementation or "eager"
    if head == "fused" and not fused_head_available(parameter.device):
        raise ValueError(f"the fused LM head needs CUDA and Triton; the model is on {parameter.device}")
    return KernelPath(
        attention=attention,
        pack=packs_without_dense_mask(attention) if pack is None else pack,
        head=head or ("fused" if fused_head_available(parameter.device) else "chunked"),
        dtype=parameter.dtype,
    )


def scoring_attention(device: str, dtype: str = "bfloat16") -> str | None:
    """The attention implementation to load a scoring model with on ``device`` (None: transformers'
    default, SDPA): on CUDA flash attention's varlen kernels when installed and the model is in half
    precision (flash attention refuses float32), else flex attention (part of torch, no extra
    package); on CPU the default, where one sequence per forward is best."""
    if torch.device(device).type != "cuda":
        return None
    if dtype in ("bfloat16", "float16") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    from transformers.utils import is_torch_flex_attn_available

    return "flex_attention" if is_torch_flex_attn_available() else None


@contextlib.contextmanager
def fresh_routing(model: nn.Module) -> Iterator[None]:
    """Routers use their own top-k inside the block, whatever replay was installed on them."""
    lifted = []
    for router in moe_routers(model):
        patched = router.__dict__.pop("forward", None)
        if patched is not None:
            lifted.append((router, patched))
    try:
        yield
    finally:
        for router, patched in lifted:
            router.forward = patched


def packed_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that each group's total length stays within ``token_budget``
    (a longer sequence gets a group of its own). Longest first: first-fit decreasing."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                batches[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            batches.append([i])
            room.append(token_budget - lengths[i])
    return batches


FLEX_BLOCK = 128  # flex attention's default block, in tokens, on both axes


def document_block_mask(lengths: Sequence[int], device: torch.device | str):
    """Flex attention's mask for sequences of ``lengths`` packed end to end: token q attends to
    token k iff both lie in the same sequence and k <= q. Blocks that cross no sequence boundary
    are marked full and blocks between two sequences are skipped, so a packed forward costs about
    what its sequences cost one by one.

    The block structure follows from the lengths alone, so it is computed here rather than by
    ``create_block_mask``: uncompiled, that evaluates the n x n mask densely, and compiled, Triton
    took minutes to build its kernel for a 16,384-token forward on an H100 (benchmarks/README.md)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = int(sum(lengths))
    document = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.as_tensor(list(lengths), device=device)
    )

    def causal_within_document(batch, head, q, k):
        return (q >= k) & (document[q] == document[k])

    # documents are contiguous and in order, so a block is described by its first and last token's
    blocks = -(-n // FLEX_BLOCK)
    tail = torch.full((blocks * FLEX_BLOCK - n,), len(lengths), device=device)  # past the end: no one's
    ends = torch.cat([document, tail]).view(blocks, FLEX_BLOCK)
    first, last = ends[:, 0], ends[:, -1]
    q, k = torch.arange(blocks, device=device)[:, None], torch.arange(blocks, device=device)[None, :]
    below = k < q
    # kv-block k holds a token of q-block q's documents iff k's last document reaches q's first;
    # every pair is allowed iff both blocks lie in one document; the diagonal is always partial
    full = below & (first[None, :] == last[:, None])
    partial = (below & (last[None, :] >= first[:, None]) & ~full) | (k == q)

    def listed(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices  # chosen ones first
        return chosen.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(
        *listed(partial),
        *listed(full),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=causal_within_document,
        seq_lengths=(n, n),
    )


def static_length(n: int) -> int:
    """The padded length of an ``n``-token flex forward: ``n`` rounded up to a quarter of its power
    of two and to flex attention's 128-token block, so padding is under 128 tokens or at most 25%,
    and a service meets four shapes per doubling of its packed lengths."""
    quantum = max(FLEX_BLOCK, 1 << max(0, n.bit_length() - 3))
    return -(-n // quantum) * quantum


# Every static shape compiles once; a scorer meets a few dozen over its life, more than dynamo's
# default of 8 recompiles, past which it would run flex attention eagerly (densely) for good.
_STATIC_FLEX = {"automatic_dynamic_shapes": False, "recompile_limit": 64}


def decoder_hidden_states(
    base: nn.Module, ids: torch.Tensor, lengths: list[int], path: KernelPath
) -> torch.Tensor:
    """The decoder's last hidden states for sequences of ``lengths`` concatenated in ``ids``."""
    n = int(ids.numel())
    flex = path.attention == "flex_attention"
    if flex and (pad := static_length(n) - n):
        ids = torch.cat([ids, ids.new_zeros(pad)])
        lengths = [*lengths, pad]
    pos = torch.cat([torch.arange(k, device=ids.device) for k in lengths])
    if not flex:
        # transformers reads the documents off position_ids restarting at 0 (varlen for flash
        # attention, a dense block-diagonal mask for SDPA)
        return base(input_ids=ids[None], position_ids=pos[None], use_cache=False).last_hidden_state[0]
    # explicit, so every forward of the call (one sequence or many) runs the same masked kernel
    mask = document_block_mask(lengths, ids.device)
    with torch._dynamo.config.patch(_STATIC_FLEX):
        out = base(input_ids=ids[None], position_ids=pos[None], use_cache=False, attention_mask=mask)
    return out.last_hidden_state[0, :n]


def _base_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if base is None or head is None:
        raise TypeError("expected a causal LM with .model (the decoder) and .lm_head")
    return base, head


@torch.no_grad()
def sequence_logprobs(
    model: nn.Module,
    requests: Sequence[tuple[Sequence[int], np.ndarray]],
    *,
    token_budget: int = 16_384,
    chunk_size: int = 1024,
    pack: bool | None = None,
    head: HeadPath | None = None,
) -> list[np.ndarray]:
    """For each ``(ids, positions)``: log p(ids[p] | ids[:p]) for every p in ``positions`` (all p >= 1).
    ``pack`` and ``head`` default to :func:`kernel_path`'s choice for this model."""
    base, lm_head = _base_and_head(model)
    path = kernel_path(model, pack=pack, head=head)
    device = next(model.parameters()).device
    results: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(requests)
    for r, (ids, positions) in enumerate(requests):
        if len(positions) and (np.min(positions) < 1 or np.max(positions) >= len(ids)):
            raise ValueError(f"request {r}: positions must lie in [1, {len(ids) - 1}]")
    lengths = [len(ids) for ids, _ in requests]
    groups = packed_batches(lengths, token_budget) if path.pack else [[i] for i in np.argsort(lengths)[::-1]]
    with fresh_routing(model):
        for group in groups:
            group = [i for i in group if len(requests[i][1])]
            if not group:
                continue
            ids = torch.tensor([t for i in group for t in requests[i][0]], dtype=torch.long, device=device)
            hidden = decoder_hidden_states(base, ids, [lengths[i] for i in group], path)
            rows, targets, offset = [], [], 0
            for i in group:
                p = torch.as_tensor(np.asarray(requests[i][1]), dtype=torch.long, device=device) + offset
                rows.append(p - 1)  # the hidden state before a token predicts it
                targets.append(ids[p])
                offset += lengths[i]
            lp = realised_logprobs(
                hidden[torch.cat(rows)], lm_head, torch.cat(targets), chunk_size, path.head
            )
            lp = lp.cpu().numpy()
            cursor = 0
            for i in group:
                n = len(requests[i][1])
                results[i] = lp[cursor : cursor + n]
                cursor += n
    return results
