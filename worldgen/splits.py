"""RL / validation / SFT splits with no leakage from validation into training.

Validation questions share nothing with the training sets (RL and SFT): not the
question text, not the hop path, and not the answer entity, so a model cannot have
seen a validation answer as the answer to a training question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from worldgen.questions import Question


@dataclass(frozen=True)
class Splits:
    rl: list[Question]
    validation: list[Question]
    sft: list[Question]

    def items(self):
        return (("rl", self.rl), ("validation", self.validation), ("sft", self.sft))


class LeakError(ValueError):
    pass


class TooFewQuestions(ValueError):
    """The pool cannot fill the splits asked for; ``training`` and ``validation`` count what it holds."""

    def __init__(self, message: str, *, training: int, validation: int) -> None:
        super().__init__(message)
        self.training = training
        self.validation = validation


def make_splits(pool: list[Question], *, n_rl: int, n_val: int, n_sft: int, seed: int) -> Splits:
    """Validation takes the answer entities that the fewest questions lead to (their other
    questions are dropped); training takes the rest. Order within splits is seeded."""
    rng = random.Random(f"pbsd-world-splits-{seed}")
    by_answer: dict[str, list[Question]] = {}
    for q in pool:
        by_answer.setdefault(q.answer_entity, []).append(q)
    answers = sorted(by_answer)
    rng.shuffle(answers)
    answers.sort(key=lambda a: len(by_answer[a]))  # stable: shuffled within equal counts
    val: list[Question] = []
    val_answers: set[str] = set()
    for a in answers:
        if len(val) >= n_val:
            break
        val.append(by_answer[a][0])
        val_answers.add(a)
    train = [q for q in pool if q.answer_entity not in val_answers]
    rng.shuffle(train)
    if len(val) < n_val or len(train) < n_rl + n_sft:
        raise TooFewQuestions(
            f"the world has too few distinct questions for {n_rl} RL + {n_val} validation + {n_sft} SFT "
            f"(got {len(train)} training and {len(val)} validation); build more entities or questions",
            training=len(train),
            validation=len(val),
        )
    rng.shuffle(val)
    splits = Splits(rl=train[:n_rl], validation=val, sft=train[n_rl : n_rl + n_sft])
    check_no_leaks(splits)
    return splits


def check_no_leaks(splits: Splits) -> None:
    """Raise LeakError naming the first shared question, path or answer between validation and training."""
    train = splits.rl + splits.sft
    for attr, label in (
        (lambda q: q.question, "question"),
        (lambda q: q.path, "hop path"),
        (lambda q: q.answer_entity, "answer entity"),
    ):
        seen = {attr(q): q.id for q in train}
        for q in splits.validation:
            if attr(q) in seen:
                raise LeakError(
                    f"validation {q.id} shares its {label} with training question {seen[attr(q)]}"
                )
    ids = [q.id for q in train + splits.validation]
    if len(set(ids)) != len(ids):
        raise LeakError("a question id appears in more than one split")
