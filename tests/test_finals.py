"""Final answers token by token (services/scorer/finals.py): which tokens spell the answer, where
it was first written, how much room a reader of the answer has, and the finals by outcome and
grounding, on the hand-made groups of tests/test_teacher_sanity.py."""

from __future__ import annotations

import numpy as np
import pytest

from agent.chat import ChatTokenizer, spelled_at
from proto.runs import PbsdSpec
from services.scorer.evidence import score_group
from services.scorer.finals import answer_room, by_part, final_turns, token_parts
from tests.test_grounding import _search
from tests.test_scorer import TEMPLATE, _trajectory
from tests.test_teacher_sanity import EPS, RESULT, _hand_made_group, _reading_teacher


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


async def test_final_turns_show_where_a_final_answers_evidence_comes_from(tok):
    """Token by token, the finals of the hand-made group: the teacher lifts the right answer's tokens
    of an unsure student and has nothing to add to a sure one, whose correct finals therefore count
    as already sure and unfavoured."""
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0)
    for student, sure in ((-2.0, False), (-1e-5, True)):
        teacher = _reading_teacher(tok, gain=5.0, student=student)
        scored = await score_group(_hand_made_group(tok, spec), tok, teacher)
        rows = await final_turns(scored, tok, teacher)
        assert [r["correct"] for r in rows] == [True, False, True]
        assert [r["s"] for r in rows] == pytest.approx([float(s[-1]) for s in scored.turn_evidence])
        for r in rows:
            assert len(r["tokens"]) == len(r["student"]) == len(r["teacher"]) > 0
            assert "".join(r["tokens"]).startswith("\\boxed{")
            assert bool(r["answer_tokens"]) == r["correct"]  # "Danube", spelled whole, in the right ones only
            assert np.mean(np.subtract(r["teacher"], r["student"])) == pytest.approx(r["s"], abs=1e-4)
        assert all(r["written_tokens"] for r in rows)  # every final spells the answer it gives
        assert [r["grounded"] for r in rows] == [True, False, False]  # Danube read, Rhine and Danube not
        room = answer_room(rows, **EPS)
        by = room["by_outcome"]
        assert {k: v["finals"] for k, v in by.items()} == {
            "correct_grounded": 1,
            "correct_made_up": 1,
            "wrong_made_up": 1,
        }
        assert by["wrong_made_up"]["mean_s"] == pytest.approx(rows[1]["s"])
        assert (room["correct_finals"], room["naming_the_answer"]) == (2, 2)
        assert sum(v["room"] for v in room["correct_by_part"].values()) == pytest.approx(1.0)
        # this teacher moves the answer's tokens only: all its change lands in that part
        right = [r for r in rows if r["correct"]]
        lift = np.mean([np.sum(np.subtract(r["teacher"], r["student"])) for r in right])
        assert lift == pytest.approx(0.0, abs=1e-3) if sure else lift > 1.0
        by = room["correct_by_part"]
        assert by["answer"]["lift"] == pytest.approx(lift)
        assert [by[p]["lift"] for p in ("first", "markup", "phrasing")] == [0.0, 0.0, 0.0]
        # a wrong answer's likelihood can always fall, sure student or not
        assert (room["wrong_finals"], room["wrong_spelled"], room["wrong_disfavoured"]) == (1, 1, 1)
        assert room["wrong_sure"] == int(sure) and room["wrong_answer_change"] < -0.5
        if sure:
            assert (room["already_sure"], room["already_sure_favoured"], room["unsure"]) == (2, 0, 0)
            assert room["answer_only_room"] == room["answer_alone_room"] == 0  # nothing left to lift
            assert room["unsure_answer_lift"] is None  # no unsure finals: None, which JSON can hold
        else:
            assert (room["already_sure"], room["unsure"], room["unsure_favoured"]) == (0, 2, 2)
            assert room["unsure_answer_lift"] > 0.5
            assert room["answer_only_room"] == room["answer_alone_room"] == 2  # -2 nats: room above eps+


