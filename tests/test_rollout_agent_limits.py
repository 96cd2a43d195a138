"""The agent loop's limits and labels against the SGLang fake: what a cut message earns, how old
a trajectory is, which limit ended it, a call no turn is left to read, each turn's seed."""

from __future__ import annotations

import pytest

from agent.chat import ChatTokenizer
from agent.prompt import user_prompt
from agent.toolcall import format_tool_call
from services.rollout.agent import AgentLimits
from services.rollout.sglang import SglangEngine
from tests.servers import serve
from tests.sglang_fake import LAYERS, TOP_K, make_sglang
from tests.test_rollout_agent import SEARCH, SYSTEM, FixedTools, _run, scripted


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


CALL = "Searching.\n" + format_tool_call(*SEARCH, {"q": "x"})


async def _scripted_run(tok, turns, *, script=None, version=0, context_len=1 << 20, **kw):
    """One trajectory against the SGLang fake writing ``turns``; (trajectory, the fake's requests)."""
    app = make_sglang(scripted(tok, turns), script=script, version=version, context_len=context_len)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        try:
            return await _run(engine, kw.pop("tools", FixedTools()), tok, **kw), app.state.requests
        finally:
            await engine.aclose()


async def test_a_message_cut_at_its_token_budget_earns_nothing_though_it_boxed_the_answer(tok):
    """Only a message the model ended itself is an answer: one the budget cut is not, whatever
    its text holds by then."""
    box = len(tok.encode("\\boxed{Danube}"))
    t, _ = await _scripted_run(
        tok, ["\\boxed{Danube} but wait, " * 20], limits=AgentLimits(max_tokens_per_turn=box + 3)
    )
    assert "\\boxed{Danube}" in tok.decode(t.completion_ids.tolist())
    assert (t.finish_reason, t.reward, t.final_answer) == ("max_tokens", 0.0, None)


async def test_a_trajectory_is_as_old_as_its_oldest_turn(tok):
    """Its first turn sampled with version 3 and its last with 4: it is a version-3 sample, or a
    stale trajectory would pass the trainer's staleness check."""
    t, requests = await _scripted_run(tok, [CALL, "\\boxed{Danube}"], script=["ok", "reload"], version=3)
    assert len(requests) == 2 and t.finish_reason == "answer" and t.reward == 1.0
    assert t.policy_version == 3


async def test_a_turn_the_servers_context_cut_ends_the_trajectory_as_full(tok):
    """The server's context is shorter than the run's: the engine asks it for what fits, and a turn
    that ends at that length is max_context, not max_tokens, though the run's own budget for the
    turn was whole."""
    prompt = len(tok.prompt_ids(SYSTEM, user_prompt("Which river flows through Vienna?")))
    t, _ = await _scripted_run(
        tok,
        ["word " * 200],
        context_len=prompt + 40,
        limits=AgentLimits(max_tokens_per_turn=100, max_context=prompt + 5000),
    )
    assert t.finish_reason == "max_context" and t.error is None
    assert t.turn_spans[0][1] - t.turn_spans[0][0] < 100


async def test_a_call_on_the_last_turn_is_not_run(tok):
    """No turn is left to read its result: the call would spend the gateway's budget, and glue no
    model wrote would end the trajectory."""
    tools = FixedTools()
    t, _ = await _scripted_run(tok, [CALL], tools=tools, limits=AgentLimits(max_turns=1))
    assert t.finish_reason == "max_turns" and tools.calls == [] and t.tool_calls == ()
    assert t.loss_mask.tolist() == [1] * len(t.completion_ids)


async def test_each_turn_samples_with_a_seed_of_its_own(tok):
    _, requests = await _scripted_run(tok, [CALL, "\\boxed{Danube}"], seed=7)
    assert [r["sampling_params"]["sampling_seed"] for r in requests] == [7000, 7001]
