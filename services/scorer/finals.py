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
from typing import Any

import numpy as np

from agent.chat import ChatTokenizer, spelled_at
from agent.grounding import turn_verdicts
from agent.transcript import turn_texts
from pbsd.verifier import boxes, mentions
from proto.messages import ScoredGroup
from services.scorer.contexts import group_contexts
from services.scorer.evidence import LogprobFn
from services.scorer.sanity import final_kind

__all__ = ["PARTS", "SURE", "answer_room", "by_part", "final_turns", "token_parts"]

SURE = -0.05  # nats: an answer token the student gives at least this log-prob leaves no room
PARTS = ("first", "answer", "markup", "phrasing")


async def final_turns(scored: ScoredGroup, tokenizer: ChatTokenizer, logprobs: LogprobFn) -> list[dict]:
    """One row per trajectory of ``scored`` that ends on a final answer (:func:`final_kind`), with
    the last turn's tokens and both passes' log-probs at them, from ``logprobs`` (the scorer's
    backend: same path as the evidence)."""
    group = scored.group

    def spellings(text: str | None) -> set[tuple[int, ...]]:
        return tokenizer.spellings(text) if text else set()

    rows, requests = [], []
    for t, s, c in zip(
        group.trajectories, scored.turn_evidence, group_contexts(group, tokenizer), strict=True
    ):
        kind = final_kind(t)
        if kind not in ("correct_final", "wrong_final") or c is None or math.isnan(s[-1]):
            continue
        last = (c.token_turns == t.num_turns - 1) & (c.phi >= 0)
        ids = [c.student[p] for p in c.loss_positions[last]]
        texts = turn_texts(t.completion_ids, t.turn_spans, tokenizer)
        written = first_written(t.final_answer, texts)
        verdict = turn_verdicts(group.question, texts, t.final_answer)[-1]
        requests += [(c.student, c.loss_positions[last]), (c.teacher, c.phi[last])]
        rows.append(
            {
                "question_id": group.question_id,
                "answer": group.answer,
                "correct": kind == "correct_final",
                "s": float(s[-1]),
                "tokens": [tokenizer.decode([i]) for i in ids],
                "final_answer": t.final_answer,
                # found in a tool result (as the viewer labels it), None when the turn is no answer
                "grounded": verdict[1] if verdict is not None and verdict[0] == "answers" else None,
                "first_written": written,
                "first_written_s": None if written is None or math.isnan(s[written]) else float(s[written]),
                "answer_tokens": spelled_at(ids, spellings(group.answer)),
                "written_tokens": spelled_at(ids, spellings(t.final_answer)),
            }
        )
    answers = await logprobs(requests, [k for k in range(len(rows)) for _ in range(2)]) if requests else []
    for k, row in enumerate(rows):
        row["student"] = [round(float(x), 5) for x in answers[2 * k]]
        row["teacher"] = [round(float(x), 5) for x in answers[2 * k + 1]]
    return rows


def first_written(answer: str | None, texts: list[tuple[str, str]]) -> int | None:
    """The first turn before the last whose text (``texts``: a trajectory's turns read back,
    :func:`agent.transcript.turn_texts`) names ``answer``, the one the trajectory gives (as the
    verifier normalises, whole words): where it committed to that answer; None if only the last."""
    if not answer:
        return None
    return next((k for k, (text, _) in enumerate(texts[:-1]) if mentions(text, answer)), None)


def token_parts(row: dict) -> list[str]:
    """Each token of a final turn's row (:func:`final_turns`) by the part of the turn it is: ``first``
    (the turn's first token, where the policy settles to answer now rather than search or read on),
    ``answer`` (the tokens that spell the verified answer or the answer the turn gives), ``markup``
    (the ``\\boxed{`` and ``}`` around an answer) or ``phrasing`` (the rest: the sentence the answer
    sits in, the end of turn). What a teacher that reads x* can inform is the first two; markup and
    phrasing are format."""
    markup: set[int] = set()
    for opened, start, close in boxes("".join(row["tokens"])):  # as the verifier finds them
        markup.update(range(opened, start))
        markup.add(close)
    answer, parts, at = {*row["answer_tokens"], *row["written_tokens"]}, [], 0
    for k, token in enumerate(row["tokens"]):
        chars = [at + i for i, ch in enumerate(token) if not ch.isspace()]
        at += len(token)
        if k == 0:
            parts.append("first")
        elif k in answer:
            parts.append("answer")
        else:
            parts.append("markup" if chars and all(c in markup for c in chars) else "phrasing")
    return parts


