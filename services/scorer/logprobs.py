"""Log-probabilities of realised tokens, fast: packed sequences, token budgets, chunked log-softmax.

``sequence_logprobs(model, requests)`` returns, for each request ``(ids, positions)``,
``log p(ids[p] | ids[:p])`` at the requested positions. Student and teacher
sequences go through this one procedure together, so both passes share weights,
kernels and numerics; their difference measures the privileged context and nothing else.

How it stays fast and small:

* Batches are filled up to ``token_budget`` tokens, longest first. A batch is one
  *packed* forward (sequences concatenated, ``position_ids`` restarting at 0, no
  attention mask, so transformers builds a block-diagonal mask, or uses varlen
  kernels with flash attention) when ``pack=True``; with ``pack=False`` (the default on
  CPU, where attention over a packed mask costs the square of the packed length) each
  sequence runs alone. Either way no pad token is ever computed.
* Only the hidden states that predict a requested token are kept, and they go
  through the LM head ``chunk_size`` rows at a time: each chunk's logits are reduced
  to ``logsumexp`` and the realised token's logit at once, so full-vocabulary float32
  logits never exist for more than one chunk.
* ``torch.no_grad`` and the model's own dtype throughout; log-softmax in float32.
* MoE routing is computed fresh: any routing replay installed on the model's routers
  is lifted for the duration (:func:`fresh_routing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from services.model.routing import moe_routers

__all__ = ["fresh_routing", "packed_batches", "sequence_logprobs", "token_logprobs"]


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


def token_logprobs(
    hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """log softmax(lm_head(hidden))[targets] row by row, ``chunk_size`` rows of logits at a time."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        logits = lm_head(hidden[start : start + chunk_size]).float()
        chosen = logits.gather(1, targets[start : start + chunk_size, None])[:, 0]
        out[start : start + chunk_size] = chosen - torch.logsumexp(logits, dim=-1)
        del logits
    return out


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
    pack: bool = False,
) -> list[np.ndarray]:
    """For each ``(ids, positions)``: log p(ids[p] | ids[:p]) for every p in ``positions`` (all p >= 1)."""
    base, head = _base_and_head(model)
    device = next(model.parameters()).device
    results: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(requests)
    for r, (ids, positions) in enumerate(requests):
        if len(positions) and (np.min(positions) < 1 or np.max(positions) >= len(ids)):
            raise ValueError(f"request {r}: positions must lie in [1, {len(ids) - 1}]")
    lengths = [len(ids) for ids, _ in requests]
    groups = packed_batches(lengths, token_budget) if pack else [[i] for i in np.argsort(lengths)[::-1]]
    with fresh_routing(model):
        for group in groups:
            group = [i for i in group if len(requests[i][1])]
            if not group:
                continue
            ids = torch.tensor([t for i in group for t in requests[i][0]], dtype=torch.long, device=device)
            pos = torch.cat([torch.arange(lengths[i], device=device) for i in group])
            hidden = base(input_ids=ids[None], position_ids=pos[None], use_cache=False).last_hidden_state[0]
            rows, targets, offset = [], [], 0
            for i in group:
                p = torch.as_tensor(np.asarray(requests[i][1]), dtype=torch.long, device=device) + offset
                rows.append(p - 1)  # the hidden state before a token predicts it
                targets.append(ids[p])
                offset += lengths[i]
            lp = token_logprobs(hidden[torch.cat(rows)], head, torch.cat(targets), chunk_size).cpu().numpy()
            cursor = 0
            for i in group:
                n = len(requests[i][1])
                results[i] = lp[cursor : cursor + n]
                cursor += n
    return results
