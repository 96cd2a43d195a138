"""Renamed oracle trajectories: every invented word replaced, consistently, nothing else touched."""

from __future__ import annotations

import json
import re

import pytest

from agent.toolcall import parse_tool_call
from pbsd.verifier import verify
from worldgen.graph import load_graph
from worldgen.oracle import write_sft_data
from worldgen.rename import invented_words

WORD = re.compile(r"[A-Za-z]+")


@pytest.fixture(scope="module")
def pair(tiny_world, tmp_path_factory):
    """The same oracle trajectories written plain and renamed."""
    out = tmp_path_factory.mktemp("rename")
    plain = write_sft_data(tiny_world, out / "plain.jsonl", limit=40)
    renamed = write_sft_data(tiny_world, out / "renamed.jsonl", limit=40, rename=1.0)
    rows = [
        [json.loads(line) for line in (out / name).read_text().splitlines()]
        for name in ("plain.jsonl", "renamed.jsonl")
    ]
    return plain, renamed, rows[0], rows[1], out


def _texts(row: dict) -> list[str]:
    return [row["question"], row["answer"], *(m["content"] for m in row["messages"])]


def test_every_trajectory_is_renamed_and_no_world_name_is_left(tiny_world, pair):
    plain, renamed, a, b, _ = pair
    assert plain["written"] == renamed["written"] == len(a) == len(b) > 30
    assert renamed["renamed"] == len(b) and plain["renamed"] == 0
    invented = invented_words(load_graph(tiny_world))
    assert len(invented) > 500
    for row in b:
        assert row["renamed"] > 0
        left = {w for t in _texts(row) for w in WORD.findall(t) if w in invented}
        assert not left, f"{row['id']} still names {sorted(left)[:5]}"


def test_renaming_is_one_consistent_word_for_word_substitution(tiny_world, pair):
    _, _, a, b, _ = pair
    invented = invented_words(load_graph(tiny_world))
    invented_lower = {w.lower() for w in invented}
    changed = 0
    for x, y in zip(a, b, strict=True):
        assert [m["role"] for m in x["messages"]] == [m["role"] for m in y["messages"]]
        forward: dict[str, str] = {}
        for tx, ty in zip(_texts(x), _texts(y), strict=True):
            wx, wy = WORD.findall(tx), WORD.findall(ty)
            assert len(wx) == len(wy)
            # Only the punctuation-free skeleton may differ, and only in invented words.
            assert WORD.sub("_", tx) == WORD.sub("_", ty)
            for u, v in zip(wx, wy, strict=True):
                if u == v:
                    continue
                assert u in invented or u.lower() in invented_lower, (u, v)
                assert forward.setdefault(u, v) == v, f"{u} renamed two ways in {x['id']}"
                changed += 1
        # Injective: two different names never collapse into one.
        assert len(set(forward.values())) == len(forward)
    assert changed > 1000


def test_renamed_trajectories_still_hang_together(pair):
    """Each read URL came from a search result, and the boxed answer is a name the tools showed."""
    _, _, _, b, _ = pair
    for row in b:
        shown = ""
        for m in row["messages"][1:]:
            if m["role"] == "user":
                shown += m["content"]
                continue
            call = parse_tool_call(m["content"]).call
            if call is not None and call.tool_name == "scrape_and_extract_info":
                assert call.arguments["url"] in shown
        assert verify(row["messages"][-1]["content"], row["answer"]).correct
        assert row["answer"] in shown


def test_fixed_words_survive_and_the_same_seed_gives_the_same_names(tiny_world, pair):
    _, _, a, b, out = pair
    fixed = ("University", "Philharmonic", "Press", "The answer is", "kb://person/", "google_search")
    for word in fixed:
        assert sum(word in t for r in a for t in _texts(r)) == sum(word in t for r in b for t in _texts(r))
    write_sft_data(tiny_world, out / "again.jsonl", limit=40, rename=1.0)
    assert (out / "again.jsonl").read_text() == (out / "renamed.jsonl").read_text()


def test_rename_fraction_mixes_plain_and_renamed(tiny_world, pair, tmp_path):
    _, _, a, _, _ = pair
    stats = write_sft_data(tiny_world, tmp_path / "half.jsonl", limit=40, rename=0.5)
    rows = [json.loads(line) for line in (tmp_path / "half.jsonl").read_text().splitlines()]
    assert 0 < stats["renamed"] < len(rows)
    plain = [r for r in rows if "renamed" not in r]
    assert len(plain) == len(rows) - stats["renamed"]
    assert all(r in a for r in plain)
