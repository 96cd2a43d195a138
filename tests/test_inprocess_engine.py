"""The in-process engine: exact log-probs, KV reuse across turns, routes, stops, weight reloads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from agent.chat import ChatTokenizer
from services.model.checkpoint import load_model, save_checkpoint
from services.model.routing import RouteRecorder
from services.rollout.engine import GenerationRequest
from services.rollout.inprocess import InProcessEngine


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    return load_model(tiny_checkpoint), ChatTokenizer.from_pretrained(tiny_checkpoint)


def _full_logprobs(model, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for every i >= 1, from one forward over the whole sequence (at the
    sampling temperature; greedy decoding reports the plain distribution's)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


async def test_two_turns_with_kv_reuse_match_a_full_forward(setup):
    model, tok = setup
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("You search.", "Which river?")
    r1 = await engine.generate(
        GenerationRequest(prompt, 40, seed=1, session="s", stop_token_ids=tuple(tok.stop_ids))
    )
    glue = tok.glue_ids("a tool result", closed=r1.output_ids[-1] == tok.end_id)
    ids2 = prompt + r1.output_ids + glue
    r2 = await engine.generate(
        GenerationRequest(ids2, 40, seed=2, session="s", stop_token_ids=tuple(tok.stop_ids))
    )
    assert r2.cached_tokens == len(prompt) + len(r1.output_ids) - 1  # only the new tokens were fed
    full = ids2 + r2.output_ids
    reference = _full_logprobs(model, full)
    np.testing.assert_allclose(
        r1.logprobs, reference[len(prompt) - 1 : len(prompt) - 1 + len(r1.output_ids)], atol=2e-4
    )
    np.testing.assert_allclose(r2.logprobs, reference[len(ids2) - 1 :], atol=2e-4)


async def test_same_outputs_without_kv_reuse(setup):
    model, tok = setup
    prompt = tok.prompt_ids("You search.", "Which city?")
    outs = []
    for reuse in (True, False):
        engine = InProcessEngine(model, reuse_cache=reuse)
        a = await engine.generate(GenerationRequest(prompt, 30, seed=5, session="x"))
        b = await engine.generate(
            GenerationRequest(
                prompt + a.output_ids + tok.glue_ids("r", closed=False), 30, seed=6, session="x"
            )
        )
        outs.append((a.output_ids, b.output_ids, b.logprobs))
    assert outs[0][0] == outs[1][0] and outs[0][1] == outs[1][1]
    np.testing.assert_allclose(outs[0][2], outs[1][2], atol=2e-4)


async def test_prompt_cache_is_shared_by_the_samples_of_a_group(setup):
    model, tok = setup
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("You search.", "Which event?")
    first = await engine.generate(GenerationRequest(prompt, 5, seed=1, session="g/0"))
    fed_after_first = engine.tokens_fed
    second = await engine.generate(GenerationRequest(prompt, 5, seed=1, session="g/1"))
    # the shared cache ends before the prompt's last token, which every sample feeds itself
    assert first.cached_tokens == 0 and second.cached_tokens == len(prompt) - 1
    assert engine.tokens_fed - fed_after_first < 6  # the prompt was not computed again
    assert first.output_ids == second.output_ids  # same seed, same state: same sample


async def test_stop_length_and_top_p(setup):
    model, tok = setup
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("s", "q")
    r = await engine.generate(GenerationRequest(prompt, 7, seed=3))
    assert r.finish == "length" and len(r.output_ids) == 7
    stop = r.output_ids[2]
    r = await engine.generate(GenerationRequest(prompt, 7, seed=3, stop_token_ids=(stop,)))
    assert r.finish == "stop" and r.output_ids[-1] == stop and stop not in r.output_ids[:-1]
    # a vanishing nucleus is greedy decoding
    greedy = await engine.generate(GenerationRequest(prompt, 5, temperature=0.0))
    nucleus = await engine.generate(GenerationRequest(prompt, 5, top_p=1e-9, seed=9))
    assert greedy.output_ids == nucleus.output_ids


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (the nucleus is beyond the candidates) to sharp
def test_the_nucleus_is_the_one_a_full_sort_finds(top_p, scale):
    from services.rollout.sampling import NUCLEUS_CANDIDATES, nucleus

    def by_full_sort(probs):
        ranked, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(ranked, dim=-1) - ranked < top_p
        filtered = torch.zeros_like(probs).scatter_(0, order[keep], ranked[keep])
        return filtered / filtered.sum()

    gen = torch.Generator().manual_seed(int(top_p * 1000 + scale))
    sizes = set()
    for _ in range(20):
        probs = torch.softmax(torch.randn(4096, generator=gen) * scale, dim=-1)
        got = nucleus(probs[None], torch.tensor([top_p]))[0]
        got, want = got / got.sum(), by_full_sort(probs)
        assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-8)
        sizes.add(int((got > 0).sum()) > NUCLEUS_CANDIDATES)
    if scale == 0.5 and top_p >= 0.5:
        assert sizes == {True}  # these took the full sort
    if scale == 12.0:
        assert sizes == {False}  # these were found among the candidates


async def test_routes_match_a_full_forward(setup):
    model, tok = setup
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("s", "routes please")
    r1 = await engine.generate(GenerationRequest(prompt, 6, seed=4, session="r", return_routed_experts=True))
    ids2 = prompt + r1.output_ids + tok.glue_ids("x", closed=False)
    r2 = await engine.generate(
        GenerationRequest(
            ids2,
            6,
            seed=4,
            session="r",
            return_routed_experts=True,
            routed_experts_start_len=len(prompt) + len(r1.output_ids) - 1,
        )
    )
    routes = np.concatenate([r1.routed_experts, r2.routed_experts])
    full = ids2 + r2.output_ids
    assert routes.shape == (len(full) - 1, model.config.num_hidden_layers, model.config.num_experts_per_tok)
    with RouteRecorder(model) as rec, torch.no_grad():
        model(input_ids=torch.tensor([full[:-1]]))
    reference = rec.take()
    agree = (np.sort(routes, axis=-1) == np.sort(reference, axis=-1)).all(axis=(1, 2)).mean()
    assert agree > 0.99  # near-ties may flip between incremental and full computation


async def test_weight_reload_changes_outputs_and_drops_caches(setup, tmp_path):
    model, tok = setup
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("s", "reload")
    before = await engine.generate(GenerationRequest(prompt, 5, temperature=0.0, session="w"))
    perturbed = load_model(_checkpoint_dir(model, tmp_path))
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    save_checkpoint(perturbed, tmp_path / "v1")
    await engine.update_weights(str(tmp_path / "v1"), 1)
    after = await engine.generate(GenerationRequest(prompt, 5, temperature=0.0, session="w"))
    assert engine.weight_version == 1 and after.weight_version == 1 and after.cached_tokens == 0
    assert before.logprobs != after.logprobs


def _checkpoint_dir(model, tmp_path):
    return save_checkpoint(model, tmp_path / "v0")


def _conversations(tok):
    """Six trajectories of different prompt lengths and sampling settings; two share a prompt."""
    questions = (
        "Which river?",
        "Which city was founded first?",
        "Who?",
        "A long question " * 5,
        "Who?",
        "Why",
    )
    settings = [(1.0, 1.0), (1.0, 0.9), (0.7, 1.0), (1.0, 0.5), (1.0, 1.0), (0.0, 1.0)]
    return [
        (tok.prompt_ids("You search.", q), 10 + 3 * i, temperature, top_p, i)
        for i, (q, (temperature, top_p)) in enumerate(zip(questions, settings, strict=True))
    ]


async def _run(engine, tok, conversation, *, turns: int, delays: list[float] | None = None):
    """A trajectory of ``turns`` turns with tool-result glue between them (and, with ``delays``,
    a pause per turn standing in for the tool call): every turn's result."""
    import asyncio

    ids, tokens, temperature, top_p, i = conversation
    results = []
    for t in range(turns):
        if delays is not None:
            await asyncio.sleep(delays[t])
        request = GenerationRequest(
            ids, tokens, temperature=temperature, top_p=top_p, seed=100 * i + t, session=f"s{i}"
        )
        r = await engine.generate(request)
        results.append(r)
        ids = ids + r.output_ids + tok.glue_ids(f"result {t} of {i}", closed=False)
    return results


