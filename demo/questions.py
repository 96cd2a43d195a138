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
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from demo.config import DemoConfig
from worldgen.formats import write_jsonl

__all__ = ["QuestionFiles", "question_files", "set_aside"]

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
    write_jsonl(data / "rl.jsonl", train)
    write_jsonl(data / "eval.jsonl", held)
    return QuestionFiles(data / "rl.jsonl", data / "eval.jsonl", len(train), len(held))
