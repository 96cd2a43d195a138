"""The teacher sanity figures: tallies that add up, the classification of turns, and hand-made
groups whose teacher reads the answer, ignores it, or lowers everything."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from agent.chat import ChatTokenizer
from agent.grounding import turn_verdicts
from agent.transcript import turn_texts
from pbsd.verifier import mentions, normalize
from proto.messages import ScoredGroup
from proto.runs import PbsdSpec
from proto.sanity import EvidenceTally, NoiseFloor, TeacherSanity
from services.model.checkpoint import load_model
from services.scorer.backends import LocalScorer
from services.scorer.evidence import score_group
from services.trainer.dynamics import batch_metrics
from tests.test_grounding import _search
from tests.test_scorer import IDENTITY, TEMPLATE, _trajectory, group_of

RESULT = json.dumps(
    {"organic": [{"link": "kb://river/danube", "snippet": "The Danube flows through Vienna."}]}
)
EPS = {"eps_pos": 0.001, "eps_neg": 0.003}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


def test_evidence_tally_by_hand():
    t = EvidenceTally.of([0.002, -0.004, 0.0, math.nan, 0.0005, -0.001], **EPS)
    assert (t.turns, t.higher, t.above, t.below) == (5, 2, 1, 1)
    assert t.sum_s == pytest.approx(-0.0025) and t.sum_abs == pytest.approx(0.0075)
    assert t.mean_s == pytest.approx(-0.0005) and t.deadband_frac == pytest.approx(3 / 5)
    assert EvidenceTally().mean_s is None and EvidenceTally().above_frac is None  # no turns, no figure


def test_tallies_of_parts_add_up_to_the_tally_of_the_whole():
    """Count-weighted, not a mean of means: a group of 1 turn and one of 99 weigh 1 and 99."""
    rng = np.random.default_rng(0)
    s = rng.normal(0, 0.01, 400)
    cuts = np.sort(rng.choice(np.arange(1, 400), 5, replace=False))
    parts = [EvidenceTally.of(p, **EPS) for p in np.split(s, cuts)]
    total, whole = sum(parts, EvidenceTally()), EvidenceTally.of(s, **EPS)
    assert total.model_dump(exclude={"sum_s", "sum_abs"}) == whole.model_dump(exclude={"sum_s", "sum_abs"})
    assert total.mean_s == pytest.approx(s.mean()) and total.sum_abs == pytest.approx(np.abs(s).sum())
    small, big = EvidenceTally.of([1.0], **EPS), EvidenceTally.of(np.zeros(99), **EPS)
    assert (small + big).mean_s == pytest.approx(0.01)  # the mean of the two means would be 0.5
    a = TeacherSanity(answer_free=small, actions={"queries/grounded": small})
    b = TeacherSanity(answer_free=big, actions={"reads/made-up": big})
    both = (a + b).figures()
    assert both["answer_free_mean_s"] == pytest.approx(0.01) and both["answer_free_turns"] == 100
    assert both["evidence_queries_grounded_turns"] == 1 and both["evidence_reads_made_up_mean_s"] == 0


def test_noise_floor_by_hand_and_against_numpy():
    d, turns = np.array([0.01, -0.01, 0.02, 0.0]), np.array([0, 0, 1, 1])
    n = NoiseFloor.of(d, turns, **EPS)
    assert (n.tokens, n.turns, n.outside) == (4, 2, 1)  # null turns: s = 0 (inside), 0.01 (outside)
    assert n.mean == pytest.approx(0.005) and n.std == pytest.approx(np.std(d))
    assert n.max_abs_d == 0.02 and n.outside_frac == 0.5
    # the floor of a turn of n tokens is |mu| + 2 sigma / sqrt(n)
    np.testing.assert_allclose(n.floor([1, 4]), [0.005 + 2 * np.std(d), 0.005 + np.std(d)])
    # floors 0.0162 and 0.0274
    assert list(n.within([0.016, -0.03, math.nan], [4, 1, 4])) == [True, False, False]
    rng = np.random.default_rng(1)
    big = rng.normal(0.001, 0.02, 1000)
    parts = [NoiseFloor.of(p, np.arange(p.size) // 10, **EPS) for p in np.split(big, [100, 350, 800])]
    total = sum(parts, NoiseFloor())
    assert total.tokens == 1000 and total.turns == 100
    assert total.std == pytest.approx(np.std(big)) and total.mean == pytest.approx(big.mean())
    assert np.isnan(NoiseFloor().floor([10])).all() and not NoiseFloor().within([0.0], [10]).any()


def test_mentions_the_answer_as_whole_normalised_words():
    assert mentions("Searching.\n\n\\boxed{The Danube}", "Danube")
    assert mentions("the U.S.A. again", "USA") and mentions("founded in 1,000 AD", "1000")
    assert not mentions("Danubes and more", "Danube") and not mentions("anything", "The")
    assert mentions("it is the Blue River", "Danube", aliases=("Blue River",))


def _reading_teacher(tok: ChatTokenizer, *, gain: float, offset: float = 0.0, student: float = -2.0):
    """A likelihood function that reads x* as a good teacher would: every token has log-prob
    ``student``; in the teacher context (whose prompt holds the answer note) the tokens only the right
    answer spells gain ``gain`` nats (up to certainty, log-prob 0) and those only the wrong one spells
    lose ``gain``; every other teacher token moves by ``offset``."""
    right, wrong = _spelling(tok, "Danube", "Rhine"), _spelling(tok, "Rhine", "Danube")

    async def logprobs(requests, pairs=None):
        out = []
        for ids, positions in requests:
            lp = np.full(len(positions), student)
            if len(positions) and "verified answer" in tok.decode(ids[: int(np.min(positions))]):
                tokens = np.asarray(ids)[np.asarray(positions)]
                lp += np.where(
                    np.isin(tokens, list(right)), gain, np.where(np.isin(tokens, list(wrong)), -gain, offset)
                )
            out.append(np.minimum(lp, 0.0))
        return out

    return logprobs


def _spelling(tok: ChatTokenizer, answer: str, other: str) -> set[int]:
    """Tokens of ``\\boxed{answer}`` that neither the other answer nor the searches hold."""
    searches = tok.encode(_search("Vienna river") + _search("Zorbel river"))
    return set(tok.encode(f"\\boxed{{{answer}}}")) - set(tok.encode(f"\\boxed{{{other}}}")) - set(searches)


def _hand_made_group(tok, spec):
    """Three samples for the Vienna question: a grounded search then the right answer (found in the
    result), a made-up search then a wrong answer, and the right answer straight away (grounded in
    nothing the agent read)."""
    samples = [
        ([_search("Vienna river"), "\\boxed{Danube}"], "Danube", 1.0),
        ([_search("Zorbel river"), "\\boxed{Rhine}"], "Rhine", 0.0),
        (["\\boxed{Danube}"], "Danube", 1.0),
    ]
    trajectories = [
        _trajectory(tok, turns, RESULT, i=i, reward=reward).model_copy(update={"final_answer": answer})
        for i, (turns, answer, reward) in enumerate(samples)
    ]
    return group_of(trajectories, spec)


async def test_a_teacher_that_reads_the_answer_passes_the_sanity_figures(tok):
    group = _hand_made_group(tok, PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0))
    scored = await score_group(group, tok, _reading_teacher(tok, gain=0.5))
    sanity = scored.diagnostics.sanity
    # by hand: the search turns are answer-free (s = 0, the offset); the two "\boxed{Danube}" turns
    # are correct finals with s = 0.5 * (answer tokens / turn tokens) > eps+; "\boxed{Rhine}" the
    # wrong final with s < -eps-
    assert (sanity.answer_free.turns, sanity.answer_bearing.turns) == (2, 0)
    assert sanity.answer_free.mean_s == 0.0 and sanity.answer_free.deadband_frac == 1.0
    assert (sanity.correct_final.turns, sanity.correct_final.above) == (2, 2)
    assert (sanity.wrong_final.turns, sanity.wrong_final.below) == (1, 1)
    final = _trajectory(tok, ["\\boxed{Danube}"]).turn_spans[0]
    right = _spelling(tok, "Danube", "Rhine")
    spelled = sum(t in right for t in _trajectory(tok, ["\\boxed{Danube}"]).completion_ids[slice(*final)])
    assert sanity.correct_final.mean_s == pytest.approx(0.5 * spelled / (final[1] - final[0]))
    figures = sanity.figures()
    assert figures["correct_final_favoured_frac"] == 1.0 and figures["wrong_final_disfavoured_frac"] == 1.0
    # actions: the grounded search and answer, the made-up search, two answers found in no result
    assert {k: v.turns for k, v in sanity.actions.items()} == {
        "queries/grounded": 1,
        "queries/made-up": 1,
        "answers/grounded": 1,
        "answers/made-up": 2,
    }
    assert sanity.actions["answers/grounded"].mean_s > 0 and sanity.actions["queries/made-up"].mean_s == 0


def test_room_counts_the_turns_any_teacher_could_favour():
    """A turn's ceiling is the most s can be (the student's mean negative log-prob): room counts the
    scored turns whose ceiling exceeds eps+."""
    t = EvidenceTally.of([0.002, 0.0005, math.nan, -0.01], **EPS, ceilings=[0.01, 0.0008, 0.5, 0.0009])
    assert (t.turns, t.room) == (3, 1) and t.room_frac == pytest.approx(1 / 3)
    assert EvidenceTally.of([0.002], **EPS).room == 0  # no ceilings given: none counted
    assert (t + t).room == 2
    with pytest.raises(ValueError, match="align"):
        EvidenceTally.of([0.1, 0.2], **EPS, ceilings=[0.1])


async def test_a_perfect_reader_cannot_favour_an_answer_the_student_is_sure_of(tok):
    """The same reading teacher, once over a student that writes every token with log-prob -2 and once
    over one that is all but certain (-1e-5 a token): the second's correct finals have no room, so not
    even a teacher that is certain of the right answer's tokens moves them past eps+, while wrong
    finals are still disfavoured (a wrong answer's likelihood can always fall)."""
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0)
    unsure = (
        await score_group(_hand_made_group(tok, spec), tok, _reading_teacher(tok, gain=5.0))
    ).diagnostics
    sure = await score_group(_hand_made_group(tok, spec), tok, _reading_teacher(tok, gain=5.0, student=-1e-5))
    assert unsure.sanity.correct_final.room == unsure.sanity.correct_final.above == 2
    final = sure.diagnostics.sanity.correct_final
    assert (final.turns, final.room, final.above) == (2, 0, 0)
    assert 0 < final.mean_s <= 1e-5  # the ceiling: 1e-5, reached on the answer's own tokens only
    assert sure.diagnostics.sanity.wrong_final.below == 1
    figures = sure.diagnostics.sanity.figures()
    assert figures["correct_final_room_frac"] == 0.0 and figures["correct_final_favoured_frac"] == 0.0


