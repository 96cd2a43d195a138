"""The SGLang client against servers that answer exactly as SGLang does."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request

from services.rollout.engine import EngineError, GenerationRequest
from services.rollout.sglang import SglangEngine
from services.scorer.backends import SglangScorer
from services.upstream import KEEP_ALIVE_S, RetryPolicy
from tests.servers import serve
from tests.sglang_fake import LAYERS, TOP_K, make_sglang

NO_WAIT = RetryPolicy(max_attempts=2, base_delay_s=0.0)


def echo_policy(ids):
    return [5, 6, 7, 2]  # three tokens, then the stop token 2


async def test_parse_output_logprobs_and_finish():
    with serve(make_sglang(echo_policy, logprob=-0.25, version=3)) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        r = await engine.generate(GenerationRequest([1, 2, 3], 16, stop_token_ids=(2,)))
        assert (r.output_ids, r.logprobs, r.finish, r.weight_version) == (
            [5, 6, 7, 2],
            [-0.25] * 4,
            "stop",
            3,
        )
        r = await engine.generate(GenerationRequest([1, 2, 3], 2, stop_token_ids=(2,)))
        assert (r.output_ids, r.finish) == ([5, 6], "length")
        r = await engine.generate(
            GenerationRequest([1, 2, 3], 16, return_routed_experts=True, routed_experts_start_len=1)
        )
        assert r.routed_experts.shape == (3 + 4 - 1 - 1, LAYERS, TOP_K)
        assert await engine.health()
        await engine.aclose()


async def test_abort_is_reported_not_raised():
    with serve(make_sglang(echo_policy, script=["abort"])) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        r = await engine.generate(GenerationRequest([1], 16))
        await engine.aclose()
    assert (r.finish, r.message) == ("abort", "Aborted")


async def test_a_turn_sampled_across_a_weight_update_has_the_oldest_version():
    """After a retract-mode update SGLang finishes the turn with the new weights and reports the
    spans of each version: the turn is as stale as its oldest token."""
    app = make_sglang(echo_policy, script=["updated", "ok"], version=4)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        mixed = await engine.generate(GenerationRequest([1, 2, 3], 16, stop_token_ids=(2,)))
        whole = await engine.generate(GenerationRequest([1, 2, 3], 16, stop_token_ids=(2,)))
        await engine.aclose()
    assert (mixed.weight_version, whole.weight_version) == (3, 4)


async def test_5xx_fails_over_to_the_next_server_and_cools_down():
    bad = make_sglang(echo_policy, script=[500] * 10)
    good = make_sglang(echo_policy)
    with serve(bad) as bad_url, serve(good) as good_url:
        engine = SglangEngine([bad_url, good_url], retry=NO_WAIT, layers=LAYERS, top_k=TOP_K)
        # the session hashes to the bad server first: it fails, the good one answers
        session = next(s for s in (f"s{i}" for i in range(100)) if engine._order(s)[0] == bad_url)
        r = await engine.generate(GenerationRequest([1], 16, session=session))
        assert r.output_ids == [5, 6, 7, 2]
        assert len(bad.state.requests) == 2 and len(good.state.requests) == 1
        # the bad server now cools down: the next request goes straight to the good one
        await engine.generate(GenerationRequest([1], 16, session=session))
        assert len(bad.state.requests) == 2
        await engine.aclose()


async def test_every_server_failing_raises_and_4xx_is_not_retried():
    app = make_sglang(echo_policy, script=[503] * 10)
    with serve(app) as url:
        engine = SglangEngine([url], retry=NO_WAIT, layers=LAYERS, top_k=TOP_K)
        with pytest.raises(EngineError, match="every SGLang server failed"):
            await engine.generate(GenerationRequest([1], 16))
        await engine.aclose()
    app = make_sglang(echo_policy, script=[400])
    with serve(app) as url:
        engine = SglangEngine([url], retry=NO_WAIT, layers=LAYERS, top_k=TOP_K)
        with pytest.raises(EngineError, match="HTTP 400"):
            await engine.generate(GenerationRequest([1], 16))
        assert len(app.state.requests) == 1
        await engine.aclose()


async def test_weight_update_pauses_loads_and_continues():
    apps = [make_sglang(echo_policy), make_sglang(echo_policy)]
    with serve(apps[0]) as a, serve(apps[1]) as b:
        engine = SglangEngine([a, b], layers=LAYERS, top_k=TOP_K)
        await engine.update_weights("/ckpt/run/v4", 4)
        assert engine.weight_version == 4
        for app in apps:
            assert [c[0] for c in app.state.control] == [
                "pause_generation",
                "update_weights_from_disk",
                "continue_generation",
            ]
            assert app.state.control[0][1] == {"mode": "retract"}
            assert app.state.control[1][1] == {
                "model_path": "/ckpt/run/v4",
                "weight_version": "4",
                "flush_cache": True,
            }
        r = await engine.generate(GenerationRequest([1], 4))
        assert r.weight_version == 4
        with pytest.raises(EngineError, match="refused the weights at /ckpt/missing: HTTP 400"):
            await engine.update_weights("/ckpt/missing", 5)
        assert apps[0].state.control[-1][0] == "continue_generation"  # never left paused
        assert engine.weight_version == 4
        # SGLang reports failure when the cache flush after a load is refused, but samples with the
        # new weights while /model_info names the old ones: the engine lifts its pause (the requests
        # it holds must finish), flushes once the server is idle and names the version, instead of
        # believing in the old one
        await engine.update_weights("/ckpt/busy/v6", 6)
        assert engine.weight_version == 6 and (await engine.model_info())["weight_version"] == "6"
        for app in apps:
            assert [c[0] for c in app.state.control[-4:]] == [
                "update_weights_from_disk",
                "continue_generation",
                "flush_cache",
                "update_weight_version",
            ]
            assert app.state.control[-2][1]["timeout"] > 0  # it waits for the running requests
            assert app.state.control[-1][1] == {"new_version": "6", "abort_all_requests": False}
        # a flush refused again: the weights are in but the cache is stale, which is an error
        with pytest.raises(EngineError, match="loaded the weights at /ckpt/stuck/v7 but its cache could not"):
            await engine.update_weights("/ckpt/stuck/v7", 7)
        assert engine.weight_version == 6 and not apps[0].state.paused  # never left paused
        await engine.aclose()


@pytest.mark.parametrize("legacy", [False, True])
async def test_model_info_falls_back_to_the_deprecated_route(legacy):
    app = make_sglang(echo_policy, version=2, legacy=legacy)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        info = await engine.model_info()
        await engine.aclose()
    assert info["weight_version"] == "2"


async def test_the_fake_refuses_what_sglang_refuses():
    """The fake is as strict as the server where it matters, so the tests above mean something."""
    app = make_sglang(echo_policy)
    with serve(app) as url, httpx.Client(base_url=url) as http:
        bad = {"input_ids": [1], "sampling_params": {"max_tokens": 4}}  # OpenAI's name, not SGLang's
        assert http.post("/generate", json=bad).status_code == 400
        assert http.post("/pause_generation", json={"mode": "drain"}).status_code == 400


async def test_clients_of_sglang_let_an_idle_connection_go_before_the_server_does():
    """uvicorn, SGLang's server, closes a connection idle for 5 s (SGLANG_TIMEOUT_KEEP_ALIVE), and
    httpx kept one as long: a request sent on a connection idle for just under 5 s raced the
    server's close and failed on a dead socket. The project's clients keep one for KEEP_ALIVE_S."""
    app, ports = FastAPI(), []

    @app.get("/ping")
    async def ping(request: Request) -> dict:
        ports.append(request.client.port)
        return {}

    assert KEEP_ALIVE_S < 5 - 2  # well before the server's close, whatever the scheduling
    with serve(app) as url:
        for client in (SglangEngine([url]).http, SglangScorer([url]).http):
            ports.clear()
            (await client.get(f"{url}/ping")).raise_for_status()
            await client.get(f"{url}/ping")  # while in use, the connection is kept
            await asyncio.sleep(KEEP_ALIVE_S + 0.3)
            await client.get(f"{url}/ping")
            await client.aclose()
            assert ports[0] == ports[1] != ports[2]


async def test_a_restarted_server_samples_as_the_weights_it_started_with():
    """A server restarted mid-run serves its --model-path weights and tags them "default"; the
    client labelled such turns with the version it had last loaded, so they passed the staleness
    checks as current weights until the next publication reloaded the server."""
    with serve(make_sglang(echo_policy, version="default")) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        engine.weight_version = 7  # what this client loaded into its servers before the restart
        r = await engine.generate(GenerationRequest([1, 2, 3], 16, stop_token_ids=(2,)))
        assert r.weight_version == 0
        await engine.http.aclose()


async def test_a_failed_pair_ends_the_scoring_call_s_other_requests():
    """One pair's server refused (a context too long): the other pairs' requests ran on, detached,
    holding scoring slots and the servers while the group was retried."""
    from services.upstream import UpstreamError

    scorer, ended = SglangScorer(["http://127.0.0.1:9"]), []

    async def one(url, ids, positions):
        if ids[0] == 0:
            await asyncio.sleep(0.01)
            raise UpstreamError(f"sglang {url}", "400: the context is too long")
        try:
            await asyncio.sleep(30)
        finally:
            ended.append(ids[0])

    scorer._one = one
    requests = [([i, 1, 2], np.array([1, 2])) for i in range(3)]
    with pytest.raises(UpstreamError, match="too long"):
        await asyncio.wait_for(scorer(requests, pairs=[0, 1, 1]), 10)
    assert sorted(ended) == [1, 2]  # ended before the failure was raised
    await scorer.http.aclose()
