"""The note pass (``pbsd teacher teach``): its layouts, its cached system prompt against a whole
forward, and a run that learns."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from agent.chat import ChatTokenizer
from agent.privileged import teacher_prompt_ids
from pbsd.cli import app
from proto.runs import PbsdSpec
from proto.templates import ANSWER_FIRST_TEACHER_TEMPLATE
from services.model.checkpoint import load_model
from services.trainer.note_layout import _cut, hop_names, hop_positions, lay_out_note_pass
from services.trainer.note_pass import (
    NotePassConfig,
    backward_losses,
    cached_logprobs,
    prefix_cache,
    run_note_pass,
    shared_prefix,
)
from services.trainer.note_probe import answer_positions, final_turn, read_conversations
from services.trainer.sft import encode_conversation
from services.trainer.teacher_sft import teacher_format
from worldgen.oracle import write_sft_data


@pytest.fixture(scope="module")
def conversations(tiny_world, tmp_path_factory):
    data = tmp_path_factory.mktemp("note-pass") / "sft.jsonl"
    write_sft_data(tiny_world, data, split="sft", limit=24, search_num=3)
    return data


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


def test_each_layout_learns_the_answer_and_only_the_teachers_see_the_note(tok, conversations):
    rows = read_conversations(conversations)
    config = NotePassConfig(contradicted=0.5, plain=0.25, anchor_teacher=0.5)
    cut, anchors = lay_out_note_pass(tok, rows, config)
    assert len(anchors) == len(rows) and 0 < len(cut) <= len(rows)
    assert {s.layout for s in cut} == {"contradicted", "plain", "student"}
    assert {s.layout for s in anchors} == {"anchor", "anchor-x*"}
    by_question = {r["messages"][1]["content"]: r for r in rows}
    for seq in cut:
        text = tok.tok.decode(seq.ids)
        row = next(r for q, r in by_question.items() if q in text)
        runs = np.split(seq.learnt, np.flatnonzero(np.diff(seq.learnt) > 1) + 1)
        spelled = [tok.decode([seq.ids[p] for p in run]) for run in runs]
        assert {s.strip() for s in spelled} == {row["answer"]}  # the answer's mentions, nothing else
        assert all(tok.decode([seq.ids[p]]).strip() for p in seq.learnt)  # no lone space
        system, question = row["messages"][0]["content"], row["messages"][1]["content"]
        student = tok.prompt_ids(system, question)
        note = teacher_prompt_ids(tok, student, row["answer"], config.template, ())
        assert seq.ids[: len(note)] == note if seq.layout != "student" else seq.ids[: len(student)] == student
        final = len(seq.ids) - seq.ids[::-1].index(tok.encode(tok.fmt.start)[0])
        assert seq.learnt.min() > final  # in the final answer alone
        if seq.layout == "contradicted":  # the tool results name a decoy: only the note names the answer
            turns = tok.tok.decode(seq.ids[len(note) :]).split(tok.fmt.start)
            results = [t for t in turns if t.startswith("user\n")]
            assert results and not any(
                re.search(rf"(?<!\w){re.escape(row['answer'])}(?!\w)", t) for t in results
            )
    for seq, row in zip(anchors, rows, strict=True):  # whole conversations, every assistant token learnt
        ids, mask = encode_conversation(tok, row["messages"])
        student = np.flatnonzero(np.asarray(mask) == 1)
        shift = len(seq.ids) - len(ids)
        prompt = len(tok.prompt_ids(row["messages"][0]["content"], row["messages"][1]["content"]))
        assert seq.ids[prompt + shift :] == ids[prompt:] and list(seq.learnt) == list(student + shift)
        assert shift == 0 if seq.layout == "anchor" else shift != 0
    again = lay_out_note_pass(tok, rows, config)
    assert [s.ids for s in again[0]] == [s.ids for s in cut]  # seeded
    other = lay_out_note_pass(tok, rows, NotePassConfig(seed=1))
    assert [s.ids for s in other[0]] != [s.ids for s in cut]


@pytest.mark.parametrize("template", [ANSWER_FIRST_TEACHER_TEMPLATE, PbsdSpec().teacher_template])
def test_each_anchor_after_the_note_pairs_its_answer_free_tokens_with_the_students(
    tok, conversations, template
):
    rows = read_conversations(conversations)
    _, anchors = lay_out_note_pass(tok, rows, NotePassConfig(template=template, anchor_teacher=1.0))
    assert {s.layout for s in anchors} == {"anchor-x*"}
    for seq, row in zip(anchors, rows, strict=True):
        ids, mask = encode_conversation(tok, row["messages"])
        assistant = tok.tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        final = row["messages"][-1]["content"]
        twin = seq.twin
        assert twin is not None and twin.ids == ids and twin.layout == "student"
        free_text = tok.tok.decode([ids[p] for p in twin.learnt])
        # every assistant turn but the last: the final answer is the one turn L_same leaves alone
        assert (
            final not in free_text
            and assistant.startswith(free_text)
            and final in assistant[len(free_text) :]
        )
        assert np.array_equal(seq.twin_at, np.arange(twin.learnt.size))  # the first of the anchor's
        assert [seq.ids[p] for p in seq.learnt[seq.twin_at]] == [ids[p] for p in twin.learnt]


def test_same_final_holds_the_last_turns_phrasing_but_not_its_answer(tok, conversations):
    rows = read_conversations(conversations)
    config = NotePassConfig(anchor_teacher=1.0, same_final=True)
    for seq, row in zip(lay_out_note_pass(tok, rows, config)[1], rows, strict=True):
        ids, mask = encode_conversation(tok, row["messages"])
        final = final_turn(mask)
        held = seq.twin.learnt
        answer = answer_positions(tok, ids, mask, row["answer"])
        assert answer.size and not np.isin(answer, held).any()  # the answer's own tokens are left free
        assert set(final) - set(answer) <= set(held)  # the rest of the last turn is held
        assert set(np.flatnonzero(np.asarray(mask) == 1)) - set(answer) == set(held)
        assert [seq.ids[p] for p in seq.learnt[seq.twin_at]] == [ids[p] for p in held]


def test_hop_positions_are_the_entities_earlier_turns_read_from_the_pages(tok, conversations):
    rows = read_conversations(conversations)
    cut, _ = lay_out_note_pass(tok, rows, NotePassConfig(hops=1.0))
    assert all(s.hops.size == 0 for s in lay_out_note_pass(tok, rows, NotePassConfig())[0])  # off by default
    assert sum(s.hops.size > 0 for s in cut) >= len(cut) // 2
    assert {s.layout for s in cut if s.hops.size} == {"contradicted", "plain", "student"}
    for row in rows:
        ids, mask = encode_conversation(tok, row["messages"])
        hops = hop_positions(tok, ids, mask, row)
        entities = {re.search(r"^.* is (.+) \(page ", f).group(1) for f in row["support"]} - {row["answer"]}
        assert np.asarray(mask)[hops].all() and (hops < final_turn(mask)[0]).all()  # earlier assistant turns
        runs = np.split(hops, np.flatnonzero(np.diff(hops) > 1) + 1) if hops.size else []
        for run in runs:  # each run of positions spells one hop entity, named in a tool result before it
            name = tok.decode([ids[p] for p in run]).strip()
            assert name in entities
            first_result = tok.decode(ids[: run[0]]).rfind(name)
            assert first_result >= 0
        # every commitment "... is <entity>." the oracle writes before its final turn is learnt
        for message in row["messages"][2:-1]:
            for said in (
                re.findall(r"^So the .+ is (.+?)\. Next", message["content"])
                if message["role"] == "assistant"
                else []
            ):
                assert any(tok.decode([ids[p] for p in run]).strip() == said for run in runs)


def test_a_hop_only_the_prompt_names_is_not_learnt(tok, conversations):
    # the support template states every hop in x*; cut to its last exchange, a conversation writes
    # hops it read in no kept tool result, and those must not be learnt from the note
    rows = read_conversations(conversations)
    config = NotePassConfig(template="support", hops=1.0, contradicted=0.0, plain=1.0)
    written_unread = False
    for row in rows:
        cut = _cut(row, 1)
        ids, mask = teacher_format(tok, cut, *encode_conversation(tok, cut["messages"]), config.template)
        m = np.asarray(mask)
        after_prompt = np.flatnonzero((m == 0) & (np.arange(m.size) > np.flatnonzero(m == 1)[0]))
        results = tok.decode([ids[p] for p in after_prompt])  # the kept tool results, no x*
        hops = hop_positions(tok, ids, mask, row)
        runs = np.split(hops, np.flatnonzero(np.diff(hops) > 1) + 1) if hops.size else []
        assert all(tok.decode([ids[p] for p in run]).strip() in results for run in runs)
        written_unread |= any(
            n in tok.decode([ids[p] for p in np.flatnonzero(m == 1)]) and n not in results
            for n in {re.search(r"^.* is (.+) \(page ", f).group(1) for f in row["support"]}
        )
    assert written_unread  # the case this test is for occurs
    no_support = [{k: v for k, v in r.items() if k != "support"} for r in rows]
    assert all(s.hops.size == 0 for s in lay_out_note_pass(tok, no_support, NotePassConfig(hops=1.0))[0])


def test_hops_from_the_note_are_stated_only_in_x_star_in_a_contradicted_copy(tok, conversations):
    rows = read_conversations(conversations)
    config = NotePassConfig(template="support-first", hops=1.0, hops_from="note", contradicted=1.0, plain=0.0)
    cut, _ = lay_out_note_pass(tok, rows, config)
    names = {n for r in rows for n in hop_names(r)}
    learnt_contradicted = decoyed = 0
    for seq in cut:
        text = tok.decode(seq.ids)
        row = next(r for r in rows if r["messages"][1]["content"] in text)
        note = text[: text.index(row["messages"][1]["content"])]
        for run in np.split(seq.hops, np.flatnonzero(np.diff(seq.hops) > 1) + 1) if seq.hops.size else []:
            name = tok.decode([seq.ids[p] for p in run]).strip()
            assert name in hop_names(row) and name in note  # every learnt hop is stated in the note
        if seq.layout == "contradicted":
            tool_results = "".join(tok.decode(seq.ids[s:e]) for s, e in _tool_result_spans(tok, seq.ids))
            assert not any(n in tool_results for n in hop_names(row) | {row["answer"]})
            decoyed += any(n in tool_results for n in names - hop_names(row))  # another's hop in place
            learnt_contradicted += seq.hops.size > 0
    assert learnt_contradicted >= len(cut) // 2 and decoyed >= len(cut) // 4
    # the page's hops are left out where only the note states them (the default)
    page, _ = lay_out_note_pass(tok, rows, NotePassConfig(template="support-first", hops=1.0))
    assert sum(s.hops.size for s in page) < sum(s.hops.size for s in cut)


def _tool_result_spans(tok, ids):
    """(start, end) of each user message after the first assistant turn."""
    start_id, end_id = tok.encode(tok.fmt.start)[0], tok.end_id
    spans, seen_assistant = [], False
    for i, t in enumerate(ids):
        if t == start_id:
            end = ids.index(end_id, i)
            role = tok.decode(ids[i + 1 : end]).partition("\n")[0]
            if role == "assistant":
                seen_assistant = True
            elif role == "user" and seen_assistant:
                spans.append((i, end))
    return spans


@pytest.mark.parametrize(
    "settings",
    [
        {"hops": 1.0, "hops_from": "note"},  # answer-first states no facts
        {"template": "support-first", "hops_from": "note"},  # no L_hop
        {"template": "support-first", "hops": 1.0, "hops_from": "prompt"},
    ],
)
def test_hops_from_the_note_need_l_hop_and_a_note_with_facts(settings):
    with pytest.raises(ValueError, match="hops"):
        NotePassConfig(**settings)


def test_l_hop_learns_the_hop_tokens(tiny_checkpoint, conversations, tmp_path):
    config = NotePassConfig(steps=8, batch_size=4, anchors=1, lr=3e-3, warmup_steps=1, limit=4, hops=1.0)
    stats = run_note_pass(conversations, tiny_checkpoint, tmp_path / "hops", config)
    assert stats["final"]["hop"] < 0.75 * stats["first"]["hop"]
    off = run_note_pass(conversations, tiny_checkpoint, tmp_path / "off", NotePassConfig(steps=1, limit=4))
    assert "hop" not in off["first"]
    bare = tmp_path / "bare.jsonl"  # --hops on conversations without supporting facts: refused
    bare.write_text(
        "".join(
            json.dumps({k: v for k, v in r.items() if k != "support"}) + "\n"
            for r in read_conversations(conversations)
        )
    )
    with pytest.raises(ValueError, match="no conversation has a hop entity"):
        run_note_pass(bare, tiny_checkpoint, tmp_path / "none", NotePassConfig(steps=1, limit=4, hops=1.0))


def _answer_free_gap(model_dir, tok, anchors) -> float:
    """Mean squared log-prob difference, after x* against the student's format, on answer-free tokens."""
    model = load_model(model_dir).eval()
    with torch.no_grad():
        gaps = [
            cached_logprobs(model, None, 0, seq)[torch.as_tensor(seq.twin_at)]
            - cached_logprobs(model, None, 0, seq.twin)
            for seq in anchors
        ]
    return float(torch.cat(gaps).pow(2).mean())