async def test_a_turn_cut_to_the_answer_bounds_every_shape_of_final(tok):
    """An answer the student gives at -0.002 nats a token: a teacher that lifts it to certainty moves
    a turn made of nothing but the answer's tokens by +0.002, above eps+ (answer_alone_room), while in
    the whole final turn the other tokens dilute that below eps+ (answer_only_room)."""
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0)
    teacher = _reading_teacher(tok, gain=5.0, student=-0.002)
    rows = await final_turns(await score_group(_hand_made_group(tok, spec), tok, teacher), tok, teacher)
    right = [r for r in rows if r["correct"]]
    assert all(len(r["answer_tokens"]) * 2 <= len(r["tokens"]) for r in right)  # the dilution, at least 2x
    room = answer_room(rows, **EPS)
    assert (room["naming_the_answer"], room["answer_alone_room"], room["answer_only_room"]) == (2, 2, 0)


def test_spelled_at_finds_whole_occurrences_only():
    assert spelled_at([5, 1, 2, 9, 1, 2, 1], {(1, 2), (7,)}) == [1, 2, 4, 5]
    assert spelled_at([1, 3, 2], {(1, 2)}) == [] and spelled_at([4], {()}) == []


async def test_final_turns_find_where_the_answer_was_first_written(tok):
    """A wrong answer committed in an earlier turn and repeated at the end: the final turn only copies
    it, and the row points at the turn that first wrote it, with that turn's evidence."""
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0)
    turns = ["It must be the Rhine. " + _search("Rhine river"), "\\boxed{Rhine}"]
    committed = _trajectory(tok, turns, RESULT, i=3, reward=0.0).model_copy(update={"final_answer": "Rhine"})
    group = _hand_made_group(tok, spec)
    group = group.model_copy(update={"trajectories": (*group.trajectories, committed)})
    teacher = _reading_teacher(tok, gain=5.0)
    scored = await score_group(group, tok, teacher)
    rows = await final_turns(scored, tok, teacher)
    assert [r["first_written"] for r in rows] == [None, None, None, 0]
    assert rows[-1]["first_written_s"] == pytest.approx(float(scored.turn_evidence[3][0]))
    assert rows[-1]["first_written_s"] < -EPS["eps_neg"]
    room = answer_room(rows, **EPS)
    assert (room["wrong_written_earlier"], room["wrong_written_earlier_disfavoured"]) == (1, 1)
    assert room["right_written_earlier"] == 0


def test_token_parts_split_a_final_into_what_x_star_can_inform_and_format():
    """A final turn as the policy writes it: its first token settles that it answers now, the answer's
    tokens are what x* names, ``\\boxed{`` and ``}`` are markup, and every other token is phrasing;
    by_part puts each part's share of the distance from certainty, and the teacher's change, there."""
    tokens = ["So", " the", " city", " is", " \\", "boxed", "{", "Dan", "ube", "}", ".", "<|im_end|>"]
    row = {
        "tokens": tokens,
        "answer_tokens": [7, 8],
        "written_tokens": [7, 8],
        "student": [-0.0, -0.0, -1.0, -0.0, -1.0, -0.0, -0.0, -0.5, -0.0, -0.0, -0.0, -0.0],
        "teacher": [-0.0, -0.0, -1.0, -0.0, -0.5, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0],
    }
    assert token_parts(row) == ["first"] + ["phrasing"] * 3 + ["markup"] * 3 + ["answer"] * 2 + [
        "markup",
        "phrasing",
        "phrasing",
    ]
    by = by_part([row, row])
    assert {p: v["room"] for p, v in by.items()} == {
        "first": 0.0,
        "answer": 0.2,
        "markup": 0.4,
        "phrasing": 0.4,
    }
    assert {p: v["lift"] for p, v in by.items()} == {
        "first": 0.0,
        "answer": 0.5,
        "markup": 0.5,
        "phrasing": 0.0,
    }
    # a wrong final's given answer is its answer part; a turn with no box has no markup
    bare = row | {"tokens": [t.replace("boxed", "boxes") for t in tokens], "answer_tokens": []}
    assert token_parts(bare).count("markup") == 0 and token_parts(bare).count("answer") == 2
    assert by_part([]) == {p: {"room": 0.0, "lift": 0.0} for p in ("first", "answer", "markup", "phrasing")}
