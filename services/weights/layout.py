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

        def revert(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
            return revert_weight_conversion(model, {key: tensor})

        pieces: list[Piece] = []
        for key, tensor in model.state_dict().items():
            if not tensor.is_contiguous():
                raise ValueError(f"{key} is not contiguous: it cannot be addressed in place")
            shape = tuple(tensor.shape)
            # most tensors are saved as they are held: a free trial on the meta device tells which
            ghost = torch.empty(shape, device="meta")
            if (out := revert(key, ghost)).keys() == {key} and out[key] is ghost:
                pieces.append(Piece(key, key, shape, tensor.dtype))
                continue
            rows = _rows(key, shape, revert)
            probe = None if rows is not None else _probe(shape)
            selections = rows or {
                n: (tuple(p.shape), *_selection(probe, p)) for n, p in revert(key, probe).items()
            }
            pieces += [
                Piece(n, key, s, tensor.dtype, start, index) for n, (s, start, index) in selections.items()
            ]
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


def _probe(shape: tuple[int, ...]) -> torch.Tensor:
    n = int(torch.Size(shape).numel())
    return torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64).view(shape)


def _rows(key: str, shape: tuple[int, ...], revert) -> dict[str, tuple] | None:
    """The selections of a tensor whose conversion moves whole rows (slices along the last dimension):
    learned from a probe of one element per row, ``shape[-1]`` times cheaper than one per element
    (an expert tensor of Qwen3-30B-A3B has 400M). Trusted only when every output keeps its rows
    whole (the same shape but for a last dimension of 1 where the full one has ``shape[-1]``), each
    is a run, and the runs tile the tensor; None otherwise (the caller probes every element)."""
    if len(shape) < 2 or shape[-1] == 1:
        return None
    width = shape[-1]
    small = _probe((*shape[:-1], 1))
    try:
        outputs, full = revert(key, small), revert(key, torch.empty(shape, device="meta"))
    except Exception:  # an operation that needs the real last dimension
        return None
    if outputs.keys() != full.keys():
        return None
    found, covered = {}, []
    for name, positions in outputs.items():
        size = tuple(full[name].shape)
        if tuple(positions.shape) != (*size[:-1], 1) or size[-1] != width:
            return None
        start, index = _selection(small, positions)
        if index is not None:
            return None
        found[name] = (size, start * width, None)
        covered.append((start, positions.numel()))
    covered.sort()
    ends = [s + n for s, n in covered]
    if (
        covered[0][0] != 0
        or ends[-1] != small.numel()
        or any(e != s for e, (s, _) in zip(ends[:-1], covered[1:], strict=True))
    ):
        return None
    return found


def _selection(probe: torch.Tensor, positions: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """Where ``positions`` (a reverted probe) lie in the probe: a run from ``start`` (index None), or
    the flat positions themselves."""
    if (
        positions.is_contiguous()
        and positions.untyped_storage().data_ptr() == probe.untyped_storage().data_ptr()
    ):
        return positions.storage_offset(), None  # a view of the probe: a run, read off without a pass
    flat = positions.reshape(-1)
    start = int(flat[0]) if flat.numel() else 0
    if torch.equal(flat, torch.arange(start, start + flat.numel(), dtype=flat.dtype)):
        return start, None
    return 0, flat.to(torch.int64).clone()


def digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over named tensors' names, dtypes, shapes and bytes, in name order: equal digests mean
    bitwise-equal weights, whichever layout holds them."""
    h = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        value = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
