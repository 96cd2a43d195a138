"""The generation engine interface: token ids in, token ids (with log-probs) out.

Both engines (SGLang over HTTP, the in-process transformers engine) answer with the
same :class:`GenerationResult`: the exact output ids the engine sampled (a stop token
included), the log-prob of each under the sampling distribution (after temperature),
why generation stopped, and, when asked, the MoE experts that routed every position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

__all__ = ["ContextFull", "Engine", "EngineError", "GenerationRequest", "GenerationResult"]


class EngineError(Exception):
    """Generation failed for good (after retries and failover)."""


class ContextFull(EngineError):
    """The server refused a request for its own context length, smaller than the run's
    ``max_context``: the trajectory has reached the context the policy can have, as it would at the
    run's own limit. ``limit`` is the server's context length where it said."""

    def __init__(self, message: str, limit: int | None) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # first position whose routes are wanted
    seed: int | None = None
    session: str | None = None  # the trajectory: engines keep its cache warm across turns


@dataclass(frozen=True)
class GenerationResult:
    output_ids: list[int]
    logprobs: list[float]
    finish: Literal["stop", "length", "abort"]
    weight_version: int
    routed_experts: np.ndarray | None = (
        None  # [positions from routed_experts_start_len to the last but one, layers, top_k]
    )
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    message: str = ""  # abort reason
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)
    # the engine asked for fewer new tokens than the request did, to fit its server's context (shorter
    # than the run's max_context): a "length" finish is then the context's, not the turn's limit
    context_limited: bool = False


class Engine(Protocol):
    weight_version: int

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    # timeline: what a server is told its weights are a version of (services.weights.tags)
    async def update_weights(self, path: str, version: int, timeline: str = "") -> None: ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...
