"""The checkpoint layout of a model's tensors, as slices of the tensors the model holds.

A weight broadcast names its tensors as a Hugging Face checkpoint does, because that is what
SGLang's ``model.load_weights`` reads: transformers v5 keeps a Qwen3-MoE layer's experts fused
in memory (``mlp.experts.gate_up_proj``, ``[experts, 2 * intermediate, hidden]``) and writes
them one by one (``mlp.experts.{e}.gate_proj.weight``, ``...up_proj.weight``, ...). Each
checkpoint tensor is a fixed selection of the elements of one in-memory tensor, so both sides
of a broadcast address it in place: the sender broadcasts a view of its parameter, a receiver
receives into a view of its own, and neither copies the model.

The selection is learned once per model by reverting a probe: the in-memory tensor ``p`` is
replaced by ``arange(p.numel())`` in its shape and put through transformers' own
``revert_weight_conversion`` (what ``save_pretrained`` writes), one tensor at a time; every
checkpoint tensor that comes out holds the flat positions of ``p`` it is made of. A run of
consecutive positions is a :class:`Piece` with a ``start``; any other selection (a transpose)
keeps its positions and is gathered and scattered element by element.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HubLayout", "Piece", "digest"]


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor: ``name`` in the checkpoint, made of elements of ``param`` (a
    ``state_dict`` key): ``numel`` consecutive ones from ``start``, or those at ``index``."""

    name: str
    param: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int = 0
    index: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class HubLayout:
    """Where each checkpoint tensor of ``model`` lives in the model (see the module docstring).

    ``pieces`` follow the model's ``state_dict`` order; a tied head appears under both of its
    names, as the checkpoint files the trainer writes carry it (SGLang's Qwen3-MoE reads
    ``lm_head.weight`` from the file)."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        pieces: list[Piece] = []
        for key, tensor in model.state_dict().items():
            if not tensor.is_contiguous():
                raise ValueError(f"{key} is not contiguous: it cannot be addressed in place")
            n = tensor.numel()
            probe = torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64).view(tensor.shape)
            for name, positions in revert_weight_conversion(model, {key: probe}).items():
                flat = positions.reshape(-1)
                run = flat.numel() > 0 and bool((flat[1:] - flat[:-1] == 1).all())
                start = int(flat[0]) if flat.numel() else 0
                index = None if run else flat.to(torch.int64).clone()
                pieces.append(Piece(name, key, tuple(positions.shape), tensor.dtype, start, index))
        names = [p.name for p in pieces]
        if len(set(names)) != len(names):
            raise ValueError("two in-memory tensors map to the same checkpoint name")
        self.pieces = pieces
        self.by_name = {p.name: p for p in pieces}

    def view(self, state: dict[str, torch.Tensor], piece: Piece) -> torch.Tensor:
        """The piece in ``state`` (the model's ``state_dict``): a view sharing the model's memory,
        or, for a scattered selection, a gathered copy."""
        flat = state[piece.param].view(-1)
        if piece.index is None:
            return flat[piece.start : piece.start + piece.numel].view(piece.shape)
        return flat[piece.index.to(flat.device)].view(piece.shape)

    def write(self, state: dict[str, torch.Tensor], piece: Piece, value: torch.Tensor) -> None:
        """Put ``value`` (the checkpoint tensor) where the piece lives in the model, cast to its dtype."""
        if tuple(value.shape) != piece.shape:
            raise ValueError(f"{piece.name}: shape {tuple(value.shape)}, the model's is {piece.shape}")
        flat = state[piece.param].view(-1)
        with torch.no_grad():
            if piece.index is None:
                flat[piece.start : piece.start + piece.numel].copy_(value.reshape(-1))
            else:
                flat.index_copy_(0, piece.index.to(flat.device), value.reshape(-1).to(flat.dtype))

    def tensors(self, model: nn.Module) -> Iterator[tuple[Piece, torch.Tensor]]:
        """Every checkpoint tensor of ``model`` with its piece, in order."""
        state = model.state_dict()
        for piece in self.pieces:
            yield piece, self.view(state, piece)

    def digest(self, model: nn.Module) -> str:
        """:func:`digest` of the model's checkpoint tensors."""
        state = model.state_dict()
        return digest((p.name, self.view(state, p)) for p in self.pieces)


def digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over named tensors' names, dtypes, shapes and bytes, in name order: equal digests mean
    bitwise-equal weights, whichever layout holds them."""
    h = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        value = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
