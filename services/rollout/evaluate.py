"""Evaluation: k samples per question, accuracy as mean@k and pass@k (k = 1..K), per difficulty,
and how grounded the agent's searches, reads and answers are (:mod:`agent.grounding`).

The counting (mean@k, pass@k, the paired change between two evaluations) is
:mod:`pbsd.accuracy`.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from agent.chat import ChatTokenizer
from agent.grounding import Grounding
from agent.prompt import user_prompt
from agent.transcript import turn_texts
from pbsd.accuracy import summarise
from proto.data import QuestionRecord
from proto.messages import Trajectory
from services.llm.judge import LlmJudge
from services.rollout.agent import AgentLimits, run_trajectory
from services.rollout.engine import Engine
from services.tools.client import Tools

__all__ = ["digest", "evaluate", "sample"]


async def evaluate(
    engine: Engine,
    tools: Tools,
    tokenizer: ChatTokenizer,
    questions: list[QuestionRecord],
    *,
    system: str,
    samples: int = 4,
    limits: AgentLimits | None = None,
    concurrency: int = 4,
    seed: int | None = None,
    on_done=None,
    judge: LlmJudge | None = None,
) -> dict[str, Any]:
    """Run every question ``samples`` times and report accuracy; ``on_done()`` after each trajectory.
    Default limits sample as the paper evaluates: temperature 1.0, top-p 0.95. With a ``judge``
    every sample's final message is also graded by it (BrowseComp's grader), reported as
    ``judged_accuracy`` beside the exact-match ``accuracy``."""
    limits = limits or AgentLimits(top_p=0.95)
    semaphore = asyncio.Semaphore(concurrency)
    trajectories = await sample(
        engine,
        tools,
        tokenizer,
        questions,
        system=system,
        samples=samples,
        limits=limits,
        semaphore=semaphore,
        seed=seed,
        on_done=on_done,
    )
    results = {q.id: [t.reward > 0 for t in trajectories[q.id]] for q in questions}
    all_t = [t for ts in trajectories.values() for t in ts]
    # each trajectory read back as text once: for grounding and, if asked, for the judge
    texts = {t.trajectory_id: turn_texts(t.completion_ids, t.turn_spans, tokenizer) for t in all_t}
    judged = await _judge_all(judge, questions, trajectories, texts, semaphore) if judge else None
    grounding = Grounding()
    for q in questions:
        for t in trajectories[q.id]:
            grounding.add(q.question, texts[t.trajectory_id], t.final_answer)
    difficulty = {q.id: q.difficulty for q in questions}
    return {
        "samples": samples,
        "questions": len(questions),
        "accuracy": summarise(results, difficulty, samples),
        **({"judged_accuracy": summarise(judged, difficulty, samples)} if judged is not None else {}),
        "finish_reasons": dict(Counter(t.finish_reason for t in all_t)),
        "mean_turns": statistics.fmean(t.num_turns for t in all_t) if all_t else 0.0,
        "mean_generated_tokens": statistics.fmean(int(t.loss_mask.sum()) for t in all_t) if all_t else 0.0,
        "tool_calls": sum(len(t.tool_calls) for t in all_t),
        "tool_errors": sum(not c.ok for t in all_t for c in t.tool_calls),
        "grounding": grounding.summary(),
        "per_question": {
            q.id: {
                "correct": results[q.id],
                "answers": [t.final_answer for t in trajectories[q.id]],
                "digests": [digest(t) for t in trajectories[q.id]],
                "difficulty": q.difficulty,
                **({"judged": judged[q.id]} if judged is not None else {}),
            }
            for q in questions
        },
    }


def digest(t: Trajectory) -> str:
    """16 hex digits of the SHA-256 of a trajectory's token ids, prompt and completion: two
    evaluations sampled the same trajectory where their digests agree."""
    ids = np.concatenate([t.prompt_ids, t.completion_ids]).astype("<i4")
    return hashlib.sha256(ids.tobytes()).hexdigest()[:16]


async def sample(
    engine: Engine,
    tools: Tools,
    tokenizer: ChatTokenizer,
    questions: list[QuestionRecord],
    *,
    system: str,
    samples: int,
    limits: AgentLimits,
    semaphore: asyncio.Semaphore,
    seed: int | None = None,
    on_done=None,
) -> dict[str, list[Trajectory]]:
    """``samples`` trajectories of every question, in sample order, at most as many in flight as
    ``semaphore`` allows; sample i of question qi is seeded with ``seed + i + 1000 qi``, so a
    sample does not depend on which ran beside it. ``on_done()`` after each trajectory."""
    trajectories: dict[str, list[Trajectory]] = defaultdict(list)

    async def one(qi: int, q: QuestionRecord, i: int) -> None:
        async with semaphore:
            t = await run_trajectory(
                engine,
                tools,
                tokenizer,
                system=system,
                question=user_prompt(q.question),
                answer=q.answer,
                aliases=q.aliases,
                trajectory_id=f"eval/{q.id}/{i}",
                sample_index=i,
                limits=limits,
                seed=None if seed is None else seed + i + 1000 * qi,
            )
            forget = getattr(engine, "forget", None)
            if forget is not None:
                forget(t.trajectory_id)
            trajectories[q.id].append(t)
            if on_done is not None:
                on_done()

    await asyncio.gather(*(one(qi, q, i) for qi, q in enumerate(questions) for i in range(samples)))
    return {q.id: sorted(trajectories[q.id], key=lambda t: t.sample_index) for q in questions}


async def _judge_all(
    judge: LlmJudge,
    questions: list[QuestionRecord],
    trajectories: dict[str, list[Trajectory]],
    texts: dict[str, list[tuple[str, str]]],
    semaphore: asyncio.Semaphore,
) -> dict[str, list[bool]]:
    """The judge's verdict on each sample's final message (a sample that wrote none is wrong)."""

    async def one(q: QuestionRecord, t: Trajectory) -> bool:
        turns = texts[t.trajectory_id]
        if not turns or t.finish_reason == "error":
            return False
        async with semaphore:
            return (await judge.judge(q.question, turns[-1][0], q.answer)).correct

    verdicts = await asyncio.gather(*(one(q, t) for q in questions for t in trajectories[q.id]))
    out, it = {}, iter(verdicts)
    for q in questions:
        out[q.id] = [next(it) for _ in trajectories[q.id]]
    return out
