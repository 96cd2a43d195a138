"""The privileged context: supporting facts from the world, the teacher templates that use them,
and SFT conversations laid out after x* exactly as the scorer builds x*."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agent.chat import ChatTokenizer
from agent.privileged import fill_template, teacher_prompt_ids
from proto.runs import PbsdSpec
from proto.templates import DEFAULT_TEACHER_TEMPLATE, SUPPORT_TEACHER_TEMPLATE, TEACHER_TEMPLATES
from services.scorer.contexts import build_contexts
from services.trainer.sft import SftConfig, encode_conversation
from services.trainer.teacher_sft import teacher_format
from worldgen.formats import load_questions, require_support
from worldgen.graph import load_graph
from worldgen.oracle import load_world_questions


def test_every_question_carries_the_chain_of_facts_its_answer_rests_on(tiny_world):
    g = load_graph(tiny_world)
    documents = {json.loads(x)["url"]: json.loads(x)["text"] for x in (tiny_world / "corpus.jsonl").open()}
    for split in ("rl", "validation", "sft"):
        for q in load_world_questions(tiny_world, split):
            clue = 1 if q.clue is not None else 0
            year = 1 if q.answer_kind == "year" else 0
            assert len(q.support) == clue + len(q.hops) + year, q.id
            for hop, fact in zip(q.hops, q.support[clue:], strict=False):
                source, target = g.entities[hop.source], g.entities[hop.target]
                assert fact.endswith(f" is {target.name} (page {source.url})"), fact
                assert target.name in documents[source.url]  # the page named states the fact
            assert q.answer in q.support[-1]
    # the question files a run reads keep them
    records = load_questions(tiny_world / "questions" / "rl.jsonl").items
    assert all(r.support for r in records) and "support" not in records[0].metadata


def test_the_templates_and_their_fields():
    assert not PbsdSpec().needs_support
    assert PbsdSpec(teacher_template=SUPPORT_TEACHER_TEMPLATE).needs_support
    for bad in ("{question} {facts} {answer}", "{question} only", "{answer} {support}", "answer-last"):
        with pytest.raises(ValueError, match="teacher_template"):
            PbsdSpec(teacher_template=bad)
    # a template's name stands for it, in a run spec file as on the command line
    for name, template in TEACHER_TEMPLATES.items():
        assert PbsdSpec(teacher_template=name).teacher_template == template
    assert PbsdSpec(teacher_template="support").needs_support
    assert PbsdSpec(teacher_template="support-first").needs_support
    short = fill_template(
        TEACHER_TEMPLATES["support-first"], "Q?", "Vienna", ["a is b (page kb://a)", "b is Vienna"]
    )
    assert short == "Verified answer: Vienna\nFacts: a is b (page kb://a); b is Vienna\n\nQ?"
    text = fill_template(SUPPORT_TEACHER_TEMPLATE, "Q?", "Vienna", ["a is b (page kb://a)", "b is Vienna"])
    assert text.startswith("Q?\n\n") and '"Vienna"' in text and "a is b (page kb://a); b is Vienna" in text
    assert fill_template(DEFAULT_TEACHER_TEMPLATE, "Q?", "Vienna") == DEFAULT_TEACHER_TEMPLATE.format(
        question="Q?", answer="Vienna"
    )
    with pytest.raises(ValueError, match="no supporting facts"):
        fill_template(SUPPORT_TEACHER_TEMPLATE, "Q?", "Vienna", [])


def test_a_template_fills_its_fields_as_written_and_nothing_more():
    """A format spec nests fields of its own or pads the answer to any width, and a conversion changes
    how x* shows the answer: a spec accepted them, and every group of the run then failed in the
    scorer (or filled a gigabyte of x*). An escaped brace is text, not a field."""
    for bad in (
        "{question} {answer:{0}}",
        "{question} {answer:{question.__class__.__mro__}}",
        "{question} {answer:>999999999}",
        "{question} {answer!r}",
        "{question!a} {answer}",
    ):
        with pytest.raises(ValueError, match="no format spec but a precision"):
            PbsdSpec(teacher_template=bad)
    # a precision only cuts: the note with its answer left out, a control the docs use
    assert (
        fill_template(PbsdSpec(teacher_template="{question} [{answer:.0}]").teacher_template, "Q?", "V")
        == "Q? []"
    )
    escaped = PbsdSpec(teacher_template="{question} {answer} {{support}}")
    assert not escaped.needs_support
    assert fill_template(escaped.teacher_template, "Q?", "Vienna") == "Q? Vienna {support}"


@pytest.mark.parametrize("template", TEACHER_TEMPLATES.values())
def test_x_star_is_the_student_prompt_but_for_its_filled_text(tiny_checkpoint, template):
    """x* keeps the student's markup and encodes what the template adds as text: a question that
    spells <|im_end|> was a string in x and a real turn boundary in x*, so the teacher read another
    conversation, and s measured that rather than the answer."""
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    support = ["a is b (page kb://a)"]
    for question, answer in [
        ("Where does the Danube end?", "Black Sea"),
        ("What is <|im_end|>?", "<|im_start|>"),
    ]:
        prompt = tok.prompt_ids("You search.", question)
        teacher = teacher_prompt_ids(tok, prompt, answer, template, support)
        assert teacher.count(tok.end_id) == prompt.count(tok.end_id) == 2
        filled = fill_template(template, question, answer, support)
        assert teacher == tok.prompt_ids("You search.", filled)


def test_a_run_with_the_support_template_refuses_questions_without_facts(tiny_world, tmp_path):
    records = load_questions(tiny_world / "questions" / "rl.jsonl").items
    support = PbsdSpec(teacher_template=SUPPORT_TEACHER_TEMPLATE)
    require_support(support, records, "rl.jsonl")
    require_support(PbsdSpec(), [r.model_copy(update={"support": ()}) for r in records], "rl.jsonl")
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"id": "q1", "question": "Q?", "answer": "A"}) + "\n")
    with pytest.raises(ValueError, match=r"1 of 1 questions in .*bare.jsonl have no supporting facts"):
        require_support(support, load_questions(bare).items, bare)


@pytest.mark.parametrize("template", [DEFAULT_TEACHER_TEMPLATE, SUPPORT_TEACHER_TEMPLATE])
def test_sft_lays_out_a_conversation_after_the_very_x_star_the_scorer_scores(tiny_checkpoint, template):
    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    row = {
        "answer": "Vienna",
        "support": ["the capital of Austria is Vienna (page kb://country/austria)"],
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "What is the capital of Austria?"},
            {"role": "assistant", "content": "Let me search."},
            {"role": "user", "content": "Vienna is the capital."},
            {"role": "assistant", "content": "\\boxed{Vienna}"},
        ],
    }
    ids, mask = encode_conversation(tok, row["messages"])
    privileged, privileged_mask = teacher_format(tok, row, ids, mask, template)
    prompt = tok.prompt_ids(row["messages"][0]["content"], row["messages"][1]["content"])
    x_star = teacher_prompt_ids(tok, prompt, "Vienna", template, row["support"])
    assert privileged == x_star + ids[len(prompt) :]
    assert privileged_mask == [0] * len(x_star) + mask[len(prompt) :]
    # the scorer's teacher context of the same trajectory, token for token
    completion = ids[len(prompt) :]
    loss = np.asarray(mask[len(prompt) :])
    contexts = build_contexts(
        tok,
        prompt,
        completion,
        loss,
        [(0, len(completion))],
        answer="Vienna",
        template=template,
        teacher_max_length=10_000,
        support=row["support"],
    )
    assert contexts.teacher == privileged
    decoded = tok.decode(x_star)
    assert "Vienna" in decoded and (("kb://country/austria" in decoded) == ("{support}" in template))


def test_sft_config_checks_its_teacher_formats():
    assert SftConfig(teacher_formats=((DEFAULT_TEACHER_TEMPLATE, 0.5),)).teacher_formats
    with pytest.raises(ValueError, match="fraction"):
        SftConfig(teacher_formats=((DEFAULT_TEACHER_TEMPLATE, 0.0),))
    with pytest.raises(ValueError, match="teacher_template"):
        SftConfig(teacher_formats=(("{question} {hint}", 0.5),))


def test_a_contradicted_copy_names_a_decoy_in_every_tool_result_and_nowhere_else():
    from services.trainer.teacher_sft import contradict

    row = {
        "answer": "Vienna",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Where is Vienna? (Vienna, not Viennastadt)"},
            {"role": "assistant", "content": "Let me search for the capital."},
            {"role": "user", "content": '{"snippet": "Vienna is the capital; Viennastadt is not."}'},
            {"role": "assistant", "content": "So it is Vienna.\n\n\\boxed{Vienna}"},
        ],
    }
    out = contradict(row, "Graz")
    assert out["messages"][3]["content"] == '{"snippet": "Graz is the capital; Viennastadt is not."}'
    assert out["messages"][:3] == row["messages"][:3] and out["messages"][4] == row["messages"][4]
    assert row["messages"][3]["content"].startswith('{"snippet": "Vienna')  # the row is not changed
    assert contradict({**row, "answer": "Salzburg"}, "Graz") is None  # no tool result names it


def test_a_contradicted_copy_can_name_decoys_for_the_hops_too():
    from services.trainer.teacher_sft import contradict

    row = {
        "answer": "Vienna",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Where was the founder of Acme born?"},
            {"role": "assistant", "content": "Let me search for Acme."},
            {"role": "user", "content": '{"snippet": "Acme was founded by Ada Lovel, born in Vienna."}'},
            {"role": "assistant", "content": "So the founder is Ada Lovel.\n\n\\boxed{Vienna}"},
        ],
    }
    # one pass: a decoy that is another swapped name is not replaced again
    out = contradict(row, "Graz", {"Ada Lovel": "Vienna", "Acme": "Ada"})
    assert out["messages"][3]["content"] == '{"snippet": "Ada was founded by Vienna, born in Graz."}'
    assert out["messages"][:3] == row["messages"][:3] and out["messages"][4] == row["messages"][4]
    # the hops alone do not make a contradicted copy: the answer must be replaced somewhere
    assert contradict({**row, "answer": "Salzburg"}, "Graz", {"Acme": "Ada"}) is None


def test_teacher_copies_are_drawn_by_fraction_contradicted_by_share_and_seeded():
    from services.trainer.teacher_sft import TeacherCopies

    def row(i):
        answer = str(1900 + i) if i % 2 else f"City{i}"
        return {
            "id": f"r{i}",
            "answer": answer,
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "search"},
                {"role": "user", "content": f"the page says {answer}"},
                {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
            ],
        }

    rows = [row(i) for i in range(400)]
    formats = ((DEFAULT_TEACHER_TEMPLATE, 1.0), (SUPPORT_TEACHER_TEMPLATE, 0.5))
    copies = TeacherCopies(formats, 0.5, rows, seed=0)
    drawn = [(r["id"], f, c) for r in rows for f, c in copies.draw(r)]
    assert sum(f == 0 for _, f, _ in drawn) == 400 and 150 < sum(f == 1 for _, f, _ in drawn) < 250
    contradicted = [
        (rid, c) for rid, _, c in drawn if c["messages"][3]["content"] != f"the page says {c['answer']}"
    ]
    assert 0.4 < len(contradicted) / len(drawn) < 0.6
    for _, c in contradicted:  # a decoy of the answer's kind, another row's answer
        decoy = c["messages"][3]["content"].removeprefix("the page says ")
        assert decoy != c["answer"] and decoy.isdigit() == c["answer"].isdigit()
        assert c["messages"][4]["content"] == f"\\boxed{{{c['answer']}}}"
    same = TeacherCopies(formats, 0.5, rows, seed=0)
    assert [(r["id"], f, c) for r in rows for f, c in same.draw(r)] == drawn
    # the contradiction share changes which copies are contradicted, never which are drawn
    plain = TeacherCopies(formats, 0.0, rows, seed=0)
    assert [(r["id"], f) for r in rows for f, _ in plain.draw(r)] == [(a, f) for a, f, _ in drawn]


def test_the_demo_asks_for_a_teacher_pass_only_when_configured():
    from demo.config import DemoConfig

    assert DemoConfig().teacher_sft_config() is None  # the committed policy's recipe has none
    on = DemoConfig(teacher_sft_formats=["answer:0.5", "support:0.25"]).teacher_sft_config()
    assert on.teacher_formats == ((DEFAULT_TEACHER_TEMPLATE, 0.5), (SUPPORT_TEACHER_TEMPLATE, 0.25))
    assert (on.limit, on.epochs, on.lr, on.warmup_steps, on.teacher_contradict) == (800, 1, 1e-3, 5, 0.5)
    assert "teacher_sft_formats" in DemoConfig().warm_start()  # a changed setting builds anew


def test_the_answer_is_never_one_of_the_hops():
    from agent.privileged import hop_entities

    support = [
        "the river Vienna is on is Danube (page kb://danube)",
        "the capital of Austria is Vienna (page kb://vienna)",
    ]
    assert hop_entities(support, "Danube") == {"Vienna"}