async def test_a_teacher_that_lowers_everything_fails_them(tok):
    """What issue 24 measured: x* lowers every turn a little; the figures say so."""
    group = _hand_made_group(tok, PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0))
    sanity = (await score_group(group, tok, _reading_teacher(tok, gain=0.0, offset=-0.01))).diagnostics.sanity
    assert sanity.answer_free.mean_s == pytest.approx(-0.01) and sanity.answer_free.deadband_frac == 0.0
    assert sanity.correct_final.above == 0 and sanity.wrong_final.below == 1


async def test_a_last_message_that_boxes_nothing_is_no_final_answer(tok):
    """A trajectory can stop on its own message without boxing an answer: a stray tool-call fragment
    (the lab policy writes "</arguments></use_mcp_tool>" after a failed call) or a sentence with no
    box. It gave no answer to verify, so that turn is an unboxed final: in neither the wrong-final
    figure (the boxed wrong answer alone) nor the answer-free one (the searches alone)."""
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0)
    boxed = _hand_made_group(tok, spec).trajectories[1]  # a made-up search, then \boxed{Rhine}
    stray = _trajectory(
        tok, [_search("Zorbel river"), "</arguments>\n</use_mcp_tool>"], RESULT, i=3, reward=0.0
    )
    prose = _trajectory(
        tok, [_search("Zorbel river"), "The page gives the year 1538."], RESULT, i=4, reward=0.0
    )
    empty = _trajectory(tok, [_search("Zorbel river"), "\\boxed{ }"], RESULT, i=5, reward=0.0)
    empty = empty.model_copy(update={"final_answer": ""})  # as extract_boxed reads an empty box
    assert stray.finish_reason == prose.finish_reason == "answer" and stray.final_answer is None
    sanity = (
        await score_group(group_of([boxed, stray, prose, empty], spec), tok, _reading_teacher(tok, gain=0.5))
    ).diagnostics.sanity
    assert (sanity.wrong_final.turns, sanity.wrong_final.below) == (1, 1)
    assert sanity.answer_free.turns == 4  # the four searches
    assert sanity.unboxed_final.turns == 3
    figures = sanity.figures()
    assert figures["wrong_final_turns"] == 1 and figures["unboxed_final_turns"] == 3


