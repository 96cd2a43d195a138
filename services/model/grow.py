"""Deepen a trained model without changing what it computes (block expansion, as LLaMA Pro).

Each added decoder layer is a copy of an existing one whose two writes to the residual stream,
the attention's output projection and every expert's down projection, are zero:

    h + attn(h) + mlp(h + attn(h))  =  h      when  W_o = 0  and  W_down = 0

so the grown model's logits are the original's, token for token, until the added layers learn.
Their queries, keys, values, routers and up projections start as the source layer's, so once an
output projection moves off zero the layer already attends as the source does (for the lab
policy's last layer: its copy heads, which read an entity back from the context).

Why: PBSD's teacher is the policy. The lab's 2-layer policy, taught to read x* by the note pass,
copies the note into every slot like the answer's and loses reading when told not to
(docs/credit-signal.md, "Where the drift lives"): one frontier of drift against reading, which
looks like a limit of capacity. Added layers trained alone, the original frozen, test that: the
policy the original layers compute is kept, and new capacity learns the note.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

__all__ = ["grow", "grow_checkpoint", "train_only"]


def grow(model: nn.Module, count: int, *, after: int = -1, source: int | None = None) -> list[int]:
    """Insert ``count`` copies of decoder layer ``source`` (default ``after``) right after layer
    ``after`` (negative: from the end), their output projections zeroed, and renumber the layers
    (their cache slots) and the config. Returns the indices of the added layers."""
    layers = model.model.layers
    n = len(layers)
    source = after if source is None else source
    for name, index in (("after", after), ("source", source)):
        if not -n <= index < n:
            raise ValueError(f"{name}={index}: the model has {n} layers")
    after, source = after % n, source % n
    if count < 1:
        raise ValueError(f"count={count}: add at least one layer")
    cfg = model.config
    sparse = hasattr(layers[source].mlp, "experts") and not getattr(cfg, "mlp_only_layers", None)
    if not sparse or getattr(cfg, "decoder_sparse_step", 1) != 1 or getattr(cfg, "layer_types", None):
        raise ValueError("only mixture-of-experts models whose layers are all alike and sparse are supported")
    added = []
    for i in range(count):
        block = copy.deepcopy(layers[source])
        block.self_attn.config = cfg  # deepcopy copied the model's config too; share the one
        _silence(block)
        layers.insert(after + 1 + i, block)
        added.append(after + 1 + i)
    for idx, layer in enumerate(layers):
        layer.self_attn.layer_idx = idx  # its slot in the key-value cache
    cfg.num_hidden_layers = len(layers)
    return added


def train_only(model: nn.Module, layers: list[int]) -> int:
    """Freeze every weight but those of decoder ``layers`` (the embeddings, the final norm and the
    other layers stay as they are); returns how many weights will learn. Backward then stops at the
    lowest trainable layer, so training the top layers alone is cheaper than training them all."""
    n = len(model.model.layers)
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"layers {list(layers)}: the model has layers 0..{n - 1}")
    model.requires_grad_(False)
    for i in layers:
        model.model.layers[i].requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _silence(block: nn.Module) -> None:
    """Zero the block's writes to the residual stream: attention's output projection, the experts'
    down projections (a shared expert's too, where the architecture has one), biases included."""
    attn, mlp = block.self_attn, block.mlp
    writes = [
        attn.o_proj.weight,
        attn.o_proj.bias,
        mlp.experts.down_proj,
        getattr(mlp.experts, "down_proj_bias", None),
    ]
    if getattr(mlp, "shared_expert", None) is not None:
        writes += [mlp.shared_expert.down_proj.weight, mlp.shared_expert.down_proj.bias]
    for weight in writes:
        if weight is not None:
            weight.data.zero_()


def grow_checkpoint(
    model_dir: Path, out: Path, count: int, *, after: int = -1, source: int | None = None
) -> dict:
    """:func:`grow` on the checkpoint at ``model_dir``, written to ``out`` (its tokenizer beside it);
    ``pbsd.json`` keeps the starting checkpoint's record and adds ``grown``: the indices of every
    layer added so far, which ``pbsd teacher teach --train-layers grown`` trains alone, and this
    growth's source layer and earlier depth. (``config.json``'s ``pbsd_tiny_spec`` stays the spec
    the model was first built with.)"""
    from transformers import AutoTokenizer

    from services.model.checkpoint import load_model, read_meta, save_checkpoint

    model = load_model(model_dir)
    before = model.config.num_hidden_layers
    added = grow(model, count, after=after, source=source)
    meta = read_meta(model_dir)
    # a checkpoint grown before keeps its earlier layers in the record, renumbered past the new ones
    earlier = meta.get("grown", {}).get("added", [])
    earlier = [i + count if i > after % before else i for i in earlier]
    record = {
        "added": sorted(earlier + added),
        "source": (after if source is None else source) % before,
        "layers_before": before,
    }
    save_checkpoint(
        model,
        out,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        meta=meta | {"grown": record},
    )
    return record
