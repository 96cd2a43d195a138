"""The generated world: determinism, unique answers, answerability, splits, file formats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worldgen.build import build_world
from worldgen.documents import build_corpus
from worldgen.formats import load_corpus, load_questions
from worldgen.graph import RELATIONS, generate
from worldgen.questions import QuestionBuilder, evaluate
from worldgen.splits import LeakError, Splits, check_no_leaks


@pytest.fixture(scope="module")
def small_world(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    return build_world(out, seed=7, entities=2000, n_rl=300, n_val=100, n_sft=300)


def test_same_seed_same_bytes(tmp_path, small_world):
    again = build_world(tmp_path / "again", seed=7, entities=2000, n_rl=300, n_val=100, n_sft=300)
    files = sorted(p.relative_to(small_world.out) for p in small_world.out.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(again.out) for p in again.out.rglob("*") if p.is_file())
    for f in files:
        assert (small_world.out / f).read_bytes() == (again.out / f).read_bytes(), f
    other = build_world(tmp_path / "other", seed=8, entities=2000, n_rl=300, n_val=100, n_sft=300)
    assert (other.out / "corpus.jsonl").read_bytes() != (small_world.out / "corpus.jsonl").read_bytes()


def test_graph_is_typed_and_functional():
    g = generate(3, 1000)
    types = {e.type for e in g.entities.values()}
    assert types == {"country", "city", "person", "organisation", "work", "species", "event"}
    for src, rel, dst in g.relations():
        assert (g.entities[src].type, g.entities[dst].type) == RELATIONS[rel]
    # years are consistent along relations
    for src, rel, dst in g.relations():
        s, d = g.entities[src], g.entities[dst]
        if rel == "created_by":
            assert int(s.attrs["year"]) >= int(d.attrs["born"])
        if rel == "founded_by":
            assert int(s.attrs["founded"]) > int(d.attrs["born"])


def test_every_answer_is_unique_in_the_graph(small_world):
    g = small_world.graph
    for split, qs in small_world.splits.items():
        for q in qs:
            assert evaluate(g, q) == {q.answer_entity}, (split, q.id, q.question)
            assert 2 <= len(q.hops) <= 5
            assert q.difficulty in ("easy", "medium", "hard")
            assert q.answer.lower() not in q.question.lower()


def test_ambiguous_questions_are_rejected():
    """Inverse hops that match several entities never survive the builder."""
    g = generate(11, 1500)
    builder = QuestionBuilder(g, 11)
    kept = builder.build(400)
    for q in kept:
        assert len(evaluate(g, q)) == 1
    # a hand-made ambiguous wording: every city of a country is "the city in X"
    country = next(
        e for e in g.entities.values() if e.type == "country" and len(g.inn[e.id]["located_in"]) > 1
    )
    from worldgen.questions import Hop, Question

    q = Question(
        "x",
        "?",
        "?",
        (),
        (
            Hop(country.id, "located_in", True, g.inn[country.id]["located_in"][0]),
            Hop(g.inn[country.id]["located_in"][0], "located_in", False, country.id),
        ),
        country.id,
        "name",
        None,
        "easy",
    )
    assert len(builder._step({country.id}, q.hops[0])) > 1


def test_every_question_is_answerable_by_reading_its_path(small_world):
    g = small_world.graph
    docs = {d.id: d.text for d in build_corpus(g, 7)}
    for _split, qs in small_world.splits.items():
        for q in qs:
            if q.clue:  # the obfuscated start's page states the clue's facts
                start = g.entities[q.hops[0].source]
                assert g.entities[q.clue.anchor].name in docs[start.id]
                assert str(start.attrs[q.clue.attribute]) in docs[start.id]
            for hop in q.hops:
                assert g.entities[hop.target].name in docs[hop.source], (q.id, hop)
            assert q.answer in docs[q.answer_entity]


def test_splits_have_paper_defaults_and_no_leaks(tmp_path):
    r = build_world(tmp_path / "w", seed=1, entities=2500)
    assert (len(r.splits.rl), len(r.splits.validation)) == (575, 200)
    check_no_leaks(r.splits)
    manifest = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert manifest["questions"] == {"rl": 575, "validation": 200, "sft": 1000}


def test_leak_check_catches_shared_paths_and_answers(small_world):
    s = small_world.splits
    with pytest.raises(LeakError, match=r"answer entity|hop path|question"):
        check_no_leaks(Splits(rl=[*s.rl, s.validation[0]], validation=s.validation, sft=s.sft))


def test_files_load_back(small_world):
    qs = load_questions(small_world.out / "questions" / "validation.jsonl")
    assert not qs.problems and len(qs.items) == 100
    first = qs.items[0]
    assert first.id.startswith("q") and first.difficulty and "hops" in first.metadata
    corpus = load_corpus(small_world.out / "corpus.jsonl")
    assert not corpus.problems and len(corpus.items) == 2000
    assert all(d.url.startswith("kb://") for d in corpus.items)


def test_parquet_round_trip(tmp_path):
    pytest.importorskip("pyarrow")
    r = build_world(tmp_path / "p", seed=2, entities=1500, n_rl=100, n_val=50, n_sft=50, parquet=True)
    via_parquet = load_questions(r.out / "questions" / "rl.parquet")
    via_jsonl = load_questions(r.out / "questions" / "rl.jsonl")
    assert not via_parquet.problems and via_parquet.items == via_jsonl.items
    # built again into the same folder without Parquet: no earlier world's Parquet is left beside it
    build_world(r.out, seed=3, entities=1500, n_rl=100, n_val=50, n_sft=50)
    assert not list(r.out.rglob("*.parquet"))


def test_a_world_is_checked_against_its_manifest(tiny_world, tmp_path):
    from worldgen.build import checked_manifest

    assert checked_manifest(tiny_world)["seed"] == 11
    world = tmp_path / "w"
    shutil.copytree(tiny_world, world)
    with (world / "corpus.jsonl").open("a") as f:
        f.write('{"url": "kb://x", "title": "x", "text": "x"}\n')
    with pytest.raises(ValueError, match=r"corpus\.jsonl has changed since the world was built"):
        checked_manifest(world)
    (world / "corpus.jsonl").unlink()
    with pytest.raises(ValueError, match=r"corpus\.jsonl is missing"):
        checked_manifest(world)
    (world / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"manifest\.json is not JSON"):
        checked_manifest(world)
    (world / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="lists no files"):
        checked_manifest(world)


def test_user_files_and_bad_lines_are_reported_with_line_numbers(tmp_path: Path):
    f = tmp_path / "mine.jsonl"
    f.write_text(
        '{"question": "Capital of France?", "answer": "Paris"}\n'
        "\n"
        '{"problem": "BrowseComp-style?", "answer": 42}\n'
        "not json at all\n"
        '{"question": "no answer"}\n'
        '["a list"]\n'
        '{"question": "", "answer": "x"}\n'
        '{"id": "dup", "question": "a?", "answer": "b"}\n'
        '{"id": "dup", "question": "c?", "answer": "d"}\n'
    )
    report = load_questions(f)
    assert [q.question for q in report.items] == ["Capital of France?", "BrowseComp-style?", "a?"]
    assert report.items[1].answer == "42"
    lines = {n: msg for n, msg in report.problems}
    assert set(lines) == {4, 5, 6, 7, 9}
    assert "not valid JSON" in lines[4]
    assert "missing field(s) answer" in lines[5]
    assert "expected an object" in lines[6]
    assert "question" in lines[7]
    assert "duplicate id" in lines[9]


def test_answers_that_are_no_answer_and_rows_nested_past_the_stack_are_reported(tmp_path: Path, caplog):
    """null, a list, a truth value or NaN was read as its spelling ("None", "[1, 2]", "True", "nan"),
    a gold answer no one means; a line nested past the parser's stack crashed the loader, which
    promises never to crash on a bad line; and a file's bad rows were left out without a word."""
    f = tmp_path / "mine.jsonl"
    rows = [None, [1, 2], True, {"x": 1}, 1912, 0.5, "Vienna"]
    f.write_text(
        "".join(json.dumps({"question": f"q{i}?", "answer": a}) + "\n" for i, a in enumerate(rows))
        + '{"question": "q?", "answer": NaN}\n'
        + '{"question": "q?", "answer": Infinity}\n'
        + "[" * 100_000
        + "\n"
        + '{"question": "q?", "answer": '
        + "1" * 5000  # past Python's 4,300 digits: a ValueError that is no JSONDecodeError
        + "}\n"
        + '{"question": null, "problem": "BrowseComp-style?", "answer": "b", "id": 7}\n'
    )
    report = load_questions(f)
    assert [q.answer for q in report.items] == ["1912", "0.5", "Vienna", "b"]
    assert report.items[-1].id == "7"  # a numbered row keeps its number
    lines = {n: msg for n, msg in report.problems}
    assert set(lines) == {1, 2, 3, 4, 8, 9, 10, 11}
    assert all("answer must be text or a finite number" in lines[n] for n in (1, 2, 3, 4, 8, 9))
    assert "nested too deep" in lines[10] and "4300 digits" in lines[11]
    with caplog.at_level("WARNING"):
        report.raise_if_empty(f)
    assert "8 rows left out, 4 kept" in caplog.text and "line 1: answer must be" in caplog.text