async def test_an_uninformative_teacher_leaves_answer_free_turns_at_zero(tok, tiny_checkpoint):
    """x* == x through the real scorer: every s is exactly 0, so answer-free turns sit at 0 and no
    final answer is favoured or disfavoured."""
    group = _hand_made_group(tok, PbsdSpec(teacher_template=IDENTITY))
    scored = await score_group(group, tok, LocalScorer(load_model(tiny_checkpoint)))
    sanity = scored.diagnostics.sanity
    assert sanity.answer_free.turns == 2 and sanity.answer_free.mean_s == 0.0
    assert sanity.correct_final.above == 0 and sanity.wrong_final.below == 0
    assert scored.diagnostics.noise.tokens > 0  # the null pass ran (one sample by default)


def _reference_sanity(scored: ScoredGroup, tok: ChatTokenizer, spec: PbsdSpec) -> dict[str, list[float]]:
    """The classification written out plainly, one turn at a time, with a regular expression for
    "mentions": the slow reference for the scorer's."""
    group, cells = scored.group, {}
    for t, s in zip(group.trajectories, scored.turn_evidence, strict=True):
        texts = turn_texts(t.completion_ids, t.turn_spans, tok)
        verdicts = turn_verdicts(group.question, texts, t.final_answer)
        for k, (text, _) in enumerate(texts):
            if math.isnan(s[k]):
                continue
            last = k == len(texts) - 1
            pattern = r"(^| )" + re.escape(normalize(group.answer)) + r"( |$)"
            if last and t.reward > 0:
                kind = "correct_final"
            elif last and t.finish_reason == "answer":
                kind = "wrong_final" if (t.final_answer or "").strip() else "unboxed_final"
            elif re.search(pattern, normalize(text)):
                kind = "answer_bearing"
            else:
                kind = "answer_free"
            cells.setdefault(kind, []).append(float(s[k]))
            if verdicts[k] is not None:
                name = f"{verdicts[k][0]}/{'grounded' if verdicts[k][1] else 'made-up'}"
                cells.setdefault(name, []).append(float(s[k]))
    return cells


