"""From a trajectory group to a scored group: advantages, per-turn evidence, per-turn weights.

For a PBSD group, every trajectory's student and teacher contexts are scored in one
batch of likelihood passes, then (``pbsd.credit``)::

    A_i     = group_advantages(rewards)
    s_{i,t} = turn_evidence(student, teacher, token_turns)   # mean over aligned tokens
    w_{i,t} = turn_weights(s_{i,t}, A_i, delta, clip, eps+, eps-)

A GRPO group passes through without likelihood passes: the same advantages, weights
of 1, evidence NaN, so both algorithms share every other line of the pipeline.

Trajectories that ended in an error (engine or gateway failure) carry no signal about
the policy: they are left out of the group statistics and get A = 0, w = 1.

The same call also scores the null pass of a sample of the group's student contexts
(:mod:`services.scorer.noise`), and the diagnostics carry the teacher sanity figures
(:mod:`services.scorer.sanity`) and the noise floor beside the paper's figure-3 statistics.
Both passes route MoE tokens fresh; ``evidence_routing = "replay"`` is the paper's ablation
that forces the rollout's routes instead (:mod:`services.scorer.replay`).

Both passes score the model's own likelihood (temperature 1) whatever temperature the
rollout sampled at: s is how much the privileged context changes the model's belief in a
turn, which a sampling temperature would only rescale; it is also what SGLang's prompt
log-probs are (they are not temperature-scaled by default). The trainer, whose ratios
must match the engine's sampling log-probs, is the one that divides by T.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import numpy as np

from agent.chat import ChatTokenizer
from pbsd import credit
from proto.messages import ScoredGroup, ScoreDiagnostics, TrajectoryGroup
from proto.runs import PbsdSpec
from proto.sanity import NoiseFloor
from services.scorer.contexts import Contexts, group_contexts
from services.scorer.noise import null_floor, null_picks, null_request
from services.scorer.replay import RoutedRequest, context_routes, routes_at
from services.scorer.sanity import tally_sanity, turn_kinds

__all__ = ["LogProbs", "LogprobFn", "ReplayFn", "Request", "group_advantages", "score_group"]

Request = tuple[Sequence[int], np.ndarray]  # token ids, and the positions whose log-probs are wanted


class LogProbs(list):
    """A backend's answer: one array of log-probs a request, and the policy version of the weights
    that computed them (None: not known). The version is read where the passes ran, under the
    backend's lock or from the servers' answers, since weights may change while a call waits."""

    def __init__(self, values=(), version: int | None = None) -> None:
        super().__init__(values)
        self.version = version


class LogprobFn(Protocol):
    """A scorer backend: each request's log-probs at its positions. Requests that share a number in
    ``pairs`` are one trajectory's passes (student, teacher, null): s is their difference, so they
    must see the same weights on the same server (:class:`services.scorer.backends.SglangScorer`);
    None: no request is tied to another."""

    async def __call__(
        self, requests: Sequence[Request], pairs: Sequence[int] | None = None
    ) -> list[np.ndarray]: ...  # a LogProbs where the backend knows its weights' version


# the same with each request's MoE routes forced (services.scorer.replay)
ReplayFn = Callable[[Sequence[RoutedRequest]], Awaitable[list[np.ndarray]]]


def group_advantages(group: TrajectoryGroup) -> np.ndarray:
    """A_i over the trajectories that did not fail; failed ones get 0."""
    valid = np.array([t.finish_reason != "error" for t in group.trajectories])
    adv = np.zeros(len(group.trajectories), dtype=np.float64)
    if valid.any():
        adv[valid] = credit.group_advantages(group.rewards[valid])
    return adv


async def score_group(
    group: TrajectoryGroup,
    tokenizer: ChatTokenizer,
    logprobs: LogprobFn | None,
    *,
    replayed: ReplayFn | None = None,
    message_id: str | None = None,
) -> ScoredGroup:
    started = time.perf_counter()
    adv = group_advantages(group)
    algo = group.algorithm
    extra = {"message_id": message_id} if message_id else {}
    if not isinstance(algo, PbsdSpec):
        return ScoredGroup(
            group=group,
            advantages=adv.astype(np.float32),
            turn_evidence=tuple(np.full(t.num_turns, np.nan, np.float32) for t in group.trajectories),
            turn_weights=tuple(np.ones(t.num_turns, np.float32) for t in group.trajectories),
            scored=False,
            diagnostics=ScoreDiagnostics(turns=sum(t.num_turns for t in group.trajectories)),
            scoring_s=time.perf_counter() - started,
            **extra,
        )
    if logprobs is None:
        raise ValueError("a PBSD group needs a likelihood function")

    contexts = group_contexts(group, tokenizer)
    scored_idx = [i for i, c in enumerate(contexts) if c is not None]
    nulls = null_picks(scored_idx, algo.noise_floor_samples)
    requests: list[Request] = []
    for i in scored_idx:
        c = contexts[i]
        requests += [(c.student, c.loss_positions), (c.teacher, c.phi[c.phi >= 0])]
    requests += [null_request(contexts[i]) for i in nulls]
    pairs = [i for i in scored_idx for _ in range(2)] + nulls  # a trajectory's passes, together
    # reading the turns back as text needs no likelihood: it runs beside the passes
    answers, kinds = await asyncio.gather(
        _likelihoods(group, contexts, scored_idx, nulls, requests, pairs, logprobs, replayed),
        asyncio.to_thread(turn_kinds, group, tokenizer),
    )

    evidence, weights, ceilings, all_s = [], [], [], []
    unaligned = 0
    student_of: dict[int, np.ndarray] = {}
    cursor = 0
    for i, (t, c) in enumerate(zip(group.trajectories, contexts, strict=True)):
        if c is None:
            evidence.append(np.full(t.num_turns, np.nan, np.float32))
            weights.append(np.ones(t.num_turns, np.float32))
            ceilings.append(np.full(t.num_turns, np.nan))
            continue
        student, teacher_aligned = answers[cursor], answers[cursor + 1]
        student_of[i] = student
        cursor += 2
        teacher = np.full(len(c.phi), np.nan)
        teacher[c.phi >= 0] = teacher_aligned
        unaligned += int((c.phi < 0).sum())
        s = credit.turn_evidence(student, teacher, c.token_turns, reduce=algo.reduce, num_turns=t.num_turns)
        w = credit.turn_weights(
            s, adv[i], delta=algo.delta, clip=algo.clip, eps_pos=algo.eps_pos, eps_neg=algo.eps_neg
        )
        # the largest s any teacher could give (its log-probs at 0 on every aligned token)
        best = np.where(np.isnan(teacher), np.nan, 0.0)
        ceilings.append(
            credit.turn_evidence(student, best, c.token_turns, reduce=algo.reduce, num_turns=t.num_turns)
        )
        evidence.append(s.astype(np.float32))
        weights.append(w.astype(np.float32))
        all_s.append(s[~np.isnan(s)])
    noise = NoiseFloor()
    for i, null in zip(nulls, answers[cursor:], strict=True):
        noise += null_floor(student_of[i], null, contexts[i], algo)
    scored = np.concatenate(all_s) if all_s else np.zeros(0)
    diagnostics = ScoreDiagnostics(
        turns=sum(t.num_turns for t in group.trajectories),
        scored_turns=int(scored.size),
        teacher_higher_frac=float((scored > 0).mean()) if scored.size else 0.0,
        mean_abs_gap=float(np.abs(scored).mean()) if scored.size else 0.0,
        filtered_frac=float(((scored >= -algo.eps_neg) & (scored <= algo.eps_pos)).mean())
        if scored.size
        else 0.0,
        unaligned_tokens=unaligned,
        evidence=scored.astype(np.float32),
        sanity=tally_sanity(kinds, evidence, ceilings, algo),
        noise=noise,
    )
    return ScoredGroup(
        group=group,
        advantages=adv.astype(np.float32),
        turn_evidence=tuple(evidence),
        turn_weights=tuple(weights),
        scored=True,
        scorer_policy_version=getattr(answers, "version", None),
        diagnostics=diagnostics,
        scoring_s=time.perf_counter() - started,
        **extra,
    )


async def _likelihoods(
    group: TrajectoryGroup,
    contexts: list[Contexts | None],
    scored: list[int],
    nulls: list[int],
    requests: list[Request],
    pairs: list[int],
    logprobs: LogprobFn,
    replayed: ReplayFn | None,
) -> list[np.ndarray]:
    """The requests' log-probs in one call: fresh routing, or the rollout's routes replayed
    (``evidence_routing``; the routes of each request as :mod:`services.scorer.replay` maps them)."""
    if not requests:
        return []
    if group.algorithm.evidence_routing == "fresh":
        return await logprobs(requests, pairs)
    if replayed is None:
        raise ValueError(
            "evidence_routing 'replay' needs a scorer that can force MoE routes (the local backend)"
        )
    for i in scored:
        t = group.trajectories[i]
        if t.routed_experts is None:
            raise ValueError(
                f"evidence_routing 'replay': trajectory {t.trajectory_id} carries no routed experts"
            )

    def mapped() -> list[np.ndarray]:
        routes: list[np.ndarray] = []
        for i in scored:
            t = group.trajectories[i]
            routes += context_routes(t.routed_experts, contexts[i], t.prompt_ids.size)
        return routes + [
            routes_at(group.trajectories[i].routed_experts, np.arange(len(ids) - 1))
            for i, (ids, _) in zip(nulls, requests[2 * len(scored) :], strict=True)
        ]

    # about a second and hundreds of MB a 64K-token trajectory: off the event loop, which keeps the
    # group's heartbeat and the health probes
    routes = await asyncio.to_thread(mapped)
    return await replayed([(ids, pos, r) for (ids, pos), r in zip(requests, routes, strict=True)])
