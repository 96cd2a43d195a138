"""``pbsd teacher probe``: the note probe's figures against a plain forward pass, and its command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from agent.chat import ChatTokenizer
from pbsd.cli import app
from proto.templates import ANSWER_FIRST_TEACHER_TEMPLATE
from services.model.checkpoint import load_model
from services.trainer.note_probe import note_probe, read_conversations
from services.trainer.sft import encode_conversation
from worldgen.oracle import write_sft_data


@pytest.fixture(scope="module")
def conversations(tiny_world, tmp_path_factory):
    data = tmp_path_factory.mktemp("note-probe") / "val.jsonl"
    write_sft_data(tiny_world, data, split="validation", limit=12, search_num=3)
    return data


def _plain_final_turn_logprobs(model, tok, ids, final_start):
    """log p of every token from ``final_start`` on, from one full forward (no scorer code)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return np.array([float(logp[p - 1, ids[p]]) for p in range(final_start, len(ids) - 0)])


def test_the_right_note_figure_is_the_final_turns_mean_gap(tiny_checkpoint, conversations):
    f = note_probe(tiny_checkpoint, read_conversations(conversations), ANSWER_FIRST_TEACHER_TEMPLATE, limit=3)
    assert f["conversations"] == 3 and 0 <= f["note_only_conversations"] <= 3
    tok, model = ChatTokenizer.from_pretrained(tiny_checkpoint), load_model(tiny_checkpoint)
    gaps, ceilings = [], []
    for row in map(json.loads, conversations.read_text().splitlines()[:3]):
        ids, mask = encode_conversation(tok, row["messages"])
        final = len(ids) - mask[::-1].index(0)  # the last assistant message: after the last masked token
        note = ANSWER_FIRST_TEACHER_TEMPLATE.format(
            answer=row["answer"], question=row["messages"][1]["content"]
        )
        x_star = tok.prompt_ids(row["messages"][0]["content"], note)
        prompt = len(tok.prompt_ids(row["messages"][0]["content"], row["messages"][1]["content"]))
        student = _plain_final_turn_logprobs(model, tok, ids, final)
        teacher = _plain_final_turn_logprobs(model, tok, x_star + ids[prompt:], final + len(x_star) - prompt)
        gaps.append((teacher - student).mean())
        ceilings.append(-student.mean())
    assert f["right_note_mean_s"] == pytest.approx(np.mean(gaps), abs=1e-5)
    assert f["right_note_room_frac"] == np.mean(np.array(ceilings) > 0.001) == 1.0  # random weights: unsure
    assert 0 <= f["decoy_note_disfavoured_frac"] <= 1 and np.isfinite(f["decoy_note_mean_s"])


def test_the_decoys_are_seeded_answers_of_the_same_kind(tiny_checkpoint, conversations):
    rows = read_conversations(conversations)
    a, b, c = (
        note_probe(tiny_checkpoint, rows, ANSWER_FIRST_TEACHER_TEMPLATE, limit=2, seed=k) for k in (1, 1, 2)
    )
    assert a == b and a["decoy_note_mean_s"] != c["decoy_note_mean_s"]  # other decoys, other gaps
    assert a["right_note_mean_s"] == c["right_note_mean_s"]  # the right note has no draw


def test_the_command_prints_the_three_layouts(tiny_checkpoint, conversations):
    def probe(*options: str):
        args = ["teacher", "probe", "--model", str(tiny_checkpoint), "--data", str(conversations)]
        return CliRunner().invoke(app, [*args, *options])

    result = probe("--teacher-template", "answer-first", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert "on 2 conversations" in result.output and "right note" in result.output
    assert "decoy note" in result.output and "answer only in the note" in result.output
    bad = probe("--teacher-template", "no fields")
    assert bad.exit_code == 2 and "teacher_template" in bad.output


def test_a_decoy_note_with_facts_states_facts_that_lead_to_the_decoy(conversations):
    from agent.privileged import fill_template
    from proto.templates import TEACHER_TEMPLATES
    from services.trainer.note_probe import stating

    row = read_conversations(conversations)[0]
    question = row["messages"][1]["content"]
    decoyed = stating(row, "Zorbelhaim")
    note = fill_template(TEACHER_TEMPLATES["support-first"], question, decoyed["answer"], decoyed["support"])
    assert "Zorbelhaim" in note.partition("\n\n")[0]  # the answer line and the last fact
    assert row["answer"] not in note.partition("\n\n")[0]  # the true answer nowhere in the note
    assert stating(row, row["answer"]) == row | {"support": list(row["support"])}  # the right note as it was


def test_the_answer_positions_are_the_runs_that_spell_it(tiny_checkpoint):
    """Each mention of the answer in the final turn, token for token: not the lone space before it,
    and not a token of its spelling that stands elsewhere (the "3" of "3 pages")."""
    from services.trainer.note_probe import answer_positions

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    final = "I read 3 pages of 1753 notes. The answer is 1753.\n\n\\boxed{1753}"
    messages = [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": "When did it open? 1753 or 1844?"},
        {"role": "assistant", "content": final},
    ]
    ids, mask = encode_conversation(tok, messages)
    learnt = answer_positions(tok, ids, mask, "1753")
    runs = np.split(learnt, np.flatnonzero(np.diff(learnt) > 1) + 1)
    assert [tok.decode([ids[p] for p in run]).strip() for run in runs] == ["1753"] * 3
    assert all(tok.decode([ids[p]]).strip() for p in learnt)  # no lone space
    assert learnt.min() > len(ids) - len(tok.encode(final)) - 3  # in the final turn alone
