"""Oracle SFT trajectories: real tool calls, exact chat format, correct answers, some detours."""

from __future__ import annotations

import json

import pytest

from agent.catalogue import catalogue, find_tool
from agent.prompt import system_prompt, user_prompt
from agent.toolcall import parse_tool_call
from pbsd.verifier import verify
from worldgen.build import build_world
from worldgen.oracle import load_world_questions, write_sft_data


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle-world")
    build_world(out, seed=3, entities=2000, n_rl=200, n_val=100, n_sft=200)
    return out


@pytest.fixture(scope="module")
def sft(world):
    out = world / "sft.jsonl"
    stats = write_sft_data(world, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return stats, rows


def test_most_questions_are_solved(sft):
    stats, rows = sft
    assert stats["questions"] == 200 and stats["written"] == len(rows)
    assert stats["written"] >= 180  # the tools surface the evidence for nearly every question


def test_chat_format_is_exact(world, sft):
    _, rows = sft
    manifest = json.loads((world / "manifest.json").read_text())
    questions = {q.id: q for q in load_world_questions(world, "sft")}
    for row in rows:
        msgs = row["messages"]
        assert msgs[0] == {"role": "system", "content": system_prompt(catalogue(), manifest["date"])}
        assert msgs[1] == {"role": "user", "content": user_prompt(questions[row["question_id"]].question)}
        roles = [m["role"] for m in msgs[2:]]
        assert roles == ["assistant", "user"] * row["tool_calls"] + ["assistant"]
        for m in msgs[2:-1:2]:  # every assistant turn but the last makes exactly one valid call
            parsed = parse_tool_call(m["content"])
            assert parsed.call is not None and parsed.count == 1 and not parsed.call.repaired
            assert find_tool(parsed.call.server_name, parsed.call.tool_name) is not None
            assert m["content"].rstrip().endswith("</use_mcp_tool>")
        for m in msgs[3:-1:2]:  # tool results are the backend's JSON
            json.loads(m["content"])
        final = msgs[-1]["content"]
        assert parse_tool_call(final).call is None
        q = questions[row["question_id"]]
        assert verify(final, q.answer, q.aliases).correct


def test_some_turns_are_detours(sft):
    _, rows = sft
    with_detours = [r for r in rows if r["detours"] > 0]
    assert 0.2 < len(with_detours) / len(rows) < 0.9


def test_deterministic(world, sft, tmp_path):
    _, rows = sft
    again = tmp_path / "again.jsonl"
    write_sft_data(world, again)
    assert [json.loads(x) for x in again.read_text().splitlines()] == rows


def test_the_boxed_final_writes_the_answer_first_in_its_box(world, sft, tmp_path):
    _, rows = sft
    boxed = tmp_path / "boxed.jsonl"
    write_sft_data(world, boxed, final="boxed")
    again = [json.loads(x) for x in boxed.read_text().splitlines()]
    assert [r["messages"][:-1] for r in again] == [r["messages"][:-1] for r in rows]  # the same walk
    for row in again:
        last = row["messages"][-1]["content"]
        before, box, _ = last.partition("\\boxed{")
        assert box and row["answer"] not in before  # the box is the turn's first mention
        assert verify(last, row["answer"]).correct
    concluded = next(r["messages"][-1]["content"] for r in again if r["detours"] == 0)
    assert concluded.startswith("So ") and concluded.endswith("}.")  # the concluding sentence, boxed
    with pytest.raises(ValueError, match="not one of restate, boxed"):
        write_sft_data(world, boxed, final="bold")
