"""Decoding many sequences in one forward, each row computed exactly as it would be alone.

A batched forward gives a row other bits than the same row alone, for three reasons, each
handled here:

- **The KV cache.** Rows of different lengths padded into one tensor move a row's keys, and with
  them the attention kernel's blocking. So every sequence keeps its own key and value buffers
  (:class:`SequenceKV`, grown in place: a token costs a write, not a copy of the cache), and
  attention runs row by row over exactly that row's keys (:func:`_rows_attention`).
- **Matrix products.** BLAS picks its kernel by the number of rows (one row is a matrix-vector
  product), and kernels sum in different orders. Inside :func:`batch_invariant`, every product of
  the model runs on blocks of exactly ``ROW_BLOCK`` rows (zero-padded), whatever the batch.
- **MoE experts.** Which tokens an expert sees depends on the batch; the grouped product runs
  per expert, again in blocks of ``ROW_BLOCK`` rows.

Row-wise operations (norms, rotary embeddings, softmax, activations, the router's top-k) give a
row the same bits in any batch already (tests/test_inprocess_engine.py checks the whole forward
bitwise). Only decoding uses the blocks: a prefill always runs alone.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from services.model.lm_head import float32_product

__all__ = ["NO_MASK", "ROW_BLOCK", "RowsCache", "SequenceKV", "batch_invariant", "install"]

ROW_BLOCK = 8  # rows per matrix product in batch-invariant mode
_GROWTH = 256  # buffers grow in multiples of this many positions (at least doubling)
# The model's mask builder returns a 4-D mask as it is; the row-wise attention needs none.
NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)
_state = threading.local()


class SequenceKV:
    """One sequence's keys and values, every layer: ``[1, kv_heads, capacity, head_dim]`` buffers
    of which the first ``length`` positions are filled."""

    def __init__(self, layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``[kv_heads, tokens, head_dim]`` after the filled positions; the
        layer's keys and values up to them. :meth:`advance` then moves ``length`` past them."""
        end = self.length + k.shape[1]
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or keys.shape[2] < end:
            keys, values = self._grown(keys, end, k), self._grown(values, end, v)
            self.keys[layer], self.values[layer] = keys, values
        keys[0, :, self.length : end] = k
        values[0, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]

    def _grown(self, old: torch.Tensor | None, needed: int, like: torch.Tensor) -> torch.Tensor:
        have = 0 if old is None else old.shape[2]
        capacity = max(needed, 2 * have)
        capacity = -(-capacity // _GROWTH) * _GROWTH
        new = like.new_empty((1, like.shape[0], capacity, like.shape[2]))
        if old is not None:
            new[:, :, : self.length] = old[:, :, : self.length]
        return new

    def advance(self, tokens: int) -> None:
        self.length += tokens

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (their buffers are overwritten later)."""
        self.length = min(self.length, length)

    def copy(self) -> SequenceKV:
        """An independent copy, with room for a turn to grow into."""
        twin = SequenceKV(len(self.keys))
        twin.length = self.length
        room = self.length + 2 * _GROWTH
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is not None:
                twin.keys[i] = twin._grown(None, room, k[0])
                twin.values[i] = twin._grown(None, room, v[0])
                twin.keys[i][:, :, : self.length] = k[:, :, : self.length]
                twin.values[i][:, :, : self.length] = v[:, :, : self.length]
        return twin


class _Rows:
    """Each row's keys (or values) for one layer: what :class:`RowsCache` hands the attention."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors


class RowsCache:
    """The ``cache`` a transformers forward gets: row ``b`` of the batch is ``rows[b]``."""

    is_compileable = False

    def __init__(self, rows: list[SequenceKV]) -> None:
        self.rows = rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = [], []
        for b, row in enumerate(self.rows):
            k, v = row.write(layer_idx, key_states[b], value_states[b])
            keys.append(k)
            values.append(v)
        return _Rows(keys), _Rows(values)

    def advance(self, tokens: int) -> None:
        for row in self.rows:
            row.advance(tokens)


def _rows_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Row ``b``'s queries ``[1, heads, q, head_dim]`` attend to exactly its own keys, causally."""
    outputs = []
    for b, (k, v) in enumerate(zip(key.tensors, value.tensors, strict=True)):
        q = query[b : b + 1]
        queries, keys = q.shape[2], k.shape[2]
        if queries == 1:
            outputs.append(_decode_row(q, k, v, scaling if scaling is not None else q.shape[-1] ** -0.5))
            continue
        mask = _chunk_mask(queries, keys, q.device) if 1 < queries < keys else None
        outputs.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None and queries > 1,
                scale=scaling,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        )
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.transpose(1, 2).contiguous(), None