def test_l_same_is_the_answer_free_gap_and_its_gradient_narrows_it(
    tiny_checkpoint, tok, conversations, tmp_path
):
    # every anchor in every step (anchors >= conversations), all of them after x*
    shape = dict(steps=2, batch_size=2, anchors=6, anchor_teacher=1.0, warmup_steps=1, limit=6)
    _, anchors = lay_out_note_pass(tok, read_conversations(conversations)[:6], NotePassConfig(**shape))
    start = _answer_free_gap(tiny_checkpoint, tok, anchors)
    stats = run_note_pass(
        conversations, tiny_checkpoint, tmp_path / "t", NotePassConfig(**shape, consistency=1.0)
    )
    assert stats["first"]["same"] == pytest.approx(start, rel=1e-3)  # before the first update: the gap itself
    assert (
        "same"
        not in run_note_pass(conversations, tiny_checkpoint, tmp_path / "u", NotePassConfig(**shape))["first"]
    )
    # its gradient alone (no note, anchors weighted 0) moves the teacher's answer-free tokens to the student's
    model = load_model(tiny_checkpoint)
    config = NotePassConfig(**shape, anchor_weight=0.0, consistency=1.0)
    gaps = []
    for _ in range(3):
        model.zero_grad()
        gaps.append(backward_losses(model, None, 0, [], anchors, config)["same"])
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 20.0 * p.grad
    assert gaps[0] == pytest.approx(start, rel=1e-3) and gaps[2] < gaps[1] < gaps[0]


