"""The evidence's noise floor: the null pass's requests, its figures from a real model in float32 and
bfloat16, a likelihood whose rounding depends on the layout, and the float32 log-softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from proto.base import decode, encode
from proto.messages import ScoredGroup
from proto.runs import PbsdSpec
from proto.sanity import NoiseFloor
from services.model.checkpoint import load_model
from services.scorer.backends import LocalScorer
from services.scorer.contexts import Contexts
from services.scorer.evidence import score_group
from services.scorer.logprobs import sequence_logprobs
from services.scorer.noise import null_picks, null_request
from services.trainer.dynamics import batch_metrics
from services.trainer.viewer import sanity_summary, viewer_data
from tests.test_scorer import TEMPLATE, _group, _trajectory, contexts_of, group_of

EPS = {"eps_pos": 0.001, "eps_neg": 0.003}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


def _contexts(student: int, teacher: int, loss: list[int]) -> Contexts:
    loss_positions = np.array(loss)
    return Contexts(
        list(range(100, 100 + student)),
        list(range(200, 200 + teacher)),
        loss_positions,
        loss_positions + 3,
        np.zeros(len(loss), np.int64),
    )


def test_null_requests_and_picks_by_hand():
    c = _contexts(10, 13, [7, 8, 9])
    ids, positions = null_request(c)
    assert ids == c.student + [210, 211, 212] and list(positions) == [7, 8, 9]  # the teacher's length
    cut = _contexts(10, 8, [6, 7, 8, 9])  # x* cut at 8 tokens: the null keeps what fits
    ids, positions = null_request(cut)
    assert ids == cut.student[:8] and list(positions) == [6, 7]
    assert null_picks([0, 1, 2, 3, 4, 5, 6, 7], 2) == [0, 4] and null_picks([1, 5], 3) == [1, 5]
    assert null_picks([0, 1], 0) == [] and null_picks([], 2) == []


def _long_group(tok, spec, turns: int = 3):
    """One sample with a few long turns and long tool results (a few hundred tokens)."""
    text = "Searching for the river that flows through Vienna, and its mouth. " * 6
    return group_of([_trajectory(tok, [text] * turns, "The Danube flows east. " * 20)], spec)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_the_null_pass_is_measured_and_reported(tok, tiny_checkpoint, dtype):
    """The scorer's floor is exactly the difference of the student context scored alone and scored
    in a context of the teacher's length (as the CPU scorer runs the teacher), in the model's dtype;
    it rides on the scored group, into the trainer's figures. Float32 on CPU: at most a few ulps.
    (This machine's bfloat16 kernels give exactly 0 for these short contexts and about 1e-5 nats
    per token at 3,000 tokens; an H100's, about 0.012: docs/credit-signal.md.)"""
    model = load_model(tiny_checkpoint, dtype=dtype)
    spec = PbsdSpec(teacher_template=TEMPLATE)
    scored = await score_group(_long_group(tok, spec), tok, LocalScorer(model))
    t = scored.group.trajectories[0]
    c = contexts_of(tok, t)
    ids, positions = null_request(c)
    assert len(ids) == len(c.teacher) > len(c.student)
    (student,) = sequence_logprobs(model, [(c.student, c.loss_positions)])
    (null,) = sequence_logprobs(model, [(ids, positions)])
    expected = NoiseFloor.of(null.astype(np.float64) - student, c.token_turns, **EPS)
    assert scored.diagnostics.noise == expected and expected.tokens == int(t.loss_mask.sum())
    if dtype == "float32":
        assert expected.std < 1e-6 and expected.outside == 0
    assert decode(ScoredGroup, encode(scored)).diagnostics.noise == expected  # it travels
    metrics = batch_metrics([scored], 0)
    assert metrics["noise_tokens"] == expected.tokens and metrics["noise_std"] == pytest.approx(expected.std)
    assert metrics["noise_outside_deadband_frac"] == expected.outside_frac


def _layout_sensitive(scale: float):
    """A likelihood whose rounding depends on the sequence's length, as a bfloat16 kernel's tiling
    can: the same token, scored in a longer context, moves by up to ``scale``."""

    async def logprobs(requests, pairs=None):
        return [-2.0 + scale * np.sin(len(ids) * 0.7 + np.asarray(pos) * 1.3) for ids, pos in requests]

    return logprobs


async def test_a_layout_dependent_floor_is_measured_and_marks_the_turns_within_it(tok):
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=2)
    group = _group(tok, spec)
    scored = await score_group(group, tok, _layout_sensitive(0.02))
    noise = scored.diagnostics.noise
    # by hand: two of the three samples (the first two) scored again; per token, d = 0.02 (sin(0.7 Lt + 1.3 p) -
    # sin(0.7 Ls + 1.3 p)), every turn of the two samples a null turn
    picked = [0, 1]  # null_picks([0, 1, 2], 2)
    d, turns = [], 0
    for i in picked:
        t = group.trajectories[i]
        c = contexts_of(tok, t)
        p = c.loss_positions
        d.append(0.02 * (np.sin(len(c.teacher) * 0.7 + p * 1.3) - np.sin(len(c.student) * 0.7 + p * 1.3)))
        turns += t.num_turns
    d = np.concatenate(d)
    assert (noise.tokens, noise.turns) == (d.size, turns)
    assert noise.std == pytest.approx(d.std()) and noise.max_abs_d == pytest.approx(np.abs(d).max())
    assert noise.std > 0.005
    # the viewer marks a turn within the floor when |s| <= |mu| + 2 sigma / sqrt(its tokens)
    rows = viewer_data([(1, scored)], tok)
    for row, t, s in zip(rows, group.trajectories, scored.turn_evidence, strict=True):
        n = np.array([end - start for start, end in t.turn_spans])
        floor = abs(noise.mean) + 2 * noise.std / np.sqrt(n)
        assert [turn["within_floor"] for turn in row["turns"]] == list(np.abs(s) <= floor)
        assert [turn["floor"] for turn in row["turns"]] == pytest.approx(list(floor))
    assert batch_metrics([scored], 0)["within_noise_floor_frac"] == pytest.approx(
        np.mean([x for row in rows for x in (turn["within_floor"] for turn in row["turns"])])
    )


