"""Grounding counts: copied searches, reads and answers count, made-up ones do not; the oracle is
fully grounded; the evaluation reports it from real trajectories."""

from __future__ import annotations

import json

import pytest

from agent.catalogue import READ, SEARCH
from agent.grounding import Grounding, names, urls, words
from agent.toolcall import format_tool_call
from worldgen.oracle import write_sft_data


def _search(q: str) -> str:
    return "Searching.\n\n" + format_tool_call(SEARCH.server_name, SEARCH.name, {"q": q, "num": 3})


def _read(url: str) -> str:
    return "Reading.\n\n" + format_tool_call(
        READ.server_name, READ.name, {"url": url, "info_to_extract": "x"}
    )


RESULT = json.dumps(
    {
        "organic": [
            {
                "title": "Roxheim",
                "link": "kb://place/roxheim-port",
                "snippet": "Roxheim Port, founded by Shioo.",
            }
        ]
    }
)


def test_words_names_and_urls():
    assert words("Cethzeaboum University's seat, 1917") == {"cethzeaboum", "university", "s", "seat", "1917"}
    assert names("the painter Cethzeaboum, born 1917 in x2") == {"cethzeaboum", "1917", "x2"}
    assert urls(RESULT) == {"kb://place/roxheim-port"}
    assert urls("see [the page](https://example.org/a_b?c=1). Or https://x.io/y.") == {
        "https://example.org/a_b?c=1",
        "https://x.io/y",
    }


def test_copied_actions_count_and_made_up_ones_do_not():
    g = Grounding()
    question = "Who founded the port of Roxheim?"
    g.add(
        question,
        [
            (_search("Roxheim port"), RESULT),  # every word from the question
            (_search("Zorbel port"), "{}"),  # a made-up name
            (_read("kb://place/roxheim-port"), "page"),  # from the result, whole
            (_read("kb://place/roxheim"), "page"),  # a prefix of a result's address
            (_search("Shioo Zorbel"), "{}"),  # half made up
            (_search("founder Shioo 1917"), "{}"),  # "Shioo" came from the result; 1917 from nowhere
            (_search("founder Shioo"), "{}"),  # "founder" is the agent's own word, not a name
            ("Thinking without a tool call.", ""),
            ("\\boxed{Shioo}", ""),
        ],
        "Shioo",
    )
    s = g.summary()
    assert s["queries"] == {"total": 5, "grounded": 2, "fraction": 0.4}
    assert s["reads"] == {"total": 2, "grounded": 1, "fraction": 0.5}
    assert s["answers"] == {"total": 1, "grounded": 1, "fraction": 1.0}


def test_a_url_or_answer_seen_only_in_the_question_or_inside_a_word_is_not_grounded():
    g = Grounding()
    g.add(
        "Read kb://place/roxheim-port: who founded Rox?", [(_read("kb://place/roxheim-port"), RESULT)], "Rox"
    )
    g.add("Who founded Roxheim Port?", [(_search("Roxheim Port"), RESULT)], None)  # no answer: not counted
    g.add("Who?", [], " ")
    s = g.summary()
    assert s["reads"]["grounded"] == 0 and s["answers"] == {"total": 1, "grounded": 0, "fraction": 0.0}
    assert s["queries"]["fraction"] == 1.0
    assert Grounding().summary()["reads"] == {"total": 0, "grounded": 0, "fraction": 0.0}


def test_the_oracle_is_fully_grounded(tiny_world, tmp_path):
    write_sft_data(tiny_world, tmp_path / "oracle.jsonl", limit=40)
    g = Grounding()
    for line in (tmp_path / "oracle.jsonl").read_text().splitlines():
        row = json.loads(line)
        m = row["messages"][2:]
        turns = [
            (m[i]["content"], m[i + 1]["content"] if i + 1 < len(m) else "") for i in range(0, len(m), 2)
        ]
        g.add(row["question"], turns, row["answer"])
    s = g.summary()
    assert s["queries"]["total"] > 40 and s["reads"]["total"] > 40 and s["answers"]["total"] == 40
    assert all(part["fraction"] == 1.0 for part in s.values()), s


