"""The evidence scorer: contexts and phi, exact evidence, numerics, fresh MoE routing, pass-through."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from agent.privileged import teacher_prompt_ids
from agent.prompt import user_prompt
from pbsd import credit
from proto.messages import Trajectory, TrajectoryGroup
from proto.runs import GrpoSpec, PbsdSpec
from services.model.checkpoint import load_model
from services.model.routing import moe_routers, replay_routes
from services.scorer.backends import LocalScorer, SglangScorer
from services.scorer.contexts import build_contexts, group_contexts
from services.scorer.evidence import score_group
from services.scorer.logprobs import sequence_logprobs
from services.upstream import UpstreamError
from tests.servers import serve
from tests.sglang_fake import make_sglang, prompt_logprob

TEMPLATE = "{question}\n\n[The verified answer is {answer}.]"
IDENTITY = "{question}{answer:.0}"  # formats to the question alone: x* == x


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def _trajectory(
    tok: ChatTokenizer,
    turns: list[str],
    glue: str = "tool says hi",
    *,
    i: int = 0,
    reward: float = 1.0,
    finish: str = "answer",
) -> Trajectory:
    prompt = tok.prompt_ids("You are a search agent.", user_prompt("Which river flows through Vienna?"))
    completion, mask, spans = [], [], []
    for k, text in enumerate(turns):
        ids = tok.encode(text) + [tok.end_id]
        spans.append((len(completion), len(completion) + len(ids)))
        completion += ids
        mask += [1] * len(ids)
        if k < len(turns) - 1:
            g = tok.glue_ids(glue, closed=True)
            completion += g
            mask += [0] * len(g)
    return Trajectory(
        trajectory_id=f"t/{i}",
        sample_index=i,
        policy_version=0,
        prompt_ids=np.array(prompt, np.int32),
        completion_ids=np.array(completion, np.int32),
        loss_mask=np.array(mask, np.uint8),
        rollout_logprobs=np.zeros(len(completion), np.float32),
        turn_spans=tuple(spans),
        reward=reward,
        finish_reason=finish,
        error="boom" if finish == "error" else None,
    )


def _group(tok, algorithm, rewards=(1.0, 0.0, 1.0), finishes=None) -> TrajectoryGroup:
    finishes = finishes or ["answer"] * len(rewards)
    turns = [
        ["Let me search for the river.", "The answer is \\boxed{Danube}."],
        ["Searching the web.", "Still searching.", "\\boxed{Rhine}"],
        ["\\boxed{Danube}"],
    ]
    trajs = tuple(
        _trajectory(tok, turns[i % 3], i=i, reward=r, finish=f)
        for i, (r, f) in enumerate(zip(rewards, finishes, strict=True))
    )
    return group_of(trajs, algorithm)


def group_of(trajectories, algorithm) -> TrajectoryGroup:
    """The group of ``trajectories``, sampled for the Vienna question of version 0."""
    return TrajectoryGroup(
        run_id="r",
        task_id="r:0",
        question_id="q",
        question="Which river flows through Vienna?",
        answer="Danube",
        policy_version=0,
        algorithm=algorithm,
        trajectories=tuple(trajectories),
    )


def contexts_of(tok, t: Trajectory, template: str = TEMPLATE, teacher_max_length: int | None = None):
    """The student and teacher contexts the scorer builds for ``t`` of the Vienna question."""
    return build_contexts(
        tok,
        t.prompt_ids.tolist(),
        t.completion_ids.tolist(),
        t.loss_mask,
        t.turn_spans,
        answer="Danube",
        template=template,
        teacher_max_length=teacher_max_length,
    )


def test_teacher_prompt_rewrites_only_the_user_message(tok):
    prompt = tok.prompt_ids("SYSTEM TEXT", "QUESTION TEXT")
    teacher = teacher_prompt_ids(tok, prompt, "Danube", TEMPLATE)
    assert tok.decode(teacher) == tok.fmt.prompt(
        "SYSTEM TEXT", "QUESTION TEXT\n\n[The verified answer is Danube.]"
    )
    user_start = [i for i, t in enumerate(prompt) if t == tok.encode("<|im_start|>")[0]][-2]
    assert teacher[: user_start + 1] == prompt[: user_start + 1]  # the system message, id for id
    tail = prompt[prompt.index(tok.end_id, user_start) :]
    assert teacher[-len(tail) :] == tail  # and everything after the user message
    assert teacher_prompt_ids(tok, prompt, "Danube", IDENTITY) == prompt


def test_phi_by_hand_and_truncation(tok):
    t = _trajectory(tok, ["a", "b c"])
    c = contexts_of(tok, t)
    shift = len(teacher_prompt_ids(tok, t.prompt_ids.tolist(), "Danube", TEMPLATE)) - len(t.prompt_ids)
    assert shift > 0 and len(c.teacher) - len(c.student) == shift
    np.testing.assert_array_equal(c.loss_positions, np.flatnonzero(t.loss_mask) + len(t.prompt_ids))
    np.testing.assert_array_equal(c.phi, c.loss_positions + shift)
    for s, p in zip(c.loss_positions, c.phi, strict=True):
        assert c.student[s] == c.teacher[p]  # phi maps each loss token onto the same token
    np.testing.assert_array_equal(c.token_turns, np.repeat([0, 1], [e - s for s, e in t.turn_spans]))
    # cut x* just after the second turn's first token: the turn's other tokens lose phi (the cut
    # was three tokens in once, the turn's whole length, so nothing was cut)
    first = int(np.flatnonzero(c.token_turns == 1)[0])
    cut = int(c.phi[first]) + 1
    assert cut < len(c.teacher)
    c2 = contexts_of(tok, t, teacher_max_length=cut)
    assert c2.teacher == c.teacher[:cut]
    assert c2.phi.tolist() == c.phi[: first + 1].tolist() + [-1] * (len(c.phi) - first - 1)


def test_a_trajectory_that_fills_its_context_keeps_a_teacher_position_for_every_token(tok):
    """The cut defaulted to 65,536, the rollout's max_context, and x* is longer than x by the note:
    every trajectory that filled its context lost the note's length of its last turn's tokens."""
    group = _group(tok, PbsdSpec(teacher_template=TEMPLATE))
    t = group.trajectories[0]
    spec = PbsdSpec(teacher_template=TEMPLATE)
    assert spec.teacher_max_length is None
    (c, *_) = group_contexts(group.model_copy(update={"algorithm": spec}), tok)
    assert len(c.teacher) == t.prompt_ids.size + t.completion_ids.size + (c.phi[0] - c.loss_positions[0])
    assert np.all(c.phi >= 0) and np.array_equal(
        np.asarray(c.student)[c.loss_positions], np.asarray(c.teacher)[c.phi]
    )
    at_rollout_limit = contexts_of(tok, t, teacher_max_length=len(c.student))  # the old default's cut
    assert (at_rollout_limit.phi < 0).sum() == (c.phi >= len(c.student)).sum() > 0


def _direct(model, ids: list[int], positions) -> np.ndarray:
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return np.array([float(lp[p - 1, ids[p]]) for p in positions])


async def test_evidence_equals_a_direct_per_sequence_computation(tok, model):
    spec = PbsdSpec(teacher_template=TEMPLATE, delta=0.1, clip=0.1)
    group = _group(tok, spec)
    scored = await score_group(group, tok, LocalScorer(model))
    adv = credit.group_advantages(group.rewards)
    np.testing.assert_allclose(scored.advantages, adv, rtol=1e-6)
    for i, t in enumerate(group.trajectories):
        c = contexts_of(tok, t, teacher_max_length=10**6)
        student = _direct(model, c.student, c.loss_positions)
        teacher = _direct(model, c.teacher, c.phi)
        expected = [
            np.mean(teacher[c.token_turns == k] - student[c.token_turns == k]) for k in range(t.num_turns)
        ]
        np.testing.assert_allclose(scored.turn_evidence[i], expected, atol=2e-5)
        np.testing.assert_allclose(scored.turn_weights[i], credit.turn_weights(expected, adv[i]), atol=1e-5)
    d = scored.diagnostics
    assert d.scored_turns == d.turns == 6 and d.evidence.size == 6
    assert d.teacher_higher_frac == pytest.approx(float((d.evidence > 0).mean()))
    assert d.mean_abs_gap == pytest.approx(float(np.abs(d.evidence).mean()), rel=1e-5)


async def test_identity_template_gives_zero_evidence_and_unit_weights(tok, model):
    scored = await score_group(_group(tok, PbsdSpec(teacher_template=IDENTITY)), tok, LocalScorer(model))
    for s, w in zip(scored.turn_evidence, scored.turn_weights, strict=True):
        assert np.all(s == 0.0) and np.all(w == 1.0)
    assert scored.diagnostics.filtered_frac == 1.0 and scored.diagnostics.teacher_higher_frac == 0.0


async def test_token_ids_outside_the_vocabulary_are_refused_before_any_forward(model):
    """On a GPU the embedding's gather would fail with a device-side assert, which poisons the
    process: every later group would fail too. The scorer refuses the group's ids first."""
    vocab = model.get_input_embeddings().num_embeddings
    scorer = LocalScorer(model)
    for bad in ([1, 2, vocab], [1, -1, 2]):
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            await scorer([(bad, np.array([1, 2]))])
    assert (await scorer([([1, 2, 3], np.array([1, 2]))]))[0].shape == (2,)


