"""Evidence with the rollout's MoE routes replayed: the paper's Table 1 ablation "w/o non-replay
recompute" (``PbsdSpec.evidence_routing = "replay"``). The default, and the paper's method, is
fresh routing for both passes (:func:`services.scorer.logprobs.fresh_routing`).

Under replay the routers use the experts the rollout engine recorded for the student context
(``Trajectory.routed_experts``, one row per position but the last) instead of their own top-k:

- student context: every position uses the route recorded for it, as R3's training forward does;
- teacher context x*: a position whose token and whole left context are the student's (the
  common prefix of the two prompts: the system message, and the start of the user message as
  far as the template keeps it) uses the route recorded at the same position; a position after
  the rewritten part (the common suffix of the prompts, i.e. the end of the user message and the
  assistant's opening, and the whole completion) uses the route recorded at its student position
  ``q - shift``, with ``shift = len(teacher prompt) - len(student prompt)`` (phi's inverse). The
  rewritten part of the user message, which the rollout never saw, routes fresh;
- the null pass (:mod:`services.scorer.noise`): the student's routes, its appended tail fresh.

So every completion token of x* is routed as the rollout routed it in a context without the
answer: the artefact the paper removes by recomputing routes fresh.

Each sequence runs alone, its tokens but the last fed (the last token's hidden state predicts
nothing, and SGLang records no route for it), through the same LM head and float32 log-softmax
as the fresh passes (:func:`services.model.lm_head.realised_logprobs`). SGLang cannot force
routes on prompt tokens: replay needs the local backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from services.model.lm_head import HeadPath, realised_logprobs
from services.model.routing import replay_routes
from services.scorer.contexts import Contexts

__all__ = ["RoutedRequest", "context_routes", "position_map", "replayed_logprobs", "routes_at"]

RoutedRequest = tuple[Sequence[int], np.ndarray, np.ndarray]  # (ids, positions, routes for ids[:-1])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def position_map(student_prompt: Sequence[int], teacher_prompt: Sequence[int], length: int) -> np.ndarray:
    """For each of the first ``length`` teacher positions, the student position routed as it (the
    same position in the common prefix, ``q - shift`` after the rewritten part), or -1 (fresh)."""
    ps, pt = len(student_prompt), len(teacher_prompt)
    prefix = _common_prefix(student_prompt, teacher_prompt)
    room = min(ps, pt) - prefix
    suffix = min(_common_prefix(student_prompt[::-1], teacher_prompt[::-1]), room)
    q = np.arange(length)
    out = np.full(length, -1, dtype=np.int64)
    out[q < prefix] = q[q < prefix]
    after = q >= pt - suffix
    out[after] = q[after] - (pt - ps)
    return out


def routes_at(routes: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``routes[positions]``, with rows of -1 (fresh) where a position is -1 or unrecorded: in the
    narrowest signed type that holds the recorded experts (int16 for SGLang's uint8), since a
    64K-token context's routes at 48 layers and top-8 are 384 MiB as int64. The routers widen
    each layer's column as they use it."""
    routes = np.asarray(routes)
    out = np.full((positions.size, *routes.shape[1:]), -1, dtype=np.promote_types(routes.dtype, np.int16))
    known = (positions >= 0) & (positions < routes.shape[0])
    out[known] = routes[positions[known]]
    return out


def context_routes(recorded: np.ndarray, c: Contexts, prompt_length: int) -> list[np.ndarray]:
    """Routes for the fed positions of a trajectory's student and teacher contexts. (The null
    context's are ``routes_at(recorded, arange)``: its tail past the student routes fresh.)"""
    student = routes_at(recorded, np.arange(len(c.student) - 1))
    aligned = np.flatnonzero(c.phi >= 0)
    if not aligned.size:  # x* cut inside its own prompt: no completion token is scored there
        return [student, routes_at(recorded, np.full(len(c.teacher) - 1, -1))]
    shift = int(c.phi[aligned[0]] - c.loss_positions[aligned[0]])
    mapping = position_map(c.student[:prompt_length], c.teacher[: prompt_length + shift], len(c.teacher) - 1)
    return [student, routes_at(recorded, mapping)]


@torch.no_grad()
def replayed_logprobs(
    model: nn.Module, requests: Sequence[RoutedRequest], *, chunk_size: int = 1024, head: HeadPath = "chunked"
) -> list[np.ndarray]:
    """For each ``(ids, positions, routes)``: log p(ids[p] | ids[:p]) at ``positions``, with the
    routers forced to ``routes`` (``[len(ids) - 1, layers, top_k]``; rows of -1 route fresh)."""
    base, lm_head = model.model, model.lm_head
    device = next(model.parameters()).device
    out = []
    for r, (ids, positions, routes) in enumerate(requests):
        positions = np.asarray(positions, dtype=np.int64)
        if not positions.size:
            out.append(np.zeros(0, dtype=np.float32))
            continue
        if positions.min() < 1 or positions.max() >= len(ids):
            raise ValueError(f"request {r}: positions must lie in [1, {len(ids) - 1}]")
        if len(routes) != len(ids) - 1:
            raise ValueError(f"request {r}: {len(routes)} routes for {len(ids) - 1} fed tokens")
        tokens = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)
        fed = tokens[:-1]
        with replay_routes(model, torch.as_tensor(routes, device=device)):
            hidden = base(
                input_ids=fed[None],
                position_ids=torch.arange(fed.numel(), device=device)[None],
                use_cache=False,
            ).last_hidden_state[0]
        p = torch.as_tensor(positions, device=device)
        out.append(realised_logprobs(hidden[p - 1], lm_head, tokens[p], chunk_size, head).cpu().numpy())
    return out
