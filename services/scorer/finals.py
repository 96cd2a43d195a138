"""Final answers token by token: where a final turn's evidence comes from.

The teacher sanity figures count how often a correct final answer gets s > eps+. A turn's s is
the mean of ``log p(token | x*, ...) - log p(token | x, ...)`` over its tokens, and s measures
what x* adds to what the policy already believed. On a policy's own correct finals that is often
nothing: the policy has just read the answer on a page and copies it, its answer tokens already
at a log-prob within hundredths of a nat of 0, so no teacher can lift them, and the turn's s
comes from the few phrasing tokens it was unsure of, which the verified answer does not inform.

:func:`final_turns` lays each final turn out token by token (the student's and the teacher's
log-probs, and which tokens spell the verified answer); :func:`answer_room` splits the correct
finals into those whose answer the policy was already *sure* of and those it was not, where a
teacher that reads x* has something to add.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from agent.chat import ChatTokenizer
from agent.transcript import turn_texts
from pbsd.verifier import mentions
from proto.messages import ScoredGroup, Trajectory
from services.scorer.contexts import build_contexts

__all__ = ["SURE", "answer_room", "final_turns", "spelled_at"]

SURE = -0.05  # nats: an answer token the student gives at least this log-prob leaves no room

LogprobFn = Callable[[Sequence[tuple[Sequence[int], np.ndarray]]], Awaitable[list[np.ndarray]]]


async def final_turns(scored: ScoredGroup, tokenizer: ChatTokenizer, logprobs: LogprobFn) -> list[dict]:
    """One row per trajectory of ``scored`` that ends on a final answer (correct: reward > 0;
    wrong: it stopped on its own final message), with the last turn's tokens and both passes'
    log-probs at them, from ``logprobs`` (the scorer's backend: same path as the evidence)."""
    group, spec = scored.group, scored.group.algorithm

    def spellings(text: str | None) -> set[tuple[int, ...]]:
        if not text:
            return set()
        spaced = tokenizer.encode(" " + text)
        while spaced and not tokenizer.decode(spaced[:1]).strip():  # the space is not the answer
            spaced = spaced[1:]
        return {tuple(tokenizer.encode(text)), tuple(spaced)}

    rows, requests = [], []
    for t, s in zip(group.trajectories, scored.turn_evidence, strict=True):
        correct = t.reward > 0
        if not (correct or t.finish_reason == "answer") or not t.num_turns or math.isnan(s[-1]):
            continue
        c = build_contexts(
            tokenizer,
            t.prompt_ids.tolist(),
            t.completion_ids.tolist(),
            t.loss_mask,
            t.turn_spans,
            answer=group.answer,
            template=spec.teacher_template,
            teacher_max_length=spec.teacher_max_length,
            support=group.support,
        )
        last = (c.token_turns == t.num_turns - 1) & (c.phi >= 0)
        ids = [c.student[p] for p in c.loss_positions[last]]
        written = first_written(t, tokenizer)
        requests += [(c.student, c.loss_positions[last]), (c.teacher, c.phi[last])]
        rows.append(
            {
                "question_id": group.question_id,
                "answer": group.answer,
                "correct": correct,
                "s": float(s[-1]),
                "tokens": [tokenizer.decode([i]) for i in ids],
                "final_answer": t.final_answer,
                "first_written": written,
                "first_written_s": None if written is None or math.isnan(s[written]) else float(s[written]),
                "answer_tokens": spelled_at(ids, spellings(group.answer)),
                "written_tokens": spelled_at(ids, spellings(t.final_answer)),
            }
        )
    answers = await logprobs(requests) if requests else []
    for k, row in enumerate(rows):
        row["student"] = [round(float(x), 5) for x in answers[2 * k]]
        row["teacher"] = [round(float(x), 5) for x in answers[2 * k + 1]]
    return rows


def first_written(t: Trajectory, tokenizer: ChatTokenizer) -> int | None:
    """The first turn before the last whose text names the answer the trajectory gives (as the
    verifier normalises, whole words): where it committed to that answer; None if only the last."""
    if not t.final_answer:
        return None
    texts = turn_texts(t.completion_ids, t.turn_spans, tokenizer)[:-1]
    return next((k for k, (text, _) in enumerate(texts) if mentions(text, t.final_answer)), None)


def spelled_at(ids: Sequence[int], spellings: set[tuple[int, ...]]) -> list[int]:
    """Indices of ``ids`` inside a whole occurrence of any of ``spellings`` (token sequences)."""
    hits: set[int] = set()
    for spelling in filter(None, spellings):
        n = len(spelling)
        for start in range(len(ids) - n + 1):
            if tuple(ids[start : start + n]) == spelling:
                hits.update(range(start, start + n))
    return sorted(hits)


def answer_room(
    rows: list[dict], *, eps_pos: float = 0.001, eps_neg: float = 0.003, sure: float = SURE
) -> dict[str, float]:
    """Of the correct finals in ``rows``: how many name the answer in tokens the scorer aligned,
    how many of those the student was already sure of (every answer token's log-prob >= ``sure``),
    and, of the rest, how many the teacher favoured (s > eps+) and by how much it lifted the answer
    tokens (their mean teacher-minus-student log-prob). Of the wrong finals: how many spell out the
    answer they give, how many of those the student was sure of, how many the teacher disfavoured
    (s < -eps-) and its mean change on the given answer's tokens. And for both, how many wrote their
    answer in an earlier turn first (:func:`first_written`), and how many of those turns the teacher
    disfavoured (wrong) or favoured (correct): where turn-level credit lands on the commitment."""

    def split(part: list[dict], key: str) -> tuple[list[dict], list[dict], float]:
        named = [r for r in part if r[key]]
        sure_rows = [r for r in named if min(r["student"][k] for k in r[key]) >= sure]
        changes = [np.mean([r["teacher"][k] - r["student"][k] for k in r[key]]) for r in named]
        return named, sure_rows, float(np.mean(changes)) if changes else float("nan")

    correct = [r for r in rows if r["correct"]]
    named, sure_rows, _ = split(correct, "answer_tokens")
    unsure = [r for r in named if r not in sure_rows]
    _, _, lift = split(unsure, "answer_tokens")
    wrong = [r for r in rows if not r["correct"]]
    given, sure_wrong, change = split(wrong, "written_tokens")
    earlier = [r for r in wrong if r["first_written_s"] is not None]
    earlier_right = [r for r in correct if r["first_written_s"] is not None]
    return {
        "correct_finals": len(correct),
        "naming_the_answer": len(named),
        "already_sure": len(sure_rows),
        "already_sure_favoured": sum(r["s"] > eps_pos for r in sure_rows),
        "unsure": len(unsure),
        "unsure_favoured": sum(r["s"] > eps_pos for r in unsure),
        "unsure_answer_lift": lift,
        "wrong_finals": len(wrong),
        "wrong_spelled": len(given),
        "wrong_sure": len(sure_wrong),
        "wrong_disfavoured": sum(r["s"] < -eps_neg for r in given),
        "wrong_answer_change": change,
        "wrong_written_earlier": len(earlier),
        "wrong_written_earlier_disfavoured": sum(r["first_written_s"] < -eps_neg for r in earlier),
        "right_written_earlier": len(earlier_right),
        "right_written_earlier_favoured": sum(r["first_written_s"] > eps_pos for r in earlier_right),
    }
