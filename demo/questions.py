"""The demo's question files: what RL trains on, and what is evaluated before and after.

By default (``eval_split="rl"``) the evaluation questions are set aside from the world's RL
split before training, with the difficulty RL trains on, so before and after measure the skill
being trained on questions the policy has never been given. A question is set aside only where
its hop path (the chain of facts it asks for) appears in no SFT question and no other RL
question: neither the warm start nor RL has walked that chain. Its answer may recur (a country
answers many questions), which is why this is not the world's validation split.

The validation split (``eval_split="validation"``) is stricter: no answer it holds is the answer
to any training question (``worldgen/splits.py``). It therefore takes the questions whose
answers are rarest, and those are nearly all multi-hop. The default world's 200 hold 7 easy
ones, so a policy that trains on easy questions would be judged on three-hop ones.

A comparison of several runs (``pbsd compare``) wants more held-out questions than the RL split
can spare: the default world has 118 easy RL questions. Its evaluation takes them from the
world's *reserve* (:func:`reserve`): questions of the candidate pool the splits were drawn from
that no split holds (``worldgen.build.regenerate_pool``), held to the rules above and the
validation split's: no answer a validation question has, no question text and no hop path that
any split or any other reserve question has. The default world holds 474 easy ones before the
path rule and 419 after.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from demo.config import DemoConfig
from worldgen.formats import write_jsonl

__all__ = ["QuestionFiles", "question_files", "reserve", "reserve_files", "set_aside"]

Question = dict[str, Any]


class QuestionFiles(NamedTuple):
    train: Path  # what RL trains on
    evaluation: Path  # what is evaluated before and after
    train_questions: int  # the lines of ``train`` (the run's epochs depend on it)
    evaluation_questions: int  # the lines of ``evaluation``


def _path(q: Question) -> str:
    return json.dumps(q["hops"], sort_keys=True)


def set_aside(
    questions: list[Question], others: list[Question], n: int
) -> tuple[list[Question], list[Question]]:
    """The first ``n`` of ``questions`` whose hop path is shared with no other question (of
    ``questions`` or ``others``), and the rest of ``questions``, both in their given order."""
    seen = Counter(_path(q) for q in questions + others)
    held: list[Question] = []
    for q in questions:
        if len(held) == n:
            break
        if seen[_path(q)] == 1:
            held.append(q)
    ids = {q["id"] for q in held}
    return held, [q for q in questions if q["id"] not in ids]


def _split(world: Path, name: str) -> list[Question]:
    return [json.loads(x) for x in (world / "questions" / f"{name}.jsonl").read_text().splitlines()]


def question_files(config: DemoConfig, world: Path, data: Path) -> QuestionFiles:
    """Write ``rl.jsonl`` and ``eval.jsonl`` into the folder ``data`` (``pbsd world
    demo-questions`` writes the same for the Compose run, deploy/runs/demo-cpu.yaml)."""
    train = [q for q in _split(world, "rl") if q["difficulty"] in config.difficulty]
    if config.eval_split == "validation":
        wanted = config.eval_difficulty
        held = [q for q in _split(world, "validation") if q["difficulty"] in wanted][: config.eval_questions]
    else:
        held, train = set_aside(train, _split(world, "sft"), config.eval_questions)
    if not held or not train:
        raise SystemExit(
            f"the world has {len(held)} evaluation and {len(train)} RL questions for these settings "
            f"(RL on {'+'.join(config.difficulty)}, evaluation from the {config.eval_split} split); "
            "build more entities or widen the difficulties"
        )
    return _written(data, ("rl.jsonl", train), ("eval.jsonl", held))


def reserve_files(config: DemoConfig, world: Path, data: Path) -> QuestionFiles:
    """``train.jsonl``, the world's RL questions of ``config``'s difficulties (the reserve shares no
    hop path with them, so none is set aside), and ``reserve.jsonl``, ``config.eval_questions`` of
    the world's reserve of those difficulties, in the folder ``data`` (``pbsd compare``)."""
    train = [q for q in _split(world, "rl") if q["difficulty"] in config.difficulty]
    held = reserve(world, list(config.difficulty), config.eval_questions)
    if len(held) < config.eval_questions or not train:
        raise SystemExit(
            f"the world holds {len(held)} reserve questions of {'+'.join(config.difficulty)} (asked for "
            f"{config.eval_questions}) and {len(train)} RL questions to train on: build more entities, "
            "widen the difficulties or evaluate fewer questions"
        )
    return _written(data, ("train.jsonl", train), ("reserve.jsonl", held))


def _written(
    data: Path, train: tuple[str, list[Question]], held: tuple[str, list[Question]]
) -> QuestionFiles:
    for name, rows in (train, held):
        write_jsonl(data / name, rows)
    return QuestionFiles(data / train[0], data / held[0], len(train[1]), len(held[1]))


def reserve(world: Path, difficulty: list[str], n: int) -> list[Question]:
    """The first ``n`` questions of ``world``'s regenerated pool (in pool order, so the same world
    gives the same list) that no split holds, of one of the difficulties ``difficulty``, whose
    answer answers no validation question, whose text is no split question's, and whose hop path
    no split question and no other unused pool question walks. Each row carries ``"split":
    "reserve"``."""
    from worldgen.build import regenerate_pool

    splits = [q for name in ("sft", "rl", "validation") for q in _split(world, name)]
    taken = {q["id"] for q in splits}
    texts = {q["question"] for q in splits}
    validation_answers = {q["answer_entity"] for q in splits if q["split"] == "validation"}
    unused = [q.to_json() for q in regenerate_pool(world) if q.id not in taken]
    fit = [
        q
        for q in unused
        if q["difficulty"] in difficulty
        and q["answer_entity"] not in validation_answers
        and q["question"] not in texts
    ]
    fit_ids = {q["id"] for q in fit}
    held, _ = set_aside(fit, splits + [q for q in unused if q["id"] not in fit_ids], n)
    return [{**q, "split": "reserve"} for q in held]