@pytest.mark.parametrize("made_up", [False, True])
def test_turn_texts_recover_what_was_said_and_returned(tiny_checkpoint, made_up):
    from agent.chat import ChatTokenizer
    from agent.transcript import turn_texts

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    first = _search("Zorbel" if made_up else "Roxheim")
    ids = tok.encode(first) + [tok.end_id] + tok.glue_ids(RESULT, closed=True)
    spans = [(0, len(tok.encode(first)) + 1)]
    ids += tok.encode("\\boxed{Shioo}") + [tok.end_id]
    spans.append((spans[0][1] + len(tok.glue_ids(RESULT, closed=True)), len(ids)))
    turns = turn_texts(ids, spans, tok)
    assert turns == [(first, RESULT), ("\\boxed{Shioo}", "")]
    g = Grounding()
    g.add("Who founded Roxheim?", turns, "Shioo")
    assert g.summary()["queries"]["grounded"] == (0 if made_up else 1)


def test_batch_metrics_report_grounding_per_training_step(tiny_checkpoint, monkeypatch):
    from agent.chat import ChatTokenizer
    from proto.runs import PbsdSpec
    from services.trainer.dynamics import batch_metrics
    from tests.test_scorer import _group, _trajectory
    from tests.test_trainer_policy import _scored

    tok = ChatTokenizer.from_pretrained(tiny_checkpoint)
    result = json.dumps(
        {"organic": [{"link": "kb://river/danube", "snippet": "The Danube flows through Vienna."}]}
    )
    trajectories = (
        _trajectory(tok, [_search("Vienna river"), "\\boxed{Danube}"], result, i=0),
        _trajectory(
            tok, [_search("Zorbel river"), _read("kb://river/danube"), "\\boxed{Danube}"], result, i=1
        ),
    )
    group = _group(tok, PbsdSpec()).model_copy(update={"trajectories": trajectories})
    out = batch_metrics([_scored(group, advantages=[1.0, -1.0])], 0, tok)
    assert out["grounded_queries_frac"] == 0.5 and out["grounded_reads_frac"] == 1.0
    assert "grounded_answers_frac" not in out  # these trajectories carry no boxed answer to check
    assert not any(
        k.startswith("grounded_") for k in batch_metrics([_scored(group, advantages=[1.0, -1.0])], 0)
    )
    # a large batch is measured on a spread sample: here, one trajectory of two (the first)
    monkeypatch.setattr("services.trainer.dynamics.GROUNDING_SAMPLE", 1)
    sampled = batch_metrics([_scored(group, advantages=[1.0, -1.0])], 0, tok)
    assert sampled["grounded_queries_frac"] == 1.0 and "grounded_reads_frac" not in sampled


def test_the_reports_action_rows_come_from_the_scorers_tallies():
    from demo.report import action_rows
    from proto.sanity import EvidenceTally, TeacherSanity

    def tally(*s):
        return EvidenceTally.of(s, eps_pos=0.001, eps_neg=0.003)

    sanity = TeacherSanity(
        actions={
            "answers/grounded": tally(0.0),
            "reads/made-up": tally(-0.1),
            "queries/made-up": tally(-0.3),
            "queries/grounded": tally(0.2, -0.1),
        }
    )
    got = action_rows(sanity)
    assert [(c["action"], c["grounded"], c["turns"]) for c in got] == [
        ("search", True, 2),
        ("search", False, 1),
        ("read", False, 1),
        ("answer", True, 1),
    ]
    assert got[0]["mean_s"] == pytest.approx(0.05) and got[0]["teacher_higher"] == 0.5
    assert got[3]["teacher_higher"] == 0.0  # s = 0 is not teacher > student


def test_a_search_in_the_last_turn_keeps_its_verdict():
    """The last turn's verdict is its boxed answer only when it calls no tool."""
    from agent.grounding import turn_verdicts

    call = _search("Danube delta")
    assert turn_verdicts("Which river?", [(call, "result about Danube")], "Danube") == [("queries", False)]


def test_a_blank_query_is_not_grounded():
    from agent.grounding import judge

    call = _search("  ")
    assert judge("Which river?", [(call, "x")], None) == ([("queries", False)], None)