def test_parquet_keeps_text_that_reads_as_json_and_columns_the_first_row_lacks(tmp_path: Path):
    """A question or answer spelled like JSON ("[1, 2]") came back decoded ("[0.10]" as "[0.1]", a
    question refused), and a column the first row lacked was dropped from every row."""
    pytest.importorskip("pyarrow")
    from worldgen.formats import write_parquet

    f = tmp_path / "q.parquet"
    write_parquet(
        f,
        [
            {"id": "a", "question": "[1, 2]", "answer": "[0.10]"},
            {
                "id": "b",
                "question": "q?",
                "answer": "x",
                "support": ["a is x (page kb://a)"],
                "aliases": ["X"],
            },
            {"id": "c", "question": "q?", "answer": None},
            {"id": "d", "problem": "p?", "answer": "y"},  # its question column is null
        ],
    )
    report = load_questions(f)
    assert [(q.question, q.answer) for q in report.items] == [("[1, 2]", "[0.10]"), ("q?", "x"), ("p?", "y")]
    assert report.items[1].support == ("a is x (page kb://a)",) and report.items[1].aliases == ("X",)
    assert report.items[0].support == () and [n for n, _ in report.problems] == [3]


def test_a_file_of_junk_keeps_the_first_thousand_problems_and_counts_the_rest(tmp_path, caplog):
    """A large file named as questions (a corpus, a checkpoint) held one problem per line."""
    f = tmp_path / "junk.jsonl"
    f.write_text('{"question": "a?", "answer": "b"}\n' + "junk\n" * 5000)
    report = load_questions(f)
    assert len(report.items) == 1 and len(report.problems) == 1000 and report.left_out == 5000
    report.raise_if_empty(f)
    assert "5000 rows left out, 1 kept" in caplog.text