def _chunk_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The mask of a chunk of ``queries`` tokens after ``keys - queries`` cached ones: causal from
    its own offset. Every layer of a forward asks for the same one, so the last is kept."""
    shape = (queries, keys, device)
    last = getattr(_state, "mask", None)  # per thread, as the batch-invariant mode is
    if last is None or last[0] != shape:
        last = _state.mask = (
            shape,
            torch.ones((queries, keys), dtype=torch.bool, device=device).tril(keys - queries),
        )
    return last[1]


def _decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query ``[1, heads, 1, head_dim]`` over keys and values ``[1, kv_heads, n, head_dim]``:
    softmax(q K^T * scale) V, query head ``h`` reading key head ``h // group`` (as ``enable_gqa``
    repeats them). Three products on the row's own tensors: SDPA's CPU kernel costs more than
    that for a single query (its blocking and bookkeeping are made for many)."""
    heads, dim = q.shape[1], q.shape[3]
    kv_heads = k.shape[1]
    scores = torch.matmul(q.reshape(kv_heads, heads // kv_heads, dim), k[0].transpose(1, 2)).mul_(scale)
    return torch.matmul(torch.softmax(scores, dim=-1), v[0]).reshape(1, heads, 1, dim)


def _attention_for(model: nn.Module, previous: str):
    """The row-wise attention, which for any other caller (a training forward of the same model,
    a reference forward in a test) is the model's own ``previous`` implementation."""
    if previous in AttentionInterface._global_mapping:
        fallback = AttentionInterface._global_mapping[previous]
    else:  # "eager" is each modeling file's own function
        fallback = sys.modules[type(model).__module__].eager_attention_forward

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(key, _Rows):
            return _rows_attention(module, query, key, value, attention_mask, *args, **kwargs)
        return fallback(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def install(model: nn.Module) -> None:
    """Prepare ``model`` for row-wise decoding (idempotent): its attention takes a
    :class:`RowsCache`, and its products follow :func:`batch_invariant`. Outside that mode and
    without a :class:`RowsCache` the model computes what it computed before."""
    if getattr(model, "_pbsd_rowwise", False):
        return
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError("the in-process engine decodes full-attention models only (sliding_window is set)")
    previous = config._attn_implementation or "eager"
    # the registry is global: an eager fallback is its modeling file's, so it is named after it
    name = f"pbsd-rows:{previous}" if previous != "eager" else f"pbsd-rows:eager:{type(model).__module__}"
    AttentionInterface.register(name, _attention_for(model, previous))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    model.set_attn_implementation(name)
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = _invariant_linear(module, logits=module is head)
        elif not isinstance(module, nn.Embedding) and any(
            p.dim() >= 2 for p in module.parameters(recurse=False)
        ):
            module.forward = _under_products_mode(module.forward)  # a router, the experts
    model._pbsd_rowwise = True


@contextmanager
def batch_invariant() -> Iterator[None]:
    """Within the block (on this thread), the model's products run in blocks of ROW_BLOCK rows."""
    _state.on = True
    try:
        yield
    finally:
        _state.on = False


def _active() -> bool:
    return getattr(_state, "on", False)


def _invariant_linear(module: nn.Linear, *, logits: bool = False):
    # the head's logits in float32, as the trainer's and the scorer's (services.model.lm_head): the
    # rollout's log-probs, pi_old in the ratio, then carry no bfloat16 rounding of them
    product = float32_product if logits else F.linear

    def forward(x: torch.Tensor) -> torch.Tensor:
        if _active():
            return _blocked_linear(x, module.weight, module.bias, product)
        return product(x, module.weight, module.bias)

    return forward


def _under_products_mode(plain):
    def forward(*args, **kwargs):
        if not _active():
            return plain(*args, **kwargs)
        with _BlockedProducts():
            return plain(*args, **kwargs)

    return forward


class _BlockedProducts(TorchFunctionMode):
    """Linear maps and grouped (per-expert) products inside a router or an experts module."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return _blocked_linear(*args, **kwargs)
        if func is torch._grouped_mm and kwargs.get("offs") is not None:  # F.grouped_mm's kernel
            return _blocked_grouped_mm(*args, **kwargs)
        return func(*args, **kwargs)


def _blocked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, product=F.linear
) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = _blocked(flat, lambda rows: product(rows, weight, bias))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _blocked_grouped_mm(mat_a, mat_b, *, offs, bias=None, out_dtype=None) -> torch.Tensor:
    """``mat_a`` ``[tokens, k]`` sorted by group, group ``g`` (rows up to ``offs[g]``) times
    ``mat_b[g]`` ``[k, n]``; rows after the last group are zero."""
    if bias is not None or out_dtype not in (None, mat_a.dtype):
        raise ValueError("row-wise decoding supports grouped products without a bias, in the input dtype")
    out = mat_a.new_zeros((mat_a.shape[0], mat_b.shape[-1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = _blocked(mat_a[start:end], lambda rows, w=mat_b[g]: torch.mm(rows, w))
        start = end
    return out


def _blocked(rows: torch.Tensor, product) -> torch.Tensor:
    """``product`` over ``rows`` in zero-padded blocks of exactly ROW_BLOCK rows."""
    m = rows.shape[0]
    padded = -(-m // ROW_BLOCK) * ROW_BLOCK
    if padded != m:
        full = rows.new_zeros((padded, rows.shape[1]))
        full[:m] = rows
        rows = full
    blocks = [product(rows[i : i + ROW_BLOCK]) for i in range(0, padded, ROW_BLOCK)]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:m]