async def test_batching_never_changes_an_output(setup):
    """Trajectories decoded together, joining and leaving the running batch at times set by
    their (random) tool latencies, get bitwise the tokens and log-probs each gets alone: the
    same for any timing, so the same seeds reproduce under any load."""
    import asyncio
    import random

    model, tok = setup
    conversations = _conversations(tok)
    alone = []
    for c in conversations:
        alone.append(await _run(InProcessEngine(model), tok, c, turns=3))
    for timing in range(3):
        rng = random.Random(timing)
        engine = InProcessEngine(model)
        together = await asyncio.gather(
            *(
                _run(engine, tok, c, turns=3, delays=[rng.uniform(0, 0.02) for _ in range(3)])
                for c in conversations
            )
        )
        assert engine.decoded_rows > 1.5 * engine.decode_steps  # rows did share forwards
        for a, b in zip(alone, together, strict=True):
            for x, y in zip(a, b, strict=True):
                assert x.output_ids == y.output_ids and x.logprobs == y.logprobs and x.finish == y.finish
        # alone, each trajectory computed its prompt; together, the second "Who?" copied the first's
        assert sum(r[0].cached_tokens for r in together) > 0


async def test_batched_decoding_matches_a_full_forward(setup):
    """The caches kept per trajectory through batched turns are right: each trajectory's log-probs
    are those of one forward over its whole conversation."""
    import asyncio

    model, tok = setup
    conversations = _conversations(tok)
    engine = InProcessEngine(model)
    together = await asyncio.gather(*(_run(engine, tok, c, turns=2) for c in conversations))
    for (ids, _, temperature, _, i), (first, second) in zip(conversations, together, strict=True):
        ids2 = ids + first.output_ids + tok.glue_ids(f"result 0 of {i}", closed=False)
        assert second.cached_tokens == len(ids) + len(first.output_ids) - 1  # only new tokens fed
        full = _full_logprobs(model, ids2 + second.output_ids, temperature)
        np.testing.assert_allclose(second.logprobs, full[len(ids2) - 1 :], atol=2e-4, err_msg=f"conv {i}")
        np.testing.assert_allclose(
            first.logprobs, full[len(ids) - 1 : len(ids) - 1 + len(first.output_ids)], atol=2e-4
        )