async def test_sanity_matches_a_plain_reference_and_the_trainer_sums_it(tok, tiny_checkpoint):
    spec = PbsdSpec(teacher_template=TEMPLATE)
    scorer = LocalScorer(load_model(tiny_checkpoint))
    scored = [await score_group(_hand_made_group(tok, spec), tok, scorer)]
    scored.append(await score_group(group_of(scored[0].group.trajectories[:2], spec), tok, scorer))
    for g in scored:
        got = g.diagnostics.sanity.tallies()
        for kind, values in _reference_sanity(g, tok, spec).items():
            assert got[kind].turns == len(values) and got[kind].sum_s == pytest.approx(sum(values), abs=1e-9)
    metrics = batch_metrics(scored, 0)
    union = {}
    for g in scored:
        for kind, values in _reference_sanity(g, tok, spec).items():
            union.setdefault(kind, []).extend(values)
    assert metrics["answer_free_turns"] == len(union["answer_free"])
    assert metrics["answer_free_mean_s"] == pytest.approx(np.mean(union["answer_free"]))
    favoured = np.mean(np.array(union["correct_final"]) > spec.eps_pos)
    assert metrics["correct_final_favoured_frac"] == pytest.approx(favoured)
    noise = scored[0].diagnostics.noise + scored[1].diagnostics.noise
    assert metrics["noise_tokens"] == noise.tokens and 0 <= metrics["within_noise_floor_frac"] <= 1