def by_part(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Over the finals in ``rows``, for each part of a turn (:func:`token_parts`): its share of their
    summed distance from certainty (the student's negative log-probs, which bound what any teacher can
    add: ``room``), and the teacher's change on its tokens, summed within a final and averaged over
    the finals (``lift``, nats). Where a correct final's room lies says what its s can come from."""
    room = dict.fromkeys(PARTS, 0.0)
    lift = dict.fromkeys(PARTS, 0.0)
    for row in rows:
        for part, student, teacher in zip(token_parts(row), row["student"], row["teacher"], strict=True):
            room[part] -= student
            lift[part] += teacher - student
    total = sum(room.values())
    return {
        p: {"room": room[p] / total if total > 0 else 0.0, "lift": lift[p] / len(rows) if rows else 0.0}
        for p in PARTS
    }


def answer_room(
    rows: list[dict], *, eps_pos: float = 0.001, eps_neg: float = 0.003, sure_at: float = SURE
) -> dict[str, Any]:
    """Of the correct finals in ``rows``: how many name the answer in tokens the scorer aligned, how
    many of those the student was already sure of (every answer token's log-prob >= ``sure_at``), and,
    of the rest, how many the teacher favoured (s > eps+) and by how much it lifted the answer tokens
    (their mean teacher-minus-student log-prob); and how many a teacher that lifted only the answer's
    own tokens to certainty, every other token left where the student has it, would favour
    (``answer_only_room``: x* says what the answer is, not how the sentence around it is phrased; a
    teacher that favours other finals does so through their phrasing tokens, not by reading the
    answer), and how many it would favour were the turn nothing but the answer's tokens
    (``answer_alone_room``: their mean distance from certainty above eps+): a bound for a final turn
    of any shape, since every other token a turn holds only dilutes what reading the answer adds.
    Of the wrong finals: how many spell out the answer they give, how many of those the
    student was sure of, how many the teacher disfavoured (s < -eps-) and its mean change on the given
    answer's tokens. And for both, how many wrote their answer in an earlier turn first
    (:func:`first_written`), and how many of those turns the teacher disfavoured (wrong) or favoured
    (correct): where turn-level credit lands on the commitment. Where the correct finals' room and the
    teacher's change lie, by part of the turn (``correct_by_part``, :func:`by_part`). Last, the finals'
    mean s by outcome and grounding (``by_outcome``). The sanity figures' answers pool right and wrong ones; this splits
    them, so that a pooled "grounded below made-up" can be told apart from grounded wrong answers
    disfavoured more than made-up wrong ones (a copied answer the student was sure of has the most
    likelihood to lose; docs/credit-signal.md)."""

    def sure(row: dict, key: str) -> bool:
        return min(row["student"][k] for k in row[key]) >= sure_at

    def answer_only(row: dict) -> float:  # the turn's s were the answer's tokens at log-prob 0
        return -sum(row["student"][k] for k in row["answer_tokens"]) / len(row["student"])

    def answer_alone(row: dict) -> float:  # the same, the turn cut to the answer's tokens
        return -float(np.mean([row["student"][k] for k in row["answer_tokens"]]))

    def mean(values: list[float]) -> float | None:  # None, not NaN: the report is JSON
        return float(np.mean(values)) if values else None

    def change(part: list[dict], key: str) -> float | None:
        return mean([np.mean([r["teacher"][k] - r["student"][k] for k in r[key]]) for r in part])

    def outcome_row(part: list[dict], key: str) -> dict[str, float | None]:
        """Their mean s and, over those that spell their answer, the student's mean log-prob of it
        and the teacher's mean change on it."""
        spelled = [r for r in part if r[key]]
        return {
            "finals": len(part),
            "mean_s": mean([r["s"] for r in part]),
            "student": mean([np.mean([r["student"][k] for k in r[key]]) for r in spelled]),
            "answer_change": change(spelled, key),
        }

    correct = [r for r in rows if r["correct"]]
    named = [r for r in correct if r["answer_tokens"]]
    sure_rows = [r for r in named if sure(r, "answer_tokens")]
    unsure = [r for r in named if not sure(r, "answer_tokens")]
    wrong = [r for r in rows if not r["correct"]]
    given = [r for r in wrong if r["written_tokens"]]
    earlier = [r for r in wrong if r["first_written_s"] is not None]
    earlier_right = [r for r in correct if r["first_written_s"] is not None]
    return {
        "correct_finals": len(correct),
        "naming_the_answer": len(named),
        "already_sure": len(sure_rows),
        "already_sure_favoured": sum(r["s"] > eps_pos for r in sure_rows),
        "unsure": len(unsure),
        "unsure_favoured": sum(r["s"] > eps_pos for r in unsure),
        "unsure_answer_lift": change(unsure, "answer_tokens"),
        "answer_only_room": sum(answer_only(r) > eps_pos for r in named),
        "answer_alone_room": sum(answer_alone(r) > eps_pos for r in named),
        "wrong_finals": len(wrong),
        "wrong_spelled": len(given),
        "wrong_sure": sum(sure(r, "written_tokens") for r in given),
        "wrong_disfavoured": sum(r["s"] < -eps_neg for r in given),
        "wrong_answer_change": change(given, "written_tokens"),
        "wrong_written_earlier": len(earlier),
        "wrong_written_earlier_disfavoured": sum(r["first_written_s"] < -eps_neg for r in earlier),
        "right_written_earlier": len(earlier_right),
        "right_written_earlier_favoured": sum(r["first_written_s"] > eps_pos for r in earlier_right),
        "correct_by_part": by_part(correct),
        "by_outcome": {
            f"{outcome}_{how}": outcome_row(part, key)
            for outcome, of, key in (
                ("correct", correct, "answer_tokens"),
                ("wrong", wrong, "written_tokens"),
            )
            for how, grounded in (("grounded", True), ("made_up", False))
            if (part := [r for r in of if r.get("grounded") is grounded])
        },
    }
