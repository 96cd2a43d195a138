"""The note pass's doubt (``pbsd teacher teach --doubt``): in the student's layouts the answer's name
is learnt toward 1 - doubt, the rest spread over the other names its pages show; after x* it stays
a hard target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from services.model.tiny import TinySpec, init_tiny
from services.trainer.note_layout import Sequence, lay_out_note_pass, name_tokens
from services.trainer.note_pass import NotePassConfig, doubted, run_note_pass
from services.trainer.note_probe import read_conversations
from worldgen.oracle import write_sft_data


@pytest.fixture(scope="module")
def named(tiny_world, tmp_path_factory):
    """A checkpoint whose tokenizer has a token for each entity name and page address, and its data."""
    root = tmp_path_factory.mktemp("doubt")
    data = root / "sft.jsonl"
    write_sft_data(tiny_world, data, split="sft", limit=24, search_num=3)
    spec = TinySpec(
        vocab_size=1024, hidden_size=64, head_dim=16, moe_intermediate_size=64, entity_tokens=True
    )
    init_tiny(tiny_world, root / "ckpt", spec=spec)
    return root / "ckpt", data


def test_only_the_students_answer_is_hedged_over_the_names_its_pages_show(named):
    ckpt, data = named
    tok, rows = ChatTokenizer.from_pretrained(ckpt), read_conversations(data)
    names = set(name_tokens(tok).tolist())
    assert names and not any(tok.tok.convert_ids_to_tokens(i).startswith("kb://") for i in names)
    config = NotePassConfig(doubt=0.3, contradicted=0.5, plain=0.25, anchor_teacher=0.5)
    cut, anchors = lay_out_note_pass(tok, rows, config)
    hedged = [s for s in cut + anchors if s.hedges]
    assert {s.layout for s in hedged} == {"student", "anchor"}  # never after x*
    assert all(not s.hedges for s in cut + anchors if s.layout not in ("student", "anchor"))
    by_answer = {tuple(sorted(tok.spellings(r["answer"]))): r for r in rows}
    for seq in hedged:
        for k, others in seq.hedges.items():
            at = int(seq.learnt[k])
            answer = seq.ids[at]
            assert answer in names and (answer,) in {sp for key in by_answer for sp in key}
            before = seq.ids[:at]
            assert set(others.tolist()) <= names - {answer} and set(others.tolist()) <= set(before)
    # without doubt nothing is hedged, and the layouts are otherwise the same
    plain_cut, plain_anchors = lay_out_note_pass(tok, rows, NotePassConfig(contradicted=0.5, plain=0.25))
    assert not any(s.hedges for s in plain_cut + plain_anchors)
    assert [s.ids for s in plain_cut] == [s.ids for s in cut]


def test_doubted_is_the_cross_entropy_against_the_smoothed_target():
    # three learnt positions, the second hedged over two other names
    seq = Sequence(
        ids=[0, 5, 6, 7, 8], learnt=np.array([2, 3, 4]), layout="student", hedges={1: np.array([1, 4])}
    )
    logits = torch.randn(3, 10, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    out = doubted(logp, seq, 0.4)
    assert torch.allclose(out[[0, 2]], logp[[0, 2], [6, 8]])
    (-out[1]).backward()
    target = torch.zeros(10)
    target[7], target[[1, 4]] = 0.6, 0.2  # 1 - doubt on the answer, doubt shared by the others
    assert torch.allclose(logits.grad[1], torch.softmax(logits[1], -1).detach() - target, atol=1e-6)
    assert not logits.grad[[0, 2]].abs().sum()


def test_doubt_needs_name_tokens_and_a_share(tiny_checkpoint, named, tmp_path):
    with pytest.raises(ValueError, match="doubt must be in"):
        NotePassConfig(doubt=1.5)
    _, data = named
    with pytest.raises(ValueError, match="the tokenizer has none"):
        run_note_pass(data, tiny_checkpoint, tmp_path / "o", NotePassConfig(steps=1, limit=4, doubt=0.2))


def test_a_run_with_doubt_moves_the_students_answer_toward_its_target(named, tmp_path):
    """From random weights the student's answers start unsure of everything; the hedged loss falls
    as it learns, and the run records its doubt."""
    ckpt, data = named
    config = NotePassConfig(
        steps=6,
        batch_size=4,
        anchors=2,
        lr=3e-3,
        warmup_steps=1,
        limit=6,
        doubt=0.3,
        contradicted=0.0,
        plain=0.0,
    )
    stats = run_note_pass(data, ckpt, tmp_path / "out", config)
    assert stats["config"]["doubt"] == 0.3 and stats["final"]["note"] < stats["first"]["note"]


def test_the_command_and_the_demo_pass_the_options_through(named, tmp_path):
    from typer.testing import CliRunner

    from demo.config import DemoConfig
    from pbsd.cli import app

    ckpt, data = named
    args = ["teacher", "teach", "--data", str(data), "--model", str(ckpt), "--out", str(tmp_path / "t")]
    result = CliRunner().invoke(
        app, [*args, "--steps", "1", "--limit", "3", "--doubt", "0.2", "--same-final"]
    )
    assert result.exit_code == 0, result.output
    recorded = json.loads((tmp_path / "t" / "pbsd.json").read_text())["note_pass"]["config"]
    assert (recorded["doubt"], recorded["same_final"]) == (0.2, True)
    assert CliRunner().invoke(app, [*args, "--doubt", "1.5"]).exit_code == 2  # outside [0, 1]
    default = DemoConfig().note_pass_config()
    assert (default.doubt, default.same_final) == (0.0, False)  # the committed recipe uses neither
    on = DemoConfig(note_pass_doubt=0.1, note_pass_same_final=True).note_pass_config()
    assert (on.doubt, on.same_final) == (0.1, True)
    assert DemoConfig(note_pass_doubt=0.1).warm_start() != DemoConfig().warm_start()


def test_doubt_acts_with_hops_on_too(named):
    """One forward serves the answer's tokens and the hops': the doubt applies to its answer rows."""
    from services.model.checkpoint import load_model
    from services.trainer.note_pass import backward_losses

    ckpt, data = named
    tok, rows = ChatTokenizer.from_pretrained(ckpt), read_conversations(data)
    shape = dict(hops=1.0, contradicted=0.0, plain=0.0, anchors=0)
    cut, _ = lay_out_note_pass(tok, rows, NotePassConfig(doubt=0.3, **shape))
    both = [s for s in cut if s.hedges and s.hops.size]
    assert both
    model = load_model(ckpt)
    hard = backward_losses(model, None, 0, both, [], NotePassConfig(**shape))
    soft = backward_losses(model, None, 0, both, [], NotePassConfig(doubt=0.3, **shape))
    assert soft["hop"] == pytest.approx(hard["hop"]) and soft["note"] != pytest.approx(hard["note"], abs=1e-6)
