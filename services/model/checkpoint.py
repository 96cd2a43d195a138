"""Hugging Face checkpoints on disk: the unit the trainer publishes and the others reload.

A checkpoint directory holds ``config.json``, ``model.safetensors`` (sharded when
large) and the tokenizer files, so SGLang (``/update_weights_from_disk``), the
in-process engine and the scorer all read the same thing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

__all__ = [
    "DTYPES",
    "dtype_name",
    "library_versions",
    "load_model",
    "load_weights_into",
    "read_meta",
    "save_checkpoint",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(model: torch.nn.Module) -> str:
    """The DTYPES name of ``model``'s parameters (what load_model takes to load it alike)."""
    return {v: k for k, v in DTYPES.items()}[next(model.parameters()).dtype]


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    model.to(device)
    model.eval()
    return model


def save_checkpoint(
    model: PreTrainedModel,
    path: str | Path,
    *,
    tokenizer=None,
    meta: dict | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` (and ``tokenizer``) as safetensors; ``meta`` goes to ``pbsd.json``. Atomic: written
    to a temporary sibling and renamed, so a reader never sees half a checkpoint. ``state_dict``
    replaces the model's own tensors (ZeRO-3 gathers them elsewhere)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    if getattr(model.config, "tie_word_embeddings", False):
        _write_tied_head(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if meta is not None:
        (tmp / "pbsd.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def _write_tied_head(directory: Path) -> None:
    """Store ``lm_head.weight`` beside the embeddings it is tied to. transformers leaves a tied
    head out of the file and ties it again on load, but SGLang's Qwen3-MoE loads ``lm_head``
    from the file only (no Qwen3-MoE release is tied, so it never ties): without this it would
    serve a tied policy (``pbsd model tiny --copy-heads``) with an untrained head. transformers
    reads the extra tensor back as the same tied matrix."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    index = directory / "model.safetensors.index.json"
    sharded = json.loads(index.read_text()) if index.exists() else None
    name = sharded["weight_map"]["model.embed_tokens.weight"] if sharded else "model.safetensors"
    shard = directory / name
    with safe_open(str(shard), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(shard))
    if "lm_head.weight" in tensors:
        return
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(shard), metadata=metadata)
    if sharded is not None:
        sharded["weight_map"]["lm_head.weight"] = name
        index.write_text(json.dumps(sharded, indent=2))


def library_versions() -> dict[str, str]:
    """The libraries a checkpoint's bytes depend on (tokenizer training, initialisation, training),
    recorded with it so that a rebuild can be compared like for like."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "tokenizers")}


def read_meta(path: str | Path) -> dict:
    """The checkpoint's ``pbsd.json`` (what made it: :func:`save_checkpoint`'s ``meta``); {} without one."""
    meta_file = Path(path) / "pbsd.json"
    return json.loads(meta_file.read_text()) if meta_file.exists() else {}


def stamp_world(path: str | Path, fingerprint: str) -> None:
    """Record in ``path``'s ``pbsd.json`` which world (``worldgen.build.world_fingerprint``) the
    checkpoint was supervised on; the demo reuses a warm policy only for that very world."""
    meta = read_meta(path) | {"world_sha256": fingerprint}
    (Path(path) / "pbsd.json").write_text(json.dumps(meta, indent=2, sort_keys=True))


def load_weights_into(model: PreTrainedModel, path: str | Path) -> None:
    """Replace ``model``'s weights by the checkpoint's, in place (same architecture).

    The checkpoint is read through ``from_pretrained``, which converts the Hub layout
    (transformers v5 saves MoE experts one by one, as SGLang reads them) into the
    in-memory one (fused expert tensors); reading the safetensors by hand would not.
    """
    source = AutoModelForCausalLM.from_pretrained(str(path), dtype=next(model.parameters()).dtype)
    target = model.state_dict()
    incoming = source.state_dict()
    if target.keys() != incoming.keys():
        raise ValueError(
            f"checkpoint {path} does not fit the model: {sorted(set(target) ^ set(incoming))[:5]} differ"
        )
    for name, tensor in target.items():  # every shape first: a refusal half-way would leave a mix
        if tensor.shape != incoming[name].shape:
            raise ValueError(
                f"checkpoint {path}: {name} has shape {tuple(incoming[name].shape)}, "
                f"the model {tuple(tensor.shape)}"
            )
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(incoming[name])
