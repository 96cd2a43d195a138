"""Commands given inputs that cannot do what was asked: a world too small for its splits, SFT data
with questions skipped or nothing to learn, an evaluation whose every trajectory failed. Each
says why, and exits non-zero (the one-line errors of every command: test_cli_errors.py)."""

from __future__ import annotations

import json

from pbsd.cli import app
from services.local_redis import free_port
from tests.test_cli_errors import _one_line_error, runner


def test_a_world_too_small_names_the_size_that_holds_it(tmp_path):
    from worldgen.build import build_world

    sizes = ["--rl", "30", "--validation", "60", "--sft", "60"]
    result = runner.invoke(app, ["world", "build", "--out", str(tmp_path / "w"), "--entities", "100", *sizes])
    _one_line_error(result, "a world of 100 entities with seed 0 cannot fill 30 RL + 60 validation", 1)
    smallest = int(result.stderr.split("build one of ")[1].split()[0])
    assert 100 < smallest <= 1600 and not (tmp_path / "w").exists()
    build_world(tmp_path / "w", seed=0, entities=smallest, n_rl=30, n_val=60, n_sft=60)  # it does hold them


def test_sft_data_says_why_questions_were_skipped(tiny_world, tmp_path):
    """One of the tiny world's RL questions has a page that does not show the next hop's entity."""
    out = tmp_path / "rl-sft.jsonl"
    result = runner.invoke(
        app, ["world", "sft-data", "--world", str(tiny_world), "--split", "rl", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    written = len(out.read_text().splitlines())
    assert f"wrote {written} trajectories" in result.stdout
    assert f"skipped {60 - written} of 60 questions" in result.stdout
    assert f": {60 - written} a page read lacked the next entity" in result.stdout, result.stdout


def test_an_evaluation_whose_trajectories_failed_exits_1(tiny_checkpoint, tiny_world, tmp_path):
    """No SGLang server answers: the report is written, but a run of failures is not a result."""
    closed = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    out = tmp_path / "eval.json"
    args = ["--model", tiny_checkpoint, "--questions", tiny_world / "questions" / "validation.jsonl"]
    args += [
        "--corpus",
        tiny_world / "corpus.jsonl",
        "--sglang-url",
        closed,
        "--limit",
        "1",
        "--samples",
        "2",
    ]
    result = runner.invoke(app, ["eval", *map(str, args), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert (
        f"error: 2 of 2 trajectories failed (the log above says why); {out} counts them wrong"
        in result.stderr
    )
    assert json.loads(out.read_text())["finish_reasons"] == {"error": 2}


def test_sft_with_nothing_to_learn_says_so(tiny_checkpoint, tmp_path):
    data = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": "Here, at length."}]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    args = ["sft", "--data", str(data), "--model", str(tiny_checkpoint), "--out", str(tmp_path / "out")]

    def last_line(*extra: str) -> str:
        result = runner.invoke(app, [*args, *extra])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        return result.stderr.strip().splitlines()[-1]

    assert last_line().startswith(
        f"error: {data} line 1: a conversation starts with a system and a user message"
    )
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."}, *turns]}) + "\n")
    said = f"error: {data}: no usable conversations in the 1 read; 1 longer than max_tokens (1)"
    assert last_line("--max-tokens", "1") == said
    assert (
        last_line("--teacher-format", "answer:1")
        == f"error: {data} line 1: no answer, which --teacher-format needs to build x*"
    )