def test_packed_equals_unpacked(tok, model):
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 900, n).tolist(), np.arange(1, n)) for n in (300, 37, 150, 90, 5)]
    single = sequence_logprobs(model, requests, pack=False)
    packed = sequence_logprobs(model, requests, pack=True, token_budget=400, chunk_size=16)
    for a, b in zip(single, packed, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_scoring_ignores_a_routing_replay_left_on_the_model(tok, model):
    ids = tok.encode("The Danube flows through Vienna, the capital of Austria.")
    positions = np.arange(1, len(ids))
    fresh = sequence_logprobs(model, [(ids, positions)])[0]
    routers = moe_routers(model)
    forced = torch.zeros((len(ids), len(routers), model.config.num_experts_per_tok), dtype=torch.long)
    forced[..., 1] = 1  # everything to experts 0 and 1
    with replay_routes(model, forced):
        with torch.no_grad():  # the replay really changes this model's outputs ...
            replayed = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        assert not np.allclose(
            replayed[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy(), fresh, atol=1e-4
        )
        during = sequence_logprobs(model, [(ids, positions)])[0]  # ... but not the scorer's passes
        assert all("forward" in r.__dict__ for r in routers)  # and the replay is still in place afterwards
    np.testing.assert_array_equal(during, fresh)


async def test_grpo_groups_pass_through(tok):
    group = _group(tok, GrpoSpec())

    async def never(requests, pairs=None):
        raise AssertionError("GRPO groups are not scored")

    scored = await score_group(group, tok, never)
    assert not scored.scored
    np.testing.assert_allclose(scored.advantages, credit.group_advantages(group.rewards), rtol=1e-6)
    assert all(
        np.all(w == 1.0) and np.all(np.isnan(s))
        for s, w in zip(scored.turn_evidence, scored.turn_weights, strict=True)
    )


async def test_failed_trajectories_get_no_advantage(tok, model):
    group = _group(
        tok,
        PbsdSpec(teacher_template=TEMPLATE),
        rewards=(1.0, 0.0, 0.0),
        finishes=["answer", "answer", "error"],
    )
    scored = await score_group(group, tok, LocalScorer(model))
    np.testing.assert_allclose(scored.advantages[:2], credit.group_advantages([1.0, 0.0]), rtol=1e-6)
    assert scored.advantages[2] == 0.0 and np.all(scored.turn_weights[2] == 1.0)


async def test_sglang_scorer_keeps_a_trajectorys_passes_on_one_server_and_one_weight_version(tok):
    """Spread one request at a time, with two servers every student pass went to one and every
    teacher pass to the other, and a reload between a pair's passes went unseen: s was one
    version's teacher minus another's student."""
    ids = tok.encode("The Danube flows through Vienna.")
    pos = np.array([3, 4])
    requests = [(ids, pos), (ids[:-1], pos), (ids, pos), (ids[:-1], pos), (ids[:-2], pos)]
    pairs = [0, 0, 1, 1, 0]  # two trajectories' student and teacher passes, and one null pass
    a, b = make_sglang(lambda ids: []), make_sglang(lambda ids: [], script=["ok", "reload"])
    with serve(a) as url_a, serve(b) as url_b:
        scorer = SglangScorer([url_a, url_b], concurrency=1)  # one at a time: the script's order holds
        got = await scorer(requests, pairs)
        await scorer.http.aclose()
    served = (
        {tuple(r["input_ids"]) for r in a.state.requests},
        {tuple(r["input_ids"]) for r in b.state.requests},
    )
    assert len(a.state.requests) == 3 and len(b.state.requests) == 4  # b's pair was scored again
    assert {tuple(ids), tuple(ids[:-1]), tuple(ids[:-2])} == served[0] and served[1] == {
        tuple(ids),
        tuple(ids[:-1]),
    }
    for (r_ids, r_pos), values in zip(requests, got, strict=True):
        np.testing.assert_allclose(values, [prompt_logprob(r_ids[p], p) for p in r_pos], rtol=1e-6)
    assert got.version == 0  # a's pairs named 0 and b's 1: the call's version is the older
    always = make_sglang(lambda ids: [], script=["ok", "reload"] * SglangScorer.PAIR_ATTEMPTS)
    with serve(always) as url:
        scorer = SglangScorer([url])
        with pytest.raises(UpstreamError, match="weights changed between a trajectory's passes"):
            await scorer(requests[:2], [0, 0])
        await scorer.http.aclose()


async def test_a_group_names_the_weights_that_scored_it_not_those_held_when_it_came(tok, model):
    """The scorer's version was read when a group arrived: a group that waited for a weight load
    to finish was scored by the new weights and labelled with the old version."""
    scorer = LocalScorer(model, version=3)
    await scorer.hold()  # a broadcast is writing version 4
    waiting = asyncio.create_task(score_group(_group(tok, PbsdSpec(teacher_template=TEMPLATE)), tok, scorer))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await scorer.release(4)
    scored = await waiting
    assert scored.scored and scored.scorer_policy_version == 4


async def test_a_group_that_waited_out_a_broadcast_that_failed_waits_for_whole_weights(tok, model):
    """The scorer checked that its weights were whole, then waited for the lock a broadcast held:
    when that broadcast failed halfway, the group was scored with the torn weights, as version -1."""
    from services.weights.receiver import TORN

    scorer = LocalScorer(model, version=3)
    await scorer.hold()
    waiting = asyncio.create_task(score_group(_group(tok, PbsdSpec(teacher_template=TEMPLATE)), tok, scorer))
    await asyncio.sleep(0.05)
    await scorer.release(TORN)  # the broadcast failed: the weights are half written
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await scorer.hold()
    await scorer.release(4)  # the next copy, whole
    assert (await asyncio.wait_for(waiting, 30)).scorer_policy_version == 4


async def test_a_cancelled_pass_keeps_the_model_until_its_thread_ends(tok, model):
    """A pass runs in a thread that no cancellation stops. A cancelled call (its scorer stopping,
    its group taken over by another scorer) let go of the model's lock at once: a second pass or
    a weight load could then run beside the thread still scoring. It now lets go once the thread
    has ended."""
    scorer = LocalScorer(model)
    running, gate = threading.Event(), threading.Event()

    def slow(requests):
        running.set()
        gate.wait(10)
        return [np.zeros(1, dtype=np.float32)]

    scorer._score = slow
    call = asyncio.create_task(scorer([(tok.encode("The Danube"), np.array([1]))]))
    assert await asyncio.to_thread(running.wait, 10)
    for _ in range(2):  # a handler stopped, then its consumer: cancelled twice
        call.cancel()
        await asyncio.sleep(0.1)
        assert not call.done() and scorer._lock.locked()  # the thread still has the model
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, 10)
    assert not scorer._lock.locked()


async def test_sglang_scorer_reads_prompt_logprobs(tok):
    app = make_sglang(lambda ids: [])
    ids = tok.encode("The Danube flows through Vienna.")
    positions = np.array([3, 4, 7])
    with serve(app) as url:
        scorer = SglangScorer([url])
        (got,) = await scorer([(ids, positions)])
        await scorer.http.aclose()
    body = app.state.requests[0]
    assert body["sampling_params"] == {"max_new_tokens": 0} and body["logprob_start_len"] == 2
    np.testing.assert_allclose(got, [prompt_logprob(ids[p], p) for p in positions], rtol=1e-6)


def _stub_backend(contexts, bonus):
    """A backend whose log-probs are chosen by hand: every student token at -1, every teacher token
    at -1 plus ``bonus[i][k]``, k the turn of the student token it is aligned with."""
    from services.scorer.evidence import LogProbs

    async def logprobs(requests, pairs=None):
        out, seen = [], set()
        for (_ids, positions), i in zip(requests, pairs, strict=True):
            if i not in seen:  # a trajectory's first request is its student pass
                seen.add(i)
                out.append(np.full(len(positions), -1.0))
                continue
            c = contexts[i]
            turns = c.token_turns[c.phi >= 0]
            assert len(turns) == len(positions)
            out.append(np.array([-1.0 + bonus[i][k] for k in turns]))
        return LogProbs(out, version=0)

    return logprobs


async def test_score_group_on_hand_chosen_logprobs_gives_the_papers_numbers(tok):
    """Algorithm 1 end to end through the scorer, on numbers worked by hand: A from the rewards
    (ddof 1), s_t the mean over the turn's aligned tokens of log p_T - log p_S, w_t = 1
    with s_t inside [-eps-, eps+], else 1 + sign(A) clip(tanh(s / delta), -c, c)."""
    # delta and clip apart, so that one taken for the other shows
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0, delta=0.05, clip=0.2)
    group = _group(tok, spec)  # rewards 1, 0, 1; 2, 3 and 1 turns
    bonus = {0: [0.05, 0.0005], 1: [-0.002, -0.005, 0.004], 2: [0.02]}
    scored = await score_group(group, tok, _stub_backend(group_contexts(group, tok), bonus))
    a = 1 / np.sqrt(3)  # mean 2/3, sample std sqrt(1/3)
    np.testing.assert_allclose(scored.advantages, [a, -2 * a, a], rtol=1e-5)
    for i in range(3):
        np.testing.assert_allclose(scored.turn_evidence[i], bonus[i], atol=1e-7)
    expected = [
        [1.2, 1.0],  # tanh(1.0) = 0.76 clipped at 0.2; 0.0005 inside the deadband
        [1.0, 1 - np.tanh(-0.1), 1 - np.tanh(0.08)],  # A < 0 flips the sign
        [1.2],  # tanh(0.4) = 0.38 clipped
    ]
    for got, want in zip(scored.turn_weights, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert scored.diagnostics.filtered_frac == pytest.approx(2 / 6)


async def test_a_cut_x_star_leaves_turns_without_phi_at_unit_weight(tok):
    """With teacher_max_length the tokens past the cut have no phi: a turn with none left has no
    evidence (NaN) and w = 1 (Algorithm 1's empty I), a turn cut part-way is the mean of what is
    left."""
    full = group_contexts(_group(tok, PbsdSpec(teacher_template=TEMPLATE)), tok)[1]
    last = full.token_turns == 2
    # the longest cut that leaves the last turn no aligned token and the turns before it some
    cut = max(int(full.phi[last].min()) + 1, 1)
    while (full.phi[~last] >= cut).any() or cut > full.phi[last].min():
        cut -= 1
    spec = PbsdSpec(teacher_template=TEMPLATE, noise_floor_samples=0, teacher_max_length=cut)
    group = _group(tok, spec, rewards=(1.0, 0.0, 1.0))
    contexts = group_contexts(group, tok)
    c = contexts[1]
    assert (c.phi[c.token_turns == 2] < 0).all() and (c.phi[c.token_turns < 2] >= 0).all()
    bonus = {0: [0.05, 0.05], 1: [0.05, 0.05, 0.05], 2: [0.05]}
    scored = await score_group(group, tok, _stub_backend(contexts, bonus))
    s, w = scored.turn_evidence[1], scored.turn_weights[1]
    assert np.isnan(s[2]) and w[2] == 1.0
    np.testing.assert_allclose(s[:2], 0.05, atol=1e-7)
    np.testing.assert_allclose(w[:2], 0.9, atol=1e-6)  # A < 0
    assert scored.diagnostics.unaligned_tokens >= int(last.sum())


def test_a_failed_trajectory_has_no_contexts_to_score(tok):
    """Its advantage is 0, so w = 1 whatever s is, but its two passes cost as much as any, and its
    turns would count in the group's figures."""
    group = _group(tok, PbsdSpec(teacher_template=TEMPLATE), finishes=["answer", "answer", "error"])
    assert [c is None for c in group_contexts(group, tok)] == [False, False, True]


def test_the_support_template_gets_the_groups_facts(tok):
    group = _group(tok, PbsdSpec(teacher_template="support")).model_copy(
        update={"support": ("Vienna lies on the Danube (page kb://x)",)}
    )
    (c, *_) = group_contexts(group, tok)
    assert "Vienna lies on the Danube" in tok.decode(c.teacher)