async def test_the_viewer_says_when_the_null_share_has_no_deadband_to_fall_in(tok):
    """With eps+ = eps- = 0 every null turn that rounding moves lies outside the "deadband": the
    viewer's summary says there is none, and says nothing of the kind for the paper's deadband."""
    for spec, label in (
        (PbsdSpec(teacher_template=TEMPLATE, eps_pos=0, eps_neg=0), True),
        (PbsdSpec(teacher_template=TEMPLATE), False),
    ):
        scored = await score_group(_group(tok, spec), tok, _layout_sensitive(0.02))
        assert scored.diagnostics.noise.turns and (scored.diagnostics.noise.outside_frac > 0) is label
        summary = sanity_summary([(1, scored)])
        assert "null turns outside the deadband" in summary
        assert ("(no deadband)" in summary) is label


def test_a_bfloat16_models_log_probs_are_exact_past_its_last_hidden_state(tok, tiny_checkpoint):
    """The LM head's product and the log-softmax in float32: from the model's own bfloat16 hidden
    states and head, the scorer's log-probs are the exact ones to float32's precision. Through
    bfloat16 logits (transformers' route) they would be off by up to a grid step of the logit, and
    a log-softmax in bfloat16 would put every log-prob on bfloat16's grid."""
    model = load_model(tiny_checkpoint, dtype="bfloat16")
    ids = tok.encode("The Danube flows through Vienna, the capital of Austria, and on to the Black Sea.")
    positions = np.arange(1, len(ids))
    (got,) = sequence_logprobs(model, [(ids, positions)])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hidden, logits = out.hidden_states[-1][0, :-1], out.logits[0, :-1]
    targets = torch.tensor(ids[1:])[:, None]
    with torch.no_grad():
        exact = torch.log_softmax(hidden.double() @ model.lm_head.weight.double().T, -1)
    exact = exact.gather(1, targets)[:, 0].numpy()
    through_bf16_logits = torch.log_softmax(logits.float(), -1).gather(1, targets)[:, 0].numpy()
    in_bfloat16 = torch.log_softmax(logits, -1).gather(1, targets)[:, 0].float().numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, exact, atol=2e-5, rtol=0)
    # the tiny policy's logits are small (|z| < 2), so their grid step is too: 4e-4 here
    assert np.abs(through_bf16_logits - exact).max() > 20 * np.abs(got - exact).max()
    assert np.abs(in_bfloat16 - exact).max() > 1e-3
    on_grid = torch.tensor(got).to(torch.bfloat16).float().numpy() == got
    assert not on_grid.all()  # not bfloat16 values


def test_the_null_floor_of_a_cut_context_by_hand():
    """x* cut after the sixth position: the null pass covers the first two loss tokens only, and
    its differences are taken against the student's first two log-probs, in their turns."""
    from services.scorer.noise import null_floor

    c = Contexts(
        student=list(range(10)),
        teacher=list(range(8)),
        loss_positions=np.array([6, 7, 8, 9]),
        phi=np.array([6, 7, -1, -1]),
        token_turns=np.array([0, 1, 1, 1]),
    )
    floor = null_floor(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.1, 0.25]), c, PbsdSpec())
    assert floor.tokens == 2 and floor.turns == 2
    assert floor.sum_d == pytest.approx(0.05) and floor.max_abs_d == pytest.approx(0.05)
