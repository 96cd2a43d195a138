"""MoE routing: recording which experts routed each token, and forcing recorded routes.

Recording (the rollout's in-process engine, like SGLang's ``--enable-return-routed-experts``):
a forward hook on every top-k router keeps its chosen expert indices, giving an array
``[tokens, moe_layers, top_k]`` per forward pass.

Replay (R3, the trainer's policy forward): :func:`replay_routes` patches every router so
that, instead of its own top-k, it uses the recorded indices for each token, while the
weights stay differentiable router probabilities gathered at those indices (and are
renormalised when the model normalises its top-k):

    p = softmax(W_r h)          (float32, as the model computes it)
    w_k = p[e_k] / sum_j p[e_j]  for the recorded experts e_1..e_K   (norm_topk_prob)

so the router still learns. A token whose recorded row is -1 routes fresh (the router's own
top-k), so a forward may replay some tokens and not others. Replay is a context manager bound
to one model and one forward; any other forward of that model, and every other model object,
routes fresh. The scorer enters it only for its replay ablation (services/scorer/replay.py),
whose privileged context holds tokens the rollout never saw.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["RouteRecorder", "moe_routers", "replay_routes"]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every MoE layer, in layer order (Qwen3-MoE's ``mlp.gate``)."""
    return [m for m in model.modules() if _is_router(m)]


def _is_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter")


class RouteRecorder:
    """Records the experts every router chose during the forwards run inside ``with recorder:``."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self._calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles: list = []

    def __enter__(self) -> RouteRecorder:
        for i, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            self._calls[layer].append(output[2].detach().to("cpu", torch.int32))

        return hook

    def take(self) -> np.ndarray:
        """Routes of every token fed since the last take: ``[tokens, layers, top_k]``; then resets."""
        if not self.routers or not self._calls[0]:
            return np.zeros((0, len(self.routers), 0), dtype=np.int32)
        per_layer = [torch.cat(calls, dim=0) for calls in self._calls]
        self._calls = [[] for _ in self.routers]
        return torch.stack(per_layer, dim=1).numpy()


@contextlib.contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """Within the block, every router of ``model`` uses ``routes[token, layer]`` as its experts.

    ``routes``: ``[tokens, moe_layers, top_k]`` for the flattened tokens of the next forward, or
    ``[tokens, num_hidden_layers, top_k]`` as SGLang returns them, a column for every decoder layer
    (a dense layer's, in a model with ``mlp_only_layers`` or ``decoder_sparse_step``, unused).
    A token whose row is negative routes fresh.
    """
    routers = moe_routers(model)
    width = routes.shape[1] if routes.dim() == 3 else None
    if width == len(routers):
        columns = list(range(len(routers)))
    elif width is not None and width == getattr(getattr(model, "config", None), "num_hidden_layers", None):
        columns = _router_layers(model)
    else:
        raise ValueError(
            f"routes must be [tokens, {len(routers)} MoE layers (or every decoder layer), top_k], "
            f"got {tuple(routes.shape)}"
        )
    originals = []
    for column, router in zip(columns, routers, strict=True):
        originals.append(router.forward)
        router.forward = _replaying_forward(router, routes[:, column, :])
    try:
        yield
    finally:
        for router, original in zip(routers, originals, strict=True):
            # restoring the bound method the instance had (the class method, unpatched)
            del router.forward
            if router.forward != original:
                router.forward = original


def _router_layers(model: nn.Module) -> list[int]:
    """The decoder layer of each router, in :func:`moe_routers`' order (``model.layers.{i}.mlp.gate``)."""
    layers = []
    for name, module in model.named_modules():
        if _is_router(module):
            match = re.search(r"layers\.(\d+)\.", name)
            if match is None:
                raise ValueError(f"cannot tell which decoder layer router {name} belongs to")
            layers.append(int(match.group(1)))
    return layers


def _replaying_forward(router: nn.Module, indices: torch.Tensor):
    def forward(hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        if hidden_states.shape[0] != indices.shape[0]:
            raise ValueError(
                f"replay has routes for {indices.shape[0]} tokens, the forward has {hidden_states.shape[0]}"
            )
        logits = nn.functional.linear(hidden_states, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        idx = indices.to(hidden_states.device, torch.long)
        fresh = idx[:, 0] < 0
        if fresh.any():  # the router's own choice, as its forward makes it (top-k of the float32 probs)
            idx = torch.where(fresh[:, None], torch.topk(probs, idx.shape[1], dim=-1).indices, idx)
        weights = probs.gather(1, idx)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), idx

    return forward