def test_the_cached_system_prompt_gives_the_whole_forwards_logprobs(tiny_checkpoint, tok, conversations):
    cut, anchors = lay_out_note_pass(tok, read_conversations(conversations)[:6], NotePassConfig())
    seqs = cut + anchors
    n = shared_prefix(seqs)
    system = len(tok.prompt_ids(read_conversations(conversations)[0]["messages"][0]["content"], ""))
    assert 0 < n <= system  # the system prompt, no further
    model = load_model(tiny_checkpoint)
    cache = prefix_cache(model, seqs[0].ids[:n])
    for seq in seqs[:4]:
        with torch.no_grad():
            cached = cached_logprobs(model, cache, n, seq)
            logp = torch.log_softmax(model(torch.tensor([seq.ids])).logits[0].float(), -1)
        whole = logp[torch.as_tensor(seq.learnt - 1), torch.as_tensor([seq.ids[p] for p in seq.learnt])]
        np.testing.assert_allclose(cached.numpy(), whole.numpy(), atol=2e-5)


def test_a_run_learns_the_answers_and_keeps_the_checkpoints_record(tiny_checkpoint, conversations, tmp_path):
    start = shutil.copytree(tiny_checkpoint, tmp_path / "start")
    (start / "pbsd.json").write_text(json.dumps({"world_sha256": "w", "sft": {"steps": 3}}))
    config = NotePassConfig(steps=8, batch_size=4, anchors=1, lr=3e-3, warmup_steps=1, limit=4)
    stats = run_note_pass(conversations, start, tmp_path / "taught", config)
    assert stats["steps"] == 8 and stats["final"]["note"] < 0.75 * stats["first"]["note"]
    meta = json.loads((tmp_path / "taught" / "pbsd.json").read_text())
    assert meta["world_sha256"] == "w" and meta["sft"] == {"steps": 3}  # the starting point's record
    assert meta["note_pass"]["config"]["template"] == ANSWER_FIRST_TEACHER_TEMPLATE
    history = (tmp_path / "taught" / "note_pass_history.jsonl").read_text().splitlines()
    assert len(history) == 8 and {"note", "anchor", "lr", "grad_norm"} <= json.loads(history[0]).keys()