async def test_new_weights_wait_for_the_running_turn(setup, tmp_path):
    """A reload requested while a sequence decodes applies after its turn: that turn is sampled
    entirely with the old weights (and says so), the next request with the new ones."""
    import asyncio

    model, tok = setup
    path = save_checkpoint(model, tmp_path / "same")
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("s", "a long turn")
    running = asyncio.create_task(engine.generate(GenerationRequest(prompt, 60, seed=1, session="r")))
    while engine.decode_steps < 3:
        await asyncio.sleep(0.001)
    await engine.update_weights(str(path), 7)
    old = await running
    assert old.weight_version == 0 and len(old.output_ids) == 60
    new = await engine.generate(GenerationRequest(prompt, 5, seed=1, session="r"))
    assert new.weight_version == 7 and new.cached_tokens == 0  # caches went with the old weights


async def test_a_request_whose_caller_is_gone_decodes_no_further(setup):
    """A cancelled request (a worker stopping, a prompt another worker took over) went on decoding
    to the end of its turn, up to max_tokens_per_turn steps of nobody's work; it now leaves the
    batch at the next step, and the engine goes on serving."""
    model, tok = setup
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("You search.", "Which river?")
    call = asyncio.create_task(engine.generate(GenerationRequest(prompt, 1_000, seed=1)))
    async with asyncio.timeout(10):
        while engine.decode_steps < 3:
            await asyncio.sleep(0.005)
    call.cancel()
    steps = engine.decode_steps
    after = await engine.generate(GenerationRequest(prompt, 5, seed=2))
    assert len(after.output_ids) == 5
    # the step in flight at the cancel, then the new request's 4 decode steps (its first token
    # comes from its prefill): nothing more, where the cancelled request had ~990 steps to go
    assert engine.decode_steps - steps <= 1 + 4

    async def cost() -> int:  # tokens fed for a one-token request (the prompt's cache is warm)
        fed = engine.tokens_fed
        await engine.generate(GenerationRequest(prompt, 1, seed=4))
        return engine.tokens_fed - fed

    alone = await cost()
    queued = [
        asyncio.create_task(engine.generate(GenerationRequest(prompt, 1_000, seed=3))) for _ in range(2)
    ]
    await engine.hold()  # the engine parked: the requests wait in its queue
    for q in queued:
        q.cancel()
    await engine.release(None)
    assert await cost() == alone  # the cancelled ones were never prefilled
    await engine.aclose()


async def test_a_hold_or_a_load_given_up_leaves_the_engine_serving(setup, tmp_path):
    """A weight follower cancelled while its hold or its load waited behind a running turn (a
    worker stopping) cancelled the future the engine's thread settles: the thread died of the
    refused result, and every request after it hung until the next one started a new thread.
    The engine now skips what its caller gave up, and goes on serving."""
    model, tok = setup
    engine = InProcessEngine(model)
    prompt = tok.prompt_ids("You search.", "Which river?")
    save_checkpoint(model, tmp_path / "same")
    for give_up in (engine.hold, lambda: engine.update_weights(str(tmp_path / "same"), 9)):
        running = asyncio.create_task(engine.generate(GenerationRequest(prompt, 200, seed=1)))
        async with asyncio.timeout(10):
            while engine.decode_steps == 0:
                await asyncio.sleep(0.005)
        waiting = asyncio.create_task(give_up())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # behind the running turn
        waiting.cancel()
        await running
        after = await asyncio.wait_for(engine.generate(GenerationRequest(prompt, 3, seed=2)), 10)
        assert len(after.output_ids) == 3 and await engine.health()
        assert engine.weight_version == 0  # the load given up was not made
    await engine.aclose()
