"""The replay ablation (evidence_routing "replay", Table 1's "w/o non-replay recompute"): which
routes each teacher position gets, partial replay in the routers, and evidence on the tiny MoE
that differs from fresh routing and equals a replayed pass computed by hand."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from proto.runs import PbsdSpec, RunSpec
from services.model.checkpoint import load_model
from services.model.routing import RouteRecorder, moe_routers, replay_routes
from services.scorer.backends import LocalScorer
from services.scorer.evidence import score_group
from services.scorer.replay import position_map, routes_at
from tests.test_scorer import IDENTITY, TEMPLATE, _group, contexts_of


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def test_position_map_by_hand():
    # system [1, 2], user message [3] rewritten as [9, 9, 9], then the assistant opening [4, 5]
    assert list(position_map([1, 2, 3, 4, 5], [1, 2, 9, 9, 9, 4, 5], 9)) == [0, 1, -1, -1, -1, 3, 4, 5, 6]
    # the template keeps the question's first token: it is still the student's
    assert list(position_map([1, 3, 4, 5], [1, 3, 8, 4, 5], 6)) == [0, 1, -1, 2, 3, 4]
    # x* == x: every position is its own
    assert list(position_map([1, 2, 3], [1, 2, 3], 5)) == [0, 1, 2, 3, 4]
    # prefix and suffix never overlap: [1, 1] into [1, 1, 1] keeps both 1s of the prefix, one new
    assert list(position_map([1, 1], [1, 1, 1], 4)) == [0, 1, -1, 2]
    routes = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    got = routes_at(routes, np.array([2, -1, 0, 5]))
    assert (
        got.dtype == np.int16  # signed for the -1 rows, a quarter of int64's memory
        and got[0].tolist() == routes[2].tolist()
        and got[2].tolist() == routes[0].tolist()
    )
    assert (got[1] == -1).all() and (got[3] == -1).all()  # fresh: mapped nowhere, or never recorded
    assert routes_at(routes.astype(np.int32) + 40_000, np.array([0])).dtype == np.int32  # kept wide


def _forced_routes(model, n: int, first: int = 0) -> torch.Tensor:
    """Every token to experts ``first`` and ``first + 1`` in every MoE layer: far from fresh routing."""
    routes = torch.full(
        (n, len(moe_routers(model)), model.config.num_experts_per_tok), first, dtype=torch.long
    )
    routes[..., 1] = first + 1
    return routes


def test_rows_of_minus_one_route_fresh(tok, model):
    ids = torch.tensor([tok.encode("The Danube flows through Vienna, the capital of Austria.")])
    n = ids.shape[1]
    with torch.no_grad(), RouteRecorder(model) as fresh_rec:
        fresh = model(input_ids=ids).logits
    fresh_routes = fresh_rec.take()
    with torch.no_grad(), replay_routes(model, torch.full_like(_forced_routes(model, n), -1)):
        unforced = model(input_ids=ids).logits
    assert torch.equal(unforced, fresh)  # all fresh: the router's own forward, bit for bit
    mixed = _forced_routes(model, n)
    mixed[: n // 2] = -1
    with torch.no_grad(), RouteRecorder(model) as rec, replay_routes(model, mixed):
        model(input_ids=ids)
    used = rec.take()
    assert (used[n // 2 :] == mixed[n // 2 :].numpy()).all()  # forced where recorded
    assert (used[: n // 2] == fresh_routes[: n // 2]).all()  # the router's own choice elsewhere


def test_replaying_the_models_own_routes_is_the_models_own_forward_and_backward(tiny_checkpoint, tok):
    """R3's premise: the routes a forward recorded, replayed, give that forward's logits and every
    parameter's gradient bit for bit (the router's included, through the gathered weights); the same
    routes one position late do not, so an off-by-one in the alignment cannot pass unseen."""
    model = load_model(tiny_checkpoint)  # its own copy: gradients are taken
    ids = torch.tensor([tok.encode("The Danube flows through Vienna, the capital of Austria, and on.")])

    def forward_backward(routes=None):
        model.zero_grad()
        with (
            RouteRecorder(model) as rec,
            replay_routes(model, routes) if routes is not None else contextlib.nullcontext(),
        ):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads, torch.as_tensor(rec.take())

    fresh, fresh_grads, recorded = forward_backward()
    replayed, replayed_grads, _ = forward_backward(recorded)
    assert torch.equal(replayed, fresh)
    assert fresh_grads.keys() == replayed_grads.keys() and any("gate" in n for n in fresh_grads)
    assert all(torch.equal(replayed_grads[n], g) for n, g in fresh_grads.items())
    late = torch.cat([recorded[:1], recorded[:-1]])  # position p replays p - 1's experts
    shifted, _, _ = forward_backward(late)
    assert not torch.equal(shifted, fresh)


def _with_routes(group, model, first: int = 0):
    """The group's trajectories carrying forced routes for every position but the last."""
    trajs = []
    for t in group.trajectories:
        n = t.prompt_ids.size + t.completion_ids.size - 1
        trajs.append(
            t.model_copy(update={"routed_experts": _forced_routes(model, n, first).numpy().astype(np.uint8)})
        )
    return group.model_copy(update={"trajectories": tuple(trajs)})


