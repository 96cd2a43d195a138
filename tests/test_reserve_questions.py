"""The world's reserve (demo/questions.py, ``reserve``): pool questions that no split holds, held
out of every split by id, text, hop path and validation answer, the same list every time."""

from __future__ import annotations

import json
import shutil

import pytest

from demo.questions import reserve
from worldgen.build import build_world, regenerate_pool


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _splits(world):
    return {name: _rows(world / "questions" / f"{name}.jsonl") for name in ("rl", "validation", "sft")}


def _path(q):
    return json.dumps(q["hops"], sort_keys=True)


def _check_held_out(world, held, difficulty):
    splits = _splits(world)
    used = [q for qs in splits.values() for q in qs]
    assert held, "the reserve is empty"
    assert {q["difficulty"] for q in held} <= set(difficulty) and {q["split"] for q in held} == {"reserve"}
    assert not {q["id"] for q in held} & {q["id"] for q in used}
    assert not {q["question"] for q in held} & {q["question"] for q in used}
    assert not {_path(q) for q in held} & {_path(q) for q in used}
    assert not {q["answer_entity"] for q in held} & {q["answer_entity"] for q in splits["validation"]}
    assert len({_path(q) for q in held}) == len(held) and len({q["id"] for q in held}) == len(held)


def test_the_reserve_is_held_out_of_every_split(tiny_world):
    held = reserve(tiny_world, ["easy", "medium"], 1000)
    _check_held_out(tiny_world, held, ["easy", "medium"])
    assert reserve(tiny_world, ["easy", "medium"], 1000) == held  # the same list every time
    assert reserve(tiny_world, ["easy", "medium"], 5) == held[:5]  # the first n of it
    assert {q["id"] for q in reserve(tiny_world, ["hard"], 1000)}.isdisjoint(q["id"] for q in held)


def test_no_other_pool_question_shares_a_reserve_question_s_hop_path(tiny_world):
    """Nor an unused pool question of another difficulty or with a validation answer: a question
    whose chain of facts is walked by anything else in the world is not held out."""
    splits = _splits(tiny_world)
    taken = {q["id"] for qs in splits.values() for q in qs}
    pool = [q.to_json() for q in regenerate_pool(tiny_world)]
    others = [q for q in pool if q["id"] not in taken]
    held = reserve(tiny_world, ["easy", "medium", "hard"], 1000)
    held_ids = {q["id"] for q in held}
    for q in held:
        assert [o["id"] for o in others if _path(o) == _path(q)] == [q["id"]]
    assert held_ids <= {q["id"] for q in others}


def test_the_regenerated_pool_holds_every_split_question_as_written(tiny_world):
    pool = {q.id: q.to_json() for q in regenerate_pool(tiny_world)}
    for name, rows in _splits(tiny_world).items():
        for row in rows:
            assert {**pool[row["id"]], "split": name} == row


def test_a_world_whose_splits_its_manifest_does_not_give_is_refused(tiny_world, tmp_path):
    world = tmp_path / "world"
    shutil.copytree(tiny_world, world)
    rows = _rows(world / "questions" / "rl.jsonl")
    rows[0]["question"] += " Exactly?"
    (world / "questions" / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=f"question {rows[0]['id']} of the rl split"):
        reserve(world, ["easy"], 10)


def test_the_default_world_holds_the_comparison_s_200_easy_questions(tmp_path):
    """The demo's world (seed 0, 2000 entities, 575/200/6000): 474 unused easy pool questions,
    419 after the hop-path rule, so `pbsd compare`'s default 200 fit."""
    world = tmp_path / "world"
    build_world(world, seed=0, entities=2000, n_rl=575, n_val=200, n_sft=6000)
    held = reserve(world, ["easy"], 1000)
    assert len(held) == 419
    _check_held_out(world, held, ["easy"])