def test_checks_by_hand():
    from pbsd.sanity import checks

    figures = {
        "answer_free_mean_s": -0.002,
        "correct_final_favoured_frac": 0.95,
        "wrong_final_disfavoured_frac": 0.5,
        "evidence_queries_grounded_mean_s": 0.01,
        "evidence_queries_made_up_mean_s": -0.02,  # gap +0.03
        "evidence_reads_grounded_mean_s": -0.01,
        "evidence_reads_made_up_mean_s": 0.0,  # gap -0.01: the least decides
        "evidence_answers_grounded_mean_s": 0.5,  # no made-up answers: no gap
    }
    got = {c["figure"]: (c["value"], c["met"]) for c in checks(figures, eps_pos=0.001, eps_neg=0.003)}
    assert got["answer_free_mean_s"] == (-0.002, True)
    assert got["correct_final_favoured_frac"] == (0.95, True)
    assert got["wrong_final_disfavoured_frac"] == (0.5, False)
    assert got["grounded_minus_made_up_mean_s"][0] == pytest.approx(-0.01)
    assert got["grounded_minus_made_up_mean_s"][1] is False
    nothing = {c["figure"]: c["met"] for c in checks({}, eps_pos=0.001, eps_neg=0.003)}
    assert set(nothing.values()) == {None}  # no turns behind a figure: neither met nor missed
    at_the_mark = {"correct_final_favoured_frac": 0.9, "wrong_final_disfavoured_frac": 0.9}
    met = {c["figure"]: c["met"] for c in checks(at_the_mark, eps_pos=0.001, eps_neg=0.003)}
    assert met["correct_final_favoured_frac"] is met["wrong_final_disfavoured_frac"] is True  # ">= 90%"


async def test_the_scorer_counts_the_tallies_for_prometheus(tok):
    """Counters whose rates give the exact figures over any window (the dashboard's queries)."""
    from prometheus_client import REGISTRY

    from services.scorer.worker import observe_sanity

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    group = _hand_made_group(tok, PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0))
    sanity = (await score_group(group, tok, _reading_teacher(tok, gain=0.5))).diagnostics.sanity
    noise = NoiseFloor.of([0.01, -0.03], [0, 0], **EPS)
    kinds = [("correct_final", "above"), ("wrong_final", "below"), ("answer_free", "deadband")]
    before = {k: value("pbsd_scorer_sanity_turns_total", kind=k[0], band=k[1]) for k in kinds}
    signs = {
        s: value("pbsd_scorer_sanity_evidence_total", kind="wrong_final", sign=s)
        for s in ("positive", "negative")
    }
    squares, outside = (
        value("pbsd_scorer_noise_squared_difference_total"),
        value("pbsd_scorer_noise_turns_total", outcome="outside"),
    )
    observe_sanity(sanity, noise)
    after = {k: value("pbsd_scorer_sanity_turns_total", kind=k[0], band=k[1]) for k in kinds}
    assert {k: after[k] - before[k] for k in kinds} == {
        k: 2.0 if k[0] != "wrong_final" else 1.0 for k in kinds
    }
    negative = (
        value("pbsd_scorer_sanity_evidence_total", kind="wrong_final", sign="negative") - signs["negative"]
    )
    assert (
        value("pbsd_scorer_sanity_evidence_total", kind="wrong_final", sign="positive") == signs["positive"]
    )
    assert -negative == pytest.approx(sanity.wrong_final.sum_s)
    assert value("pbsd_scorer_noise_squared_difference_total") - squares == pytest.approx(0.001)
    assert value("pbsd_scorer_noise_turns_total", outcome="outside") - outside == 1  # null s = -0.01


def test_a_turn_that_names_an_alias_bears_the_answer(tok):
    """The answer is found by its aliases too: a turn that names one is not answer-free."""
    from services.scorer.sanity import turn_kinds

    t = _trajectory(tok, ["Searching the Donau pages.", "\\boxed{Danube}"], reward=1.0)
    group = group_of([t], PbsdSpec(teacher_template=TEMPLATE)).model_copy(update={"aliases": ("Donau",)})
    assert [kind for kind, _ in turn_kinds(group, tok)[0]] == ["answer_bearing", "correct_final"]


def test_a_blank_box_is_an_unboxed_final(tok):
    from services.scorer.sanity import final_kind

    t = _trajectory(tok, ["\\boxed{ }"], reward=0.0).model_copy(update={"final_answer": "  "})
    assert final_kind(t) == "unboxed_final"
