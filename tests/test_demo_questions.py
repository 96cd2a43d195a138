"""The demo's question files: evaluation questions set aside from RL, or taken from validation."""

from __future__ import annotations

import json

import pytest

from demo.config import DemoConfig
from demo.questions import question_files, set_aside


def q(id_: str, *hops: str) -> dict:
    return {"id": id_, "hops": [{"relation": h} for h in hops]}


def test_set_aside_takes_the_first_questions_whose_fact_chain_nothing_else_walks():
    questions = [
        q("a", "born", "in"),  # its chain is walked by an SFT question
        q("b", "studied", "in"),
        q("c", "founded"),  # walked twice within the RL questions
        q("d", "founded"),
        q("e", "employed"),
        q("f", "hosted"),
    ]
    held, rest = set_aside(questions, [q("s1", "born", "in")], 2)
    assert [x["id"] for x in held] == ["b", "e"]
    assert [x["id"] for x in rest] == ["a", "c", "d", "f"]
    held, rest = set_aside(questions, [], 10)  # fewer than asked: all that qualify
    assert [x["id"] for x in held] == ["a", "b", "e", "f"] and [x["id"] for x in rest] == ["c", "d"]


def _read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_evaluation_is_held_out_of_training_with_the_trained_difficulty(tiny_world, tmp_path):
    config = DemoConfig(difficulty=["easy", "medium"], eval_questions=5)
    rl_file, eval_file, count, held_count = question_files(config, tiny_world, tmp_path / "data")
    train, held = _read(rl_file), _read(eval_file)
    assert count == len(train) and held_count == len(held)
    sft = _read(tiny_world / "questions" / "sft.jsonl")
    world_rl = [
        x for x in _read(tiny_world / "questions" / "rl.jsonl") if x["difficulty"] in ("easy", "medium")
    ]

    assert len(held) == 5 and {x["difficulty"] for x in held} <= {"easy", "medium"}
    assert {x["id"] for x in held} | {x["id"] for x in train} == {x["id"] for x in world_rl}
    assert not {x["id"] for x in held} & {x["id"] for x in train}
    walked = {json.dumps(x["hops"], sort_keys=True) for x in train + sft}
    assert not {json.dumps(x["hops"], sort_keys=True) for x in held} & walked


def test_the_validation_split_can_be_evaluated_instead(tiny_world, tmp_path):
    config = DemoConfig(eval_split="validation", eval_difficulty=["medium", "hard"], eval_questions=4)
    rl_file, eval_file, *_ = question_files(config, tiny_world, tmp_path / "data")
    validation = _read(tiny_world / "questions" / "validation.jsonl")
    wanted = [x for x in validation if x["difficulty"] in ("medium", "hard")][:4]
    assert _read(eval_file) == wanted
    assert [x["difficulty"] for x in _read(rl_file)] == ["easy"] * len(_read(rl_file))


def test_a_world_without_questions_to_spare_stops_the_demo(tmp_path):
    world = tmp_path / "world"
    (world / "questions").mkdir(parents=True)
    splits = {
        "rl": [{**q("r1", "born"), "difficulty": "easy"}, {**q("r2", "founded"), "difficulty": "medium"}],
        "validation": [{**q("v1", "hosted"), "difficulty": "hard"}],
        "sft": [{**q("s1", "founded"), "difficulty": "medium"}],
    }
    for name, rows in splits.items():
        (world / "questions" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    # the only easy RL question would be set aside, leaving nothing to train on
    with pytest.raises(SystemExit, match="1 evaluation and 0 RL questions"):
        question_files(DemoConfig(eval_questions=5), world, tmp_path / "out" / "data")
    # no easy validation question
    with pytest.raises(SystemExit, match="0 evaluation and 1 RL questions"):
        question_files(
            DemoConfig(eval_split="validation", eval_difficulty=["easy"]), world, tmp_path / "out" / "data"
        )
    # the medium one's chain is walked in SFT, so with both difficulties the easy one is held out
    rl_file, eval_file, *_ = question_files(
        DemoConfig(difficulty=["easy", "medium"]), world, tmp_path / "out" / "data"
    )
    assert [x["id"] for x in _read(eval_file)] == ["r1"] and [x["id"] for x in _read(rl_file)] == ["r2"]


def test_the_cli_writes_the_demos_question_files(tiny_world, tmp_path):
    """`pbsd world demo-questions` (what the Compose run trains and evaluates on) writes what
    the demo itself would, with the demo's settings or a settings file."""
    from typer.testing import CliRunner

    from pbsd.cli import app

    settings = tmp_path / "demo.yaml"
    settings.write_text("eval_questions: 4\ndifficulty: [easy, medium]\n")
    out = tmp_path / "cli"
    result = CliRunner().invoke(
        app,
        ["world", "demo-questions", "--world", str(tiny_world), "--out", str(out), "--config", str(settings)],
    )
    assert result.exit_code == 0, result.output
    demo = question_files(
        DemoConfig(eval_questions=4, difficulty=["easy", "medium"]), tiny_world, tmp_path / "d"
    )
    assert (out / "rl.jsonl").read_text() == demo.train.read_text()
    assert (out / "eval.jsonl").read_text() == demo.evaluation.read_text()
    assert f"({demo.train_questions} questions)" in result.output and "eval.jsonl (4)" in result.output


def test_demo_settings_load_from_a_file_then_the_options_that_were_given(tmp_path):
    settings = tmp_path / "demo.yaml"
    settings.write_text("steps: 3\nfrom_scratch: true\neval_questions: 9\n")
    loaded = DemoConfig.load(settings, steps=5, eval_questions=None, from_scratch=None)
    assert (loaded.steps, loaded.eval_questions, loaded.from_scratch) == (5, 9, True)
    assert DemoConfig.load(None) == DemoConfig()
    (tmp_path / "empty.yaml").write_text("")
    assert DemoConfig.load(tmp_path / "empty.yaml", group_size=2).group_size == 2
    with pytest.raises(ValueError, match="no_such_setting"):
        DemoConfig.load(None, no_such_setting=1)
    # a command's own defaults (pbsd compare evaluates on 200 questions) sit under the file's
    merged = DemoConfig.merged({"eval_questions": 9}, defaults={"eval_questions": 200, "eval_samples": 4})
    assert (merged.eval_questions, merged.eval_samples) == (9, 4)
    assert DemoConfig.merged({}, defaults={"eval_questions": 200}, eval_questions=7).eval_questions == 7


def test_the_recorded_settings_are_those_used_and_load_again(tmp_path):
    rl = DemoConfig()  # evaluated on questions set aside from RL: their difficulty is RL's
    assert "eval_difficulty" not in rl.settings_used() and rl.settings_used()["difficulty"] == ["easy"]
    validation = DemoConfig(eval_split="validation", eval_difficulty=["medium"])
    assert validation.settings_used()["eval_difficulty"] == ["medium"]
    for config in (rl, validation):
        (tmp_path / "demo-config.json").write_text(json.dumps(config.settings_used()))
        assert DemoConfig.load(tmp_path / "demo-config.json") == config
