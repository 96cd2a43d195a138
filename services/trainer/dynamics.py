"""The paper's training dynamics of one batch, as the trainer records them per step.

Reward and accuracy, turns and tokens per trajectory, staleness, how long sampling and
scoring took, the credit signal's diagnostics (teacher-higher fraction, mean |s|, filtered
fraction) weighted by scored turns, the teacher sanity figures and the evidence's noise floor
(:mod:`proto.sanity`, summed over the batch's groups), and how grounded the batch's searches, reads and answers
are (:mod:`agent.grounding`, on a spread sample of the batch).
"""

from __future__ import annotations

import math
import statistics

from agent.chat import ChatTokenizer
from agent.grounding import Grounding
from agent.transcript import turn_texts
from proto.messages import ScoredGroup
from proto.sanity import NoiseFloor, TeacherSanity

__all__ = ["GROUNDING_SAMPLE", "batch_metrics", "covered_seconds", "sanity_figures", "sanity_metrics"]


def covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _slowest(scored: ScoredGroup) -> float:
    return max((t.generation_s for t in scored.group.trajectories), default=0.0)


GROUNDING_SAMPLE = 64  # trajectories per step whose grounding is measured


def batch_metrics(
    groups: list[ScoredGroup], version: int, tokenizer: ChatTokenizer | None = None
) -> dict[str, float]:
    """The paper's training dynamics for one batch: reward, accuracy, turns and tokens, the credit signal;
    with ``tokenizer``, the fraction of grounded searches, reads and answers (:mod:`agent.grounding`)."""
    trajs = [t for g in groups for t in g.group.trajectories]
    valid = [t for t in trajs if t.finish_reason != "error"]
    out: dict[str, float] = {
        "groups": float(len(groups)),
        "trajectories": float(len(trajs)),
        "failed": float(len(trajs) - len(valid)),
        "reward_mean": statistics.fmean(t.reward for t in valid) if valid else 0.0,
        "accuracy": statistics.fmean(float(t.reward > 0) for t in valid) if valid else 0.0,
        "turns_mean": statistics.fmean(t.num_turns for t in valid) if valid else 0.0,
        "tokens_mean": statistics.fmean(t.num_tokens for t in valid) if valid else 0.0,
        "generated_tokens_mean": statistics.fmean(int(t.loss_mask.sum()) for t in valid) if valid else 0.0,
        "staleness_mean": statistics.fmean(version - g.group.policy_version for g in groups)
        if groups
        else 0.0,
        "scoring_s_mean": statistics.fmean(g.scoring_s for g in groups) if groups else 0.0,
        # the wall time during which any of the batch's groups was being sampled (a group is sampled
        # until its slowest sample ends): groups run concurrently and share the engine, so this,
        # not a sum, is the rollout time the pipeline can hide
        "rollout_s_wall": covered_seconds(
            [(g.group.created_at - _slowest(g), g.group.created_at) for g in groups]
        ),
        "scoring_s_sum": sum(g.scoring_s for g in groups),
    }
    if tokenizer is not None:
        # reading trajectories back as text runs at ~1M tokens/s: a spread of at most
        # GROUNDING_SAMPLE trajectories estimates the fractions (the paper's 512 x 64K-token batch
        # would take half a minute a step)
        pairs = [
            (g.group.question, t) for g in groups for t in g.group.trajectories if t.finish_reason != "error"
        ]
        grounding = Grounding()
        stride = max(1, math.ceil(len(pairs) / GROUNDING_SAMPLE))
        for question, t in pairs[::stride]:
            grounding.add(question, turn_texts(t.completion_ids, t.turn_spans, tokenizer), t.final_answer)
        for kind, part in grounding.summary().items():
            if part["total"]:  # a batch with no reads says nothing about reads
                out[f"grounded_{kind}_frac"] = part["fraction"]
    # how many versions the evidence scorer's weights were behind the trainer's (it scores with
    # the latest weights it has loaded; a lagging scorer is otherwise invisible)
    lags = [
        version - g.scorer_policy_version for g in groups if g.scored and g.scorer_policy_version is not None
    ]
    if lags:
        out["scorer_lag_mean"] = statistics.fmean(lags)
    scored = [g.diagnostics for g in groups if g.scored]
    turns = sum(d.scored_turns for d in scored)
    if turns:
        out["teacher_higher_frac"] = sum(d.teacher_higher_frac * d.scored_turns for d in scored) / turns
        out["mean_abs_gap"] = sum(d.mean_abs_gap * d.scored_turns for d in scored) / turns
        out["filtered_frac"] = sum(d.filtered_frac * d.scored_turns for d in scored) / turns
        out["scored_turns"] = float(turns)
    if scored:
        out |= sanity_metrics([g for g in groups if g.scored])
    return out


def sanity_metrics(groups: list[ScoredGroup]) -> dict[str, float]:
    """The teacher sanity figures and the noise floor of scored groups, from their summed counts
    (exact over the union, not a mean of group means), and the fraction of their scored turns whose
    |s| lies within the floor measured over all of them (:class:`proto.sanity.NoiseFloor`)."""
    return sanity_figures(
        sum((g.diagnostics.sanity for g in groups), TeacherSanity()),
        sum((g.diagnostics.noise for g in groups), NoiseFloor()),
        [g.scored_turns() for g in groups],
    )


def sanity_figures(sanity: TeacherSanity, noise: NoiseFloor, turns: list[tuple]) -> dict[str, float]:
    """:func:`sanity_metrics` from the groups' summed tallies and each group's scored turns, (s, tokens)."""
    out = sanity.figures() | noise.figures()
    if noise.tokens:
        within = [noise.within(s, n) for s, n in turns]
        total = sum(w.size for w in within)
        if total:
            out["within_noise_floor_frac"] = sum(int(w.sum()) for w in within) / total
    return out
