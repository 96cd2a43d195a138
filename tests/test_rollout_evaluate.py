"""Evaluation: pass@k and mean@k by hand, the paired change and its interval, and ``evaluate`` over
a scripted engine, with and without an LLM judge."""

from __future__ import annotations

import pytest

from agent.chat import ChatTokenizer
from pbsd.accuracy import accuracy_interval, compare, describe_change, pass_at_k, summarise
from services.rollout.agent import AgentLimits
from services.rollout.evaluate import evaluate
from services.rollout.sglang import SglangEngine
from tests.servers import serve
from tests.sglang_fake import LAYERS, TOP_K, make_sglang
from tests.test_rollout_agent import FixedTools, scripted


@pytest.fixture
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_summarise_mean_and_pass_by_difficulty():
    results = {"a": [True, False, False, False], "b": [True, True, True, True], "c": [False] * 4}
    s = summarise(results, {"a": "easy", "b": "easy", "c": "hard"}, 4)
    assert s["all"]["mean@4"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert s["easy"]["pass@k"]["1"] == pytest.approx((0.25 + 1) / 2) and s["hard"]["pass@k"]["4"] == 0.0
    assert s["all"]["questions"] == 3


def test_compare_pairs_questions_and_bounds_the_change():
    def report(correct):
        return {"per_question": {q: {"correct": c} for q, c in correct.items()}}

    before = report({"a": [False, False], "b": [True, False], "c": [True, True], "d": [False, False]})
    after = report({"a": [True, True], "b": [True, True], "c": [True, False], "d": [False, False]})
    change = compare(before, after)
    # d = (+1, +0.5, -0.5, 0): mean +0.25; two better, one worse
    assert change["difference"] == pytest.approx(0.25) and (change["better"], change["worse"]) == (2, 1)
    low, high = change["ci95"]
    assert -0.5 <= low < 0.25 < high <= 1.0  # the bootstrap means lie between min(d) and max(d)
    assert compare(before, after) == change  # seeded
    assert describe_change(change).startswith("+0.250 (95% CI ")
    # the same accuracy per question: no change, and no width
    same = compare(before, before)
    assert same["difference"] == 0 and same["ci95"] == [0.0, 0.0] and same["better"] == same["worse"] == 0
    # half of 40 questions got better and none worse: the interval leaves zero out
    many = compare(
        report({str(i): [False] for i in range(40)}), report({str(i): [i % 2 == 0] for i in range(40)})
    )
    assert many["difference"] == pytest.approx(0.5) and many["ci95"][0] > 0.25
    with pytest.raises(ValueError, match="same"):
        compare(before, report({"a": [True]}))
    one = {"difference": 0.02, "ci95": [-0.1, 0.1], "better": 1, "worse": 0}
    assert describe_change(one).endswith("; 1 question better, 0 worse)")


def test_an_accuracy_interval_spans_the_means_of_resampled_questions():
    def report(correct):
        return {"per_question": {str(i): {"correct": c} for i, c in enumerate(correct)}}

    # 2 of 48 right: the mean is 0.042, and another 48 like these could have held none of them
    low, high = accuracy_interval(report([[True]] * 2 + [[False]] * 46))
    assert low == 0.0 and 0.042 < high < 0.15
    assert accuracy_interval(report([[True, False]] * 10)) == [0.5, 0.5]  # every question alike
    half = report([[True], [False]] * 20)
    low, high = accuracy_interval(half)
    assert low < 0.5 < high and high - low < 0.4
    assert accuracy_interval(half) == [low, high]  # seeded


async def test_evaluate_reports_accuracy(tok):
    from proto.data import QuestionRecord

    questions = [
        QuestionRecord(id="q1", question="Which river?", answer="Danube", difficulty="easy"),
        QuestionRecord(id="q2", question="Which city?", answer="Vienna", difficulty="hard"),
    ]
    with serve(make_sglang(scripted(tok, ["\\boxed{Danube}"]))) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        report = await evaluate(
            engine, FixedTools(), tok, questions, system="s", samples=2, limits=AgentLimits(max_turns=3)
        )
        await engine.aclose()
    assert report["accuracy"]["easy"]["mean@2"] == 1.0 and report["accuracy"]["hard"]["mean@2"] == 0.0
    assert report["accuracy"]["all"]["pass@k"] == {"1": 0.5, "2": 0.5}
    assert report["per_question"]["q1"]["answers"] == ["Danube", "Danube"]
    # four answers, none read anywhere (no tool was called): none grounded
    assert report["grounding"]["answers"] == {"total": 4, "grounded": 0, "fraction": 0.0}
    assert report["grounding"]["queries"]["total"] == 0
    assert "judged_accuracy" not in report


async def test_evaluate_with_a_judge_grades_every_final_message(tok):
    """BrowseComp's grader over an OpenAI-compatible server: its verdicts, not exact match, make
    judged_accuracy (here it accepts the first answer and rejects the second)."""
    from proto.data import QuestionRecord
    from services.llm import ChatClient, LlmSettings
    from services.llm.judge import LlmJudge
    from tests.openai_fake import make_app as make_openai

    questions = [QuestionRecord(id="q1", question="Which river?", answer="Danube", difficulty="easy")]
    grader = make_openai(["correct: yes", "correct: no"])
    with serve(make_sglang(scripted(tok, ["\\boxed{Danube}"]))) as url, serve(grader) as judge_url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        judge = LlmJudge(ChatClient(LlmSettings(f"{judge_url}/v1", "grader", None), name="judge"))
        report = await evaluate(
            engine,
            FixedTools(),
            tok,
            questions,
            system="s",
            samples=2,
            limits=AgentLimits(max_turns=3),
            judge=judge,
            concurrency=1,
        )
        await engine.aclose()
        await judge.aclose()
    assert report["accuracy"]["all"]["mean@2"] == 1.0  # exact match: both right
    assert report["judged_accuracy"]["all"]["mean@2"] == 0.5 and report["per_question"]["q1"]["judged"] == [
        True,
        False,
    ]
    prompts = [r["body"]["messages"][0]["content"] for r in grader.state.requests]
    assert len(prompts) == 2 and all("[response]: \\boxed{Danube}" in p for p in prompts)