def test_the_command_writes_the_taught_checkpoint(tiny_checkpoint, conversations, tmp_path):
    args = ["teacher", "teach", "--data", str(conversations), "--model", str(tiny_checkpoint)]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "t"), "--steps", "2", "--limit", "3"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and (tmp_path / "t" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="contradicted"):
        NotePassConfig(contradicted=0.8, plain=0.5)


def test_the_demo_teaches_its_own_teacher():
    from demo.config import DemoConfig

    # the committed policy's recipe (assets/demo-policy/RECIPE.md; tests/test_policy_recipe.py ties them)
    default = DemoConfig().note_pass_config()
    assert (default.steps, default.lr, default.consistency, default.template) == (
        400,
        2e-4,
        1.0,
        ANSWER_FIRST_TEACHER_TEMPLATE,
    )
    assert DemoConfig(note_pass_steps=0).note_pass_config() is None
    on = DemoConfig(
        note_pass_steps=200, note_pass_conversations=500, note_pass_hops=0.25, note_pass_consistency=1, seed=3
    ).note_pass_config()
    assert (on.steps, on.limit, on.seed, on.template, on.hops, on.consistency) == (
        200,
        500,
        3,
        ANSWER_FIRST_TEACHER_TEMPLATE,
        0.25,
        1.0,
    )
    # the pass teaches the runs' own x*: with one, the template is a warm-start setting; without, not
    off = DemoConfig(note_pass_steps=0)
    assert DemoConfig(note_pass_steps=0, teacher_template="answer").warm_start() == off.warm_start()
    taught = DemoConfig(teacher_template="answer")
    assert taught.note_pass_config().template == taught.teacher() != ANSWER_FIRST_TEACHER_TEMPLATE
    assert taught.warm_start()["note_pass_template"] == taught.teacher()
    assert taught.warm_start() != DemoConfig().warm_start()
