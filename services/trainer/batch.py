"""From scored groups to training samples, a step's mini-batches (one optimiser update each) and
token-budget micro-batches (one forward and backward each).

A sample is one trajectory: its tokens but the last (the last token's hidden state
predicts nothing), the positions of its loss tokens, and per loss token the rollout
log-prob (pi_old, on-policy) and the advantage (GRPO: A_i; PBSD: w_{i,t} A_i, from the
scored group). Trajectories whose every advantage is exactly zero contribute exactly
zero loss and gradient; they are counted in the loss's normaliser (the paper averages
over all G trajectories of a group) but not computed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np

from proto.messages import ScoredGroup

__all__ = [
    "BatchCounts",
    "MiniBatch",
    "TrainSample",
    "micro_batches",
    "mini_batches",
    "samples_from_groups",
    "unfit",
]


@dataclass(frozen=True)
class TrainSample:
    trajectory_id: str
    input_ids: np.ndarray  # prompt + completion, without the last token
    positions: np.ndarray  # index in ``input_ids`` of the hidden state that predicts each loss token
    targets: np.ndarray  # the loss tokens
    old_logprobs: np.ndarray  # rollout log-probs of the loss tokens
    advantages: np.ndarray  # per loss token
    routes: np.ndarray | None  # [len(input_ids), layers, top_k] recorded experts, for routing replay
    # the sampling temperature ``old_logprobs`` are under: the engine's log-probs are of
    # softmax(logits / T), so the trainer's must be too, or every ratio starts away from 1
    temperature: float = 1.0
    # with tis_cap, pi_old is the policy before the step's first update; a later mini-batch's
    # samples carry it, computed before that update (the first mini-batch's is its own forward)
    policy_logprobs: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.size)


@dataclass(frozen=True)
class BatchCounts:
    """Normalisers of the whole optimiser batch (so micro-batch losses add up to the batch loss)."""

    sequences: int  # trajectories that count (every non-failed trajectory with loss tokens)
    tokens: int  # their loss tokens


@dataclass(frozen=True)
class MiniBatch:
    """One optimiser update: its samples and its own normalisers."""

    samples: list[TrainSample]
    counts: BatchCounts

    def with_policy_logprobs(self, logprobs: list[np.ndarray | None]) -> MiniBatch:
        """The same samples carrying pi_old as the policy before the step (None: left as it was)."""
        samples = [
            s if lp is None else replace(s, policy_logprobs=lp)
            for s, lp in zip(self.samples, logprobs, strict=True)
        ]
        return MiniBatch(samples, self.counts)


def mini_batches(groups: list[ScoredGroup], updates: int, *, seed: int, **how) -> list[MiniBatch]:
    """A step's groups as ``updates`` mini-batches of whole groups, sizes within one of each other
    (``how``: as :func:`samples_from_groups`). Which group lands where depends on the groups and
    the seed, not on the order they came in: groups arrive shortest first, and in arrival order
    the first update, the one nearest on-policy, would take the short trajectories every step."""
    if updates == 1:
        return [MiniBatch(*samples_from_groups(groups, **how))]
    order = sorted(groups, key=lambda g: g.group.task_id)
    random.Random(seed).shuffle(order)
    return [MiniBatch(*samples_from_groups(order[i::updates], **how)) for i in range(updates)]


def samples_from_groups(
    groups: list[ScoredGroup],
    *,
    with_routes: bool = False,
    temperature: float = 1.0,
    keep_zero_advantage: bool = False,
) -> tuple[list[TrainSample], BatchCounts]:
    """The trainable samples of ``groups`` (sampled at ``temperature``) and the batch's normalisers.
    A trajectory whose advantages are all zero adds nothing to the policy-gradient loss and is
    left out, unless ``keep_zero_advantage`` (a KL penalty still has a gradient there)."""
    if temperature <= 0:
        raise ValueError(f"training needs a sampling temperature > 0, got {temperature}")
    samples: list[TrainSample] = []
    sequences = tokens = 0
    for scored in groups:
        for i, t in enumerate(scored.group.trajectories):
            if t.finish_reason == "error" or not t.turn_spans:
                continue
            completion_loss = np.flatnonzero(t.loss_mask == 1)
            sequences += 1
            tokens += completion_loss.size
            advantages = scored.token_advantages(i)[completion_loss]
            if not keep_zero_advantage and not np.any(advantages):
                continue  # exactly zero loss and gradient: counted above, not computed
            full = np.concatenate([t.prompt_ids, t.completion_ids]).astype(np.int64)
            target_pos = completion_loss + t.prompt_ids.size
            routes = None
            if with_routes:
                if t.routed_experts is None:
                    raise ValueError(f"routing replay needs routed experts on trajectory {t.trajectory_id}")
                routes = t.routed_experts
            samples.append(
                TrainSample(
                    trajectory_id=t.trajectory_id,
                    input_ids=full[:-1],
                    positions=target_pos - 1,
                    targets=full[target_pos],
                    old_logprobs=t.rollout_logprobs[completion_loss].astype(np.float32),
                    advantages=advantages.astype(np.float32),
                    routes=routes,
                    temperature=temperature,
                )
            )
    return samples, BatchCounts(sequences=sequences, tokens=tokens)


def unfit(scored: ScoredGroup, vocab: int, experts: int | None = None) -> str | None:
    """Why ``scored`` cannot be trained on, or None. Checked as a group is admitted, so that one bad
    group (a scorer's bug, or whatever else wrote to the stream) is dropped, not trained on: a token
    id past the embedding fails the step and with it the run; a non-finite advantage or rollout
    log-prob on a loss token makes the loss NaN, and the optimiser writes NaN into every weight.
    ``experts``: under routing replay, the experts of each MoE layer; a recorded expert id outside
    them (an SGLang server with redundant experts records physical ids) fails the step's gather, on
    a GPU with a device-side assert. -1 is a row the router routes afresh."""
    for i, t in enumerate(scored.group.trajectories):
        if t.finish_reason == "error" or not t.turn_spans:
            continue  # never trained (samples_from_groups)
        if t.prompt_ids.size == 0:
            return f"trajectory {t.trajectory_id} has no prompt"
        ids = (t.prompt_ids, t.completion_ids)
        if any(x.size and (x.min() < 0 or x.max() >= vocab) for x in ids):
            return f"trajectory {t.trajectory_id} has token ids outside the vocabulary of {vocab}"
        routes = t.routed_experts
        routed = experts is not None and routes is not None and routes.size
        if routed and (routes.min() < -1 or routes.max() >= experts):
            return f"trajectory {t.trajectory_id} has routed experts outside the model's {experts}"
        loss = t.loss_mask == 1
        if not np.isfinite(scored.token_advantages(i)[loss]).all():
            return f"trajectory {t.trajectory_id} has non-finite advantages"
        if not np.isfinite(t.rollout_logprobs[loss]).all():
            return f"trajectory {t.trajectory_id} has non-finite rollout log-probs"
    return None


def micro_batches(samples: list[TrainSample], token_budget: int) -> list[list[TrainSample]]:
    """Consecutive samples grouped up to ``token_budget`` tokens; a longer sample is alone."""
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    used = 0
    for s in samples:
        if current and used + s.tokens > token_budget:
            batches.append(current)
            current, used = [], 0
        current.append(s)
        used += s.tokens
    if current:
        batches.append(current)
    return batches
