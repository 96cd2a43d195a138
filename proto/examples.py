"""Well-formed example messages of any size, for tests, benchmarks and documentation."""

from __future__ import annotations

import numpy as np

from proto.messages import (
    DeadLetter,
    PromptTask,
    ScoredGroup,
    ScoreDiagnostics,
    ToolCall,
    Trajectory,
    TrajectoryGroup,
    WeightsPublished,
)
from proto.runs import DataSpec, GrpoSpec, ModelSpec, PbsdSpec, RunSpec

__all__ = [
    "example_group",
    "example_run",
    "example_scored",
    "example_task",
    "example_trajectory",
    "example_weights",
]


def example_run(algorithm: str = "pbsd") -> RunSpec:
    return RunSpec(
        name="example",
        model=ModelSpec(path="/models/tiny"),
        data=DataSpec(train="world/rl.jsonl", validation="world/val.jsonl"),
        algorithm=PbsdSpec() if algorithm == "pbsd" else GrpoSpec(),
    )


def example_task(index: int = 0) -> PromptTask:
    return PromptTask(
        run_id="run-1",
        task_id=f"run-1:0:{index}",
        question_id=f"q{index}",
        question="Which river flows through the capital of the country where X was born?",
        answer="Danube",
        aliases=("the Danube", "Donau"),
        index=index,
        algorithm=PbsdSpec(),
    )


def example_trajectory(
    *,
    tokens: int = 64,
    turns: int = 3,
    prompt_tokens: int = 16,
    sample_index: int = 0,
    routed_experts: tuple[int, int] | None = None,
    seed: int = 0,
    vocab: int = 151_936,
    reward: float = 1.0,
) -> Trajectory:
    """A trajectory of ``tokens`` completion tokens split into ``turns`` generated spans
    separated by non-generated tool-result stretches."""
    rng = np.random.default_rng(seed)
    completion = rng.integers(0, vocab, size=tokens, dtype=np.int32)
    spans, mask = [], np.zeros(tokens, dtype=np.uint8)
    bounds = np.linspace(0, tokens, turns + 1).astype(int)
    for t in range(turns):
        start, end = int(bounds[t]), int(bounds[t + 1])
        gen_end = start + max(1, (end - start) * 2 // 3)  # the rest of the stretch is the tool result
        spans.append((start, gen_end))
        mask[start:gen_end] = 1
    logprobs = np.where(mask == 1, -rng.exponential(1.0, size=tokens), 0.0).astype(np.float32)
    experts = None
    if routed_experts is not None:
        layers, top_k = routed_experts
        experts = rng.integers(0, 128, size=(prompt_tokens + tokens - 1, layers, top_k), dtype=np.uint8)
    return Trajectory(
        trajectory_id=f"traj-{seed}-{sample_index}",
        sample_index=sample_index,
        policy_version=3,
        prompt_ids=rng.integers(0, vocab, size=prompt_tokens, dtype=np.int32),
        completion_ids=completion,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        turn_spans=tuple(spans),
        routed_experts=experts,
        tool_calls=tuple(
            ToolCall(
                turn=t,
                server_name="search",
                tool_name="google_search",
                arguments={"q": f"query {t}"},
                ok=True,
            )
            for t in range(turns - 1)
        ),
        final_answer="Danube" if reward > 0 else "Rhine",
        reward=reward,
        finish_reason="answer",
    )


def example_group(
    group_size: int = 8, *, tokens: int = 64, turns: int = 3, seed: int = 0, **kwargs
) -> TrajectoryGroup:
    trajectories = tuple(
        example_trajectory(
            tokens=tokens, turns=turns, sample_index=i, seed=seed * 1000 + i, reward=float(i % 2), **kwargs
        )
        for i in range(group_size)
    )
    return TrajectoryGroup(
        run_id="run-1",
        task_id="run-1:0:0",
        question_id="q0",
        question="Which river ...?",
        answer="Danube",
        policy_version=3,
        algorithm=PbsdSpec(),
        trajectories=trajectories,
    )


def example_scored(group: TrajectoryGroup | None = None) -> ScoredGroup:
    group = group or example_group()
    g = len(group.trajectories)
    evidence = tuple(np.linspace(-0.05, 0.05, t.num_turns).astype(np.float32) for t in group.trajectories)
    return ScoredGroup(
        group=group,
        advantages=np.linspace(-1, 1, g).astype(np.float32),
        turn_evidence=evidence,
        turn_weights=tuple(np.ones(t.num_turns, np.float32) for t in group.trajectories),
        scored=True,
        scorer_policy_version=3,
        diagnostics=ScoreDiagnostics(
            turns=3 * g,
            scored_turns=3 * g,
            teacher_higher_frac=0.5,
            mean_abs_gap=0.03,
            filtered_frac=0.1,
            evidence=np.concatenate(evidence),
        ),
    )


def example_weights(version: int = 4) -> WeightsPublished:
    return WeightsPublished(run_id="run-1", version=version, step=version, path=f"/ckpt/run-1/v{version}")


def example_dead_letter() -> DeadLetter:
    return DeadLetter(
        stream="trajectories",
        group="scorer",
        entry_id="1-0",
        cause="invalid",
        deliveries=1,
        payload=b"\x00\xff",
    )
