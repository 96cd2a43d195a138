"""The in-process engine: exact log-probs, KV reuse across turns, routes, stops, weight reloads."""

from __future__ import annotations

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


def _full_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for every i >= 1, from one forward over the whole sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
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
    assert first.cached_tokens == 0 and second.cached_tokens == len(prompt)
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
    from services.rollout.inprocess import NUCLEUS_CANDIDATES, _nucleus

    def by_full_sort(probs):
        ranked, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(ranked, dim=-1) - ranked < top_p
        filtered = torch.zeros_like(probs).scatter_(0, order[keep], ranked[keep])
        return filtered / filtered.sum()

    gen = torch.Generator().manual_seed(int(top_p * 1000 + scale))
    sizes = set()
    for _ in range(20):
        probs = torch.softmax(torch.randn(4096, generator=gen) * scale, dim=-1)
        got, want = _nucleus(probs, top_p), by_full_sort(probs)
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


async def test_concurrent_requests_decode_together_with_the_same_results(setup):
    """Four trajectories of different lengths in one wave give what each gives alone."""
    import asyncio

    model, tok = setup
    prompts = [
        tok.prompt_ids("You search.", q)
        for q in ("Which river?", "Which city was founded first?", "Who?", "A long question " * 5)
    ]
    alone = []
    for i, p in enumerate(prompts):
        engine = InProcessEngine(model)
        alone.append(await engine.generate(GenerationRequest(p, 12 + 3 * i, seed=i, session=f"s{i}")))
    engine = InProcessEngine(model)
    together = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(p, 12 + 3 * i, seed=i, session=f"s{i}"))
            for i, p in enumerate(prompts)
        )
    )
    assert engine.waves < len(prompts)  # they shared waves
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids and a.finish == b.finish
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)
    # and the caches split back per trajectory are right: a second turn continues each exactly
    second = await asyncio.gather(
        *(
            engine.generate(
                GenerationRequest(
                    p + r.output_ids + tok.glue_ids("ok", closed=False), 6, seed=9, session=f"s{i}"
                )
            )
            for i, (p, r) in enumerate(zip(prompts, together, strict=True))
        )
    )
    for i, (p, r, s) in enumerate(zip(prompts, together, second, strict=True)):
        ids = p + r.output_ids + tok.glue_ids("ok", closed=False)
        assert s.cached_tokens == len(p) + len(r.output_ids) - 1
        reference = _full_logprobs(model, ids + s.output_ids)[len(ids) - 1 :]
        np.testing.assert_allclose(s.logprobs, reference, atol=2e-4, err_msg=f"trajectory {i}")