def _replayed_by_hand(model, ids: list[int], routes: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """log p(ids[p] | ids[:p]) from the model's own forward under replay, the full log-softmax."""
    with torch.no_grad(), replay_routes(model, torch.as_tensor(routes)):
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return np.array([float(lp[p - 1, ids[p]]) for p in positions])


async def test_replayed_evidence_differs_from_fresh_and_equals_a_replayed_pass_by_hand(tok, model):
    spec = PbsdSpec(teacher_template=TEMPLATE, evidence_routing="replay", noise_floor_samples=1)
    group = _with_routes(_group(tok, spec), model)
    scorer = LocalScorer(model)
    replayed = await score_group(group, tok, scorer, replayed=scorer.replayed)
    fresh_spec = spec.model_copy(update={"evidence_routing": "fresh"})
    fresh = await score_group(group.model_copy(update={"algorithm": fresh_spec}), tok, scorer)
    for i, t in enumerate(group.trajectories):
        assert not np.allclose(replayed.turn_evidence[i], fresh.turn_evidence[i], atol=1e-3)
        c = contexts_of(tok, t)
        shift = int(c.phi[0] - c.loss_positions[0])
        teacher_prompt = c.teacher[: t.prompt_ids.size + shift]
        mapping = position_map(t.prompt_ids.tolist(), teacher_prompt, len(c.teacher) - 1)
        # the completion is replayed at phi^-1: q -> q - shift
        np.testing.assert_array_equal(
            mapping[len(teacher_prompt) :], np.arange(t.prompt_ids.size, len(c.student) - 1)
        )
        student = _replayed_by_hand(model, c.student, t.routed_experts.astype(np.int64), c.loss_positions)
        teacher = _replayed_by_hand(model, c.teacher, routes_at(t.routed_experts, mapping), c.phi)
        expected = [np.mean((teacher - student)[c.token_turns == k]) for k in range(t.num_turns)]
        np.testing.assert_allclose(replayed.turn_evidence[i], expected, atol=2e-5)
    assert replayed.diagnostics.noise.tokens > 0 and replayed.diagnostics.noise.std < 1e-5  # float32


async def test_replay_with_the_identity_template_gives_zero_evidence(tok, model):
    """x* == x: both contexts are the same tokens with the same routes, so s = 0 exactly."""
    spec = PbsdSpec(teacher_template=IDENTITY, evidence_routing="replay")
    scorer = LocalScorer(model)
    scored = await score_group(
        _with_routes(_group(tok, spec), model, first=2), tok, scorer, replayed=scorer.replayed
    )
    assert all(np.all(s == 0.0) for s in scored.turn_evidence)


async def test_replay_needs_routes_and_a_backend_that_forces_them(tok, model):
    spec = PbsdSpec(teacher_template=TEMPLATE, evidence_routing="replay")
    scorer = LocalScorer(model)
    with pytest.raises(ValueError, match="the local backend"):
        await score_group(_with_routes(_group(tok, spec), model), tok, scorer)  # as an SGLang scorer
    with pytest.raises(ValueError, match="carries no routed experts"):
        await score_group(_group(tok, spec), tok, scorer, replayed=scorer.replayed)
    run = {
        "model": {"path": "m"},
        "data": {"train": "q.jsonl"},
        "algorithm": {"name": "pbsd", "evidence_routing": "replay"},
    }
    with pytest.raises(ValueError, match="return_routed_experts"):
        RunSpec.model_validate(run)
    assert (
        RunSpec.model_validate({**run, "rollout": {"return_routed_experts": True}}).algorithm.evidence_routing
        == "replay"
    )
