"""``pbsd teacher drift``: the answer-free mean s split into the tokens the teacher would rather spend
on the answer and the rest, exactly, and by how each trajectory ended."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from agent.chat import ChatTokenizer
from pbsd.cli import app
from proto.runs import PbsdSpec
from services.model.checkpoint import load_model
from services.scorer.backends import LocalScorer
from services.scorer.drift import answer_first_tokens, describe_drift, drift_anatomy
from services.scorer.evidence import score_group
from services.trainer.checkpoints import save_groups
from tests.test_scorer import TEMPLATE
from tests.test_teacher_sanity import _hand_made_group, _reading_teacher


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


class _Model:
    """Uniform logits over the vocabulary, except after the teacher's note, where ``favoured`` tokens
    get +5 at every position: a teacher that would write them anywhere."""

    def __init__(self, tok: ChatTokenizer, favoured: list[int]) -> None:
        self.tok, self.favoured, self.vocab = tok, favoured, len(tok.tok)

    def eval(self):
        return self

    def __call__(self, ids: torch.Tensor):
        logits = torch.zeros(1, ids.shape[1], self.vocab)
        if "verified answer" in self.tok.decode(ids[0].tolist()):
            logits[..., self.favoured] = 5.0
        return SimpleNamespace(logits=logits)


async def test_a_teacher_pulled_toward_the_answer_everywhere_has_all_its_drift_pulled(tok):
    group = _hand_made_group(tok, PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0))
    scored = await score_group(group, tok, _reading_teacher(tok, gain=0.5))  # its s is not used here
    answer = answer_first_tokens(tok, "Danube")
    assert answer and all(
        tok.decode([t]).strip() and "Danube".startswith(tok.decode([t]).strip()) for t in answer
    )

    pulled = drift_anatomy(_Model(tok, answer[:1]), tok, [scored])
    # the two search turns are the answer-free ones, one in a correct and one in a wrong trajectory
    assert pulled["turns"] == 2 and set(pulled["by_outcome"]) == {"correct", "wrong"}
    vocab = len(tok.tok)  # every token not the answer lost the share that went to it
    assert pulled["mean_s"] == pytest.approx(-np.log((vocab - 1 + np.exp(5.0)) / vocab), rel=1e-4)
    assert pulled["pulled_part"] == pytest.approx(pulled["mean_s"]) and pulled["rest_part"] == 0.0
    assert pulled["pulled_tokens"] == pulled["tokens"]

    other = next(
        t for t in range(len(tok.tok)) if t not in answer and t not in group.trajectories[0].completion_ids
    )
    lowered = drift_anatomy(_Model(tok, [other]), tok, [scored])  # lowers everything, the answer included
    assert lowered["mean_s"] == pytest.approx(pulled["mean_s"], abs=1e-4)
    assert lowered["rest_part"] == pytest.approx(lowered["mean_s"]) and lowered["pulled_tokens"] == 0

    same = drift_anatomy(_Model(tok, []), tok, [scored])  # x* changes nothing
    assert same["mean_s"] == 0.0 and same["pulled_tokens"] == 0
    # none of these is the teacher that scored the group: the report says so
    assert pulled["scored_gap"] > 0.1 and "is --model the checkpoint" in describe_drift(pulled)


async def test_a_teacher_drawn_to_a_supporting_facts_entity_has_its_drift_toward_a_fact(tok):
    support = (
        "the river that flows through Vienna is Danube (page kb://river/danube)",
        "the city where Zorbel is based is Ulm (page kb://city/ulm)",
    )
    group = _hand_made_group(tok, PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0))
    scored = await score_group(
        group.model_copy(update={"support": support}), tok, _reading_teacher(tok, gain=0.5)
    )
    hop = answer_first_tokens(tok, "Ulm")
    toward = drift_anatomy(_Model(tok, hop[:1]), tok, [scored])
    assert toward["fact_tokens"] == toward["tokens"] and toward["pulled_tokens"] == 0
    assert toward["fact_part"] == pytest.approx(toward["mean_s"]) and toward["mean_s"] < -0.01
    assert toward["pulled_part"] == 0.0 and toward["rest_part"] == 0.0
    for outcome in toward["by_outcome"].values():  # each outcome's parts add up to its mean too
        assert outcome["fact_part"] == pytest.approx(outcome["mean_s"]) and outcome["pulled_part"] == 0.0
    assert "supporting fact's entity: " in describe_drift(toward)
    # the answer is never "toward a fact", though the facts state it; without facts nothing is
    assert (
        drift_anatomy(_Model(tok, answer_first_tokens(tok, "Danube")[:1]), tok, [scored])["fact_tokens"] == 0
    )
    assert drift_anatomy(_Model(tok, hop[:1]), tok, [await _without_facts(tok)])["fact_tokens"] == 0


async def _without_facts(tok):
    group = _hand_made_group(tok, PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0))
    return await score_group(group, tok, _reading_teacher(tok, gain=0.5))


async def test_the_split_adds_up_to_the_scorers_answer_free_mean(tiny_checkpoint, tok, tmp_path):
    model = load_model(tiny_checkpoint)
    group = _hand_made_group(tok, PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0))
    scored = await score_group(group, tok, LocalScorer(model))
    report = drift_anatomy(model, tok, [scored])
    sanity = scored.diagnostics.sanity.answer_free
    assert report["turns"] == sanity.turns
    assert report["mean_s"] == pytest.approx(sanity.mean_s, abs=1e-5)
    parts = report["pulled_part"] + report["fact_part"] + report["rest_part"]
    assert parts == pytest.approx(report["mean_s"], abs=1e-9)
    outcomes = report["by_outcome"]
    assert sum(v["turns"] for v in outcomes.values()) == report["turns"]
    weighted = sum(v["mean_s"] * v["turns"] for v in outcomes.values()) / report["turns"]
    assert weighted == pytest.approx(report["mean_s"], abs=1e-5)
    assert report["scored_gap"] < 1e-5 and "warning" not in describe_drift(report)

    save_groups(tmp_path, 0, [scored])
    result = CliRunner().invoke(
        app,
        [
            "teacher",
            "drift",
            "--model",
            str(tiny_checkpoint),
            "--groups",
            str(tmp_path),
            "--out",
            str(tmp_path / "d.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"answer-free turns: {report['turns']}, mean s {report['mean_s']:+.4f}" in result.output
    empty = CliRunner().invoke(
        app, ["teacher", "drift", "--model", str(tiny_checkpoint), "--groups", str(tmp_path / "none")]
    )
    assert empty.exit_code != 0
