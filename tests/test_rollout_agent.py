"""The agent loop: token exactness, masks and spans, tool calls, every stop reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from agent.catalogue import catalogue
from agent.chat import ChatTokenizer
from agent.prompt import system_prompt, user_prompt
from agent.toolcall import format_tool_call
from agent.transcript import turn_texts
from services.rollout.agent import AgentLimits, run_trajectory
from services.rollout.sglang import SglangEngine
from services.tools.client import GatewayClient, LocalTools
from tests.servers import serve
from tests.sglang_fake import LAYERS, TOP_K, make_sglang, routes_for

SEARCH = ("search_and_scrape_webpage", "google_search")


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return ChatTokenizer.from_pretrained(tiny_checkpoint)


def scripted(tok: ChatTokenizer, turns: list[str], *, close: bool = True):
    """A policy that writes ``turns[i]`` as its i-th assistant message (then <|im_end|>)."""
    opening = tok.encode("<|im_start|>assistant\n")

    def policy(ids: list[int]) -> list[int]:
        n = sum(ids[i : i + len(opening)] == opening for i in range(len(ids) - len(opening) + 1))
        text = turns[min(n - 1, len(turns) - 1)]
        return tok.encode(text) + ([tok.end_id] if close else [])

    return policy


class FixedTools:
    """Tools answering from a dict (a stand-in for the gateway where only the loop is under test)."""

    def __init__(self, answers: dict[str, str] | None = None) -> None:
        self.answers = answers or {}
        self.calls = []

    async def catalogue(self):
        return catalogue()

    async def call(self, server, tool, args, *, trajectory_id=None, call_index=None):
        from services.tools.client import ToolReply

        self.calls.append((server, tool, args, trajectory_id, call_index))
        return ToolReply(True, self.answers.get(args.get("q", ""), json.dumps({"organic": []})))

    async def aclose(self):
        return None


SYSTEM = system_prompt(catalogue(), "2025-06-01")


async def _run(engine, tools, tok, **kw):
    args = dict(
        system=SYSTEM,
        question=user_prompt("Which river flows through Vienna?"),
        answer="Danube",
        aliases=("Donau",),
        trajectory_id="t/0",
        sample_index=0,
        limits=AgentLimits(),
    )
    args.update(kw)
    return await run_trajectory(engine, tools, tok, **args)


async def test_token_exact_conversation_masks_and_spans(tok, tiny_checkpoint):
    turns = [
        "I should search.\n\n" + format_tool_call(*SEARCH, {"q": "Vienna river"}),
        "The result says Danube.\n\n\\boxed{Danube}",
    ]
    app = make_sglang(scripted(tok, turns))
    tools = FixedTools(
        {"Vienna river": '{"organic": [{"title": "Vienna", "snippet": "The Danube flows through Vienna."}]}'}
    )
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, tools, tok)
        await engine.aclose()
    assert t.finish_reason == "answer" and t.reward == 1.0 and t.final_answer == "Danube" and t.error is None
    assert t.num_turns == 2 and [c[:3] for c in tools.calls] == [(*SEARCH, {"q": "Vienna river"})]
    assert tools.calls[0][3].startswith("t/0#")  # the budget's id: the trajectory's, and this attempt's

    # the viewer and the evaluation read it back as text, turn by turn
    assert turn_texts(t.completion_ids, t.turn_spans, tok) == [
        (turns[0], tools.answers["Vienna river"]),
        (turns[1], ""),
    ]

    # decode(ids) is the conversation, exactly as the chat template renders it
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user_prompt("Which river flows through Vienna?")},
        {"role": "assistant", "content": turns[0]},
        {"role": "user", "content": tools.answers["Vienna river"]},
        {"role": "assistant", "content": turns[1]},
    ]
    hf = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = list(t.prompt_ids) + list(t.completion_ids)
    assert tok.decode(ids) == hf.apply_chat_template(messages, tokenize=False).rstrip("\n")

    # the ids are the engine's outputs and the glue, appended: never a re-tokenisation
    gen1 = tok.encode(turns[0]) + [tok.end_id]
    gen2 = tok.encode(turns[1]) + [tok.end_id]
    glue = tok.glue_ids(tools.answers["Vienna river"], closed=True)
    assert list(t.prompt_ids) == tok.prompt_ids(SYSTEM, user_prompt("Which river flows through Vienna?"))
    assert list(t.completion_ids) == gen1 + glue + gen2
    assert t.turn_spans == ((0, len(gen1)), (len(gen1) + len(glue), len(gen1) + len(glue) + len(gen2)))
    assert list(t.loss_mask) == [1] * len(gen1) + [0] * len(glue) + [1] * len(gen2)
    assert np.all(t.rollout_logprobs[t.loss_mask == 1] == -0.5) and np.all(
        t.rollout_logprobs[t.loss_mask == 0] == 0
    )
    # the second request was the first request's ids plus the output plus the glue
    first, second = app.state.requests
    assert second["input_ids"] == first["input_ids"] + gen1 + glue
    assert second["sampling_params"]["stop_token_ids"] == tok.stop_ids
    assert first["sampling_params"]["skip_special_tokens"] is False and first["return_logprob"] is True


async def test_routed_experts_cover_every_position_but_the_last(tok):
    turns = ["search\n" + format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    app = make_sglang(scripted(tok, turns))
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, FixedTools(), tok, limits=AgentLimits(return_routed_experts=True))
        await engine.aclose()
    n = t.num_tokens
    assert t.routed_experts.shape == (n - 1, LAYERS, TOP_K) and t.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(t.routed_experts, routes_for(range(n - 1)))
    # each turn asked only for the positions it had not recorded yet
    assert [r["routed_experts_start_len"] for r in app.state.requests] == [
        0,
        len(t.prompt_ids) + t.turn_spans[0][1] - 1,
    ]


async def test_malformed_and_repaired_calls(tok):
    turns = [
        "<use_mcp_tool>\n<server_name>search_and_scrape_webpage</server_name>\n<tool_name>google_search</tool_name>\n"
        '<arguments>\n{"q": "Vienna river\n</arguments>\n</use_mcp_tool>',  # missing quote and brace: repaired
        "<use_mcp_tool><tool_name>x</tool_name></use_mcp_tool>",  # unusable: reported back
        "<use_mcp_tool>\n<server_name>search_and_scrape_webpage</server_name>\n<tool_name>google_search</tool_name>\n"
        '<arguments>\n["Vienna"]\n</arguments>\n</use_mcp_tool>',  # unusable arguments of a named tool
        format_tool_call(*SEARCH, {"q": "Danube"}),
        "\\boxed{Danube}",
    ]
    app = make_sglang(scripted(tok, turns))
    tools = FixedTools()
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, tools, tok)
        await engine.aclose()
    assert t.finish_reason == "answer" and t.reward == 1.0
    assert tools.calls[0][2] == {"q": "Vienna river"}
    assert len(tools.calls) == 2  # the malformed calls never reached the tools
    # nor hold a place in the gateway's budget: the search after them is the second sent
    assert [c.sent for c in t.tool_calls] == [True, False, False, True]
    assert [c[4] for c in tools.calls] == [0, 1]
    assert not t.tool_calls[1].ok and "malformed" in t.tool_calls[1].error
    assert "failed. Error: the <use_mcp_tool> block is malformed" in tok.decode(t.completion_ids)
    assert (t.tool_calls[2].server_name, t.tool_calls[2].tool_name) == SEARCH and not t.tool_calls[2].ok
    assert "Tool call to google_search on search_and_scrape_webpage failed. Error: arguments must be" in (
        tok.decode(t.completion_ids)
    )


async def test_every_call_of_a_message_runs_and_one_message_answers_them(tok):
    """MiroFlow runs every call a message makes, in order, and joins their results with a newline
    into the next user message; calls past the agent's cap fail unrun, and say so."""
    two = format_tool_call(*SEARCH, {"q": "Vienna river"}) + "\n" + format_tool_call(*SEARCH, {"q": "Danube"})
    three = "\n".join(format_tool_call(*SEARCH, {"q": q}) for q in ("a", "b", "c"))
    turns = ["Two searches.\n\n" + two, three, "\\boxed{Danube}"]
    tools = FixedTools({"Vienna river": "RESULT-ONE", "Danube": "RESULT-TWO", "a": "A", "b": "B"})
    with serve(make_sglang(scripted(tok, turns))) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, tools, tok, limits=AgentLimits(max_calls_per_turn=2))
        await engine.aclose()
    assert t.finish_reason == "answer" and t.reward == 1.0
    assert [c[2]["q"] for c in tools.calls] == ["Vienna river", "Danube", "a", "b"]  # "c" never ran
    assert [c[4] for c in tools.calls] == [0, 1, 2, 3]  # each call's place: the gateway's budget
    assert [(c.turn, c.arguments["q"], c.ok) for c in t.tool_calls] == [
        (0, "Vienna river", True),
        (0, "Danube", True),
        (1, "a", True),
        (1, "b", True),
        (1, "c", False),
    ]
    assert "at most 2 tool calls" in t.tool_calls[-1].error
    text = tok.decode(t.completion_ids)
    assert "RESULT-ONE\nRESULT-TWO" in text  # one user message answers both calls
    assert "A\nB\nTool call to google_search on search_and_scrape_webpage failed. Error: one message" in text
    assert len(t.turn_spans) == 3


async def test_each_attempt_of_a_trajectory_gets_a_whole_call_budget(tok, tiny_world):
    """Trajectory ids repeat (a prompt delivered again after a worker died, two evaluations of the
    same questions), and the gateway counts calls by the id the agent sends: each attempt sends its
    own, so a second attempt is not refused calls the first one spent."""
    tools = LocalTools.offline(tiny_world / "corpus.jsonl")
    tools.gateway.call_budget = 2
    turns = [
        format_tool_call(*SEARCH, {"q": "city"}),
        format_tool_call(*SEARCH, {"q": "river"}),
        "\\boxed{Danube}",
    ]
    with serve(make_sglang(scripted(tok, turns))) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        first, second = [await _run(engine, tools, tok, trajectory_id="run:7/0") for _ in range(2)]
        await engine.aclose()
    for t in (first, second):
        assert [c.ok for c in t.tool_calls] == [True, True] and t.reward == 1.0


async def test_a_tool_result_with_a_lone_surrogate_is_carried_as_text(tok):
    """A page's JSON may spell a lone surrogate; the tokenizer and the bus take only text."""
    from proto.base import encode

    turns = [format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    with serve(make_sglang(scripted(tok, turns))) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, FixedTools({"x": "before \ud800 after"}), tok)
        await engine.aclose()
    assert t.error is None and t.reward == 1.0
    assert "before \ufffd" in tok.decode(t.completion_ids) and encode(t)


@pytest.mark.parametrize(
    ("limits", "close", "finish"),
    [
        (AgentLimits(max_turns=2), True, "max_turns"),
        (AgentLimits(max_tokens_per_turn=5), False, "max_tokens"),
        (AgentLimits(max_context=150), True, "max_context"),  # 150 tokens beyond the prompt
    ],
)
async def test_limits_stop_the_loop(tok, limits, close, finish):
    turn = "Searching again.\n" + format_tool_call(*SEARCH, {"q": "x"})
    if finish == "max_context":
        prompt = len(tok.prompt_ids(SYSTEM, user_prompt("Which river flows through Vienna?")))
        limits = AgentLimits(max_context=prompt + limits.max_context)
    app = make_sglang(scripted(tok, [turn], close=close))
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, FixedTools(), tok, limits=limits)
        await engine.aclose()
    assert t.finish_reason == finish and t.reward == 0.0 and t.error is None
    assert t.num_tokens <= limits.max_context
    if finish == "max_turns":
        assert t.num_turns == 2
    if finish == "max_tokens":
        assert t.num_turns == 1 and t.turn_spans[0][1] - t.turn_spans[0][0] == 5


async def test_a_server_whose_context_is_shorter_than_the_runs_ends_the_trajectory_as_full(tok, caplog):
    """SGLang refuses (400) a request whose input plus max_new_tokens is past its context length,
    which is the model config's unless the server was started with --context-length. A run whose
    max_context is longer: each long trajectory failed as an error, and errors are left out of
    training, so every long trajectory was. It ends as at the run's own limit now, trained on, and
    says why."""
    from services.rollout import metrics

    turn = "Searching again.\n" + format_tool_call(*SEARCH, {"q": "x"})
    prompt = len(tok.prompt_ids(SYSTEM, user_prompt("Which river flows through Vienna?")))
    before = metrics.CONTEXT_FULL._value.get()
    app = make_sglang(scripted(tok, [turn]), context_len=prompt + 300)
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, FixedTools(), tok, limits=AgentLimits(max_context=prompt + 5000))
        await engine.aclose()
    assert t.finish_reason == "max_context" and t.error is None and t.reward == 0.0
    assert t.num_turns >= 1 and t.num_tokens <= prompt + 300
    assert metrics.CONTEXT_FULL._value.get() == before + 1
    assert f"its context is {prompt + 300} tokens, shorter than the run's requests need" in caplog.text


async def test_a_server_that_says_its_context_is_asked_for_what_fits(tok):
    """Either refusal of SGLang 0.5.23 names the server's context length: the engine asks that server
    again for what fits, asks it for no more afterwards, and says so on the result; a request whose
    input fills it is ContextFull; any other 400 is an error. A weight update forgets what it learnt
    (a server restarted with a longer --context-length gets the whole budget again)."""
    from services.rollout.engine import ContextFull, EngineError, GenerationRequest

    app = make_sglang(scripted(tok, ["x"]), context_len=100, script=["ok"] * 4 + [400])
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        first = await engine.generate(GenerationRequest(input_ids=[5] * 60, max_new_tokens=41))
        assert first.context_limited and first.output_ids
        fits = await engine.generate(GenerationRequest(input_ids=[5] * 60, max_new_tokens=40))
        assert not fits.context_limited
        with pytest.raises(ContextFull) as full:  # asked for nothing: the input fills the context
            await engine.generate(GenerationRequest(input_ids=[5] * 100, max_new_tokens=1))
        assert full.value.limit == 100
        asked = [r["sampling_params"]["max_new_tokens"] for r in app.state.requests]
        assert asked == [41, 40, 40]  # refused once, then within the context
        other = GenerationRequest(input_ids=[5] * 10, max_new_tokens=1)
        await engine.generate(other)
        with pytest.raises(EngineError) as refused:
            await engine.generate(other)  # the scripted 400, which is not about the context
        assert not isinstance(refused.value, ContextFull)
        await engine.update_weights("/models/v1", 1)
        assert engine._context == {}
        await engine.aclose()


async def test_no_tool_call_without_answer_ends_with_zero_reward(tok):
    app = make_sglang(scripted(tok, ["I give up."]))
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, FixedTools(), tok)
        await engine.aclose()
    assert t.finish_reason == "answer" and t.final_answer is None and t.reward == 0.0


async def test_engine_failures_are_kept_with_their_cause(tok):
    turns = ["search\n" + format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    from services.upstream import RetryPolicy

    for script, cause in (
        (["ok", "abort"], "engine aborted the request"),
        ([503, 503, 503], "engine failed"),
    ):
        app = make_sglang(scripted(tok, turns), script=script)
        with serve(app) as url:
            engine = SglangEngine(
                [url], layers=LAYERS, top_k=TOP_K, retry=RetryPolicy(max_attempts=3, base_delay_s=0)
            )
            t = await _run(engine, FixedTools(), tok)
            await engine.aclose()
        assert t.finish_reason == "error" and cause in t.error and t.reward == 0.0


async def test_an_engine_that_raises_something_else_fails_the_sample_not_the_group(tok):
    """An in-process engine passes a batch's torch error to every request in it: each sample
    ends as an error with the cause, as an EngineError would, instead of failing the prompt."""

    class Broken:
        weight_version = 0

        async def generate(self, request):
            raise RuntimeError("CUDA error: device-side assert triggered")

    t = await _run(Broken(), FixedTools(), tok)
    assert t.finish_reason == "error" and "RuntimeError: CUDA error" in t.error and t.reward == 0.0


async def test_gateway_down_is_an_error_with_its_cause(tok):
    turns = ["search\n" + format_tool_call(*SEARCH, {"q": "x"}), "\\boxed{Danube}"]
    with serve(make_sglang(scripted(tok, turns))) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        tools = GatewayClient("http://127.0.0.1:9", timeout_s=2)
        t = await _run(engine, tools, tok)
        await tools.aclose()
        await engine.aclose()
    assert t.finish_reason == "error" and "tool gateway unreachable" in t.error
    assert t.tool_calls[-1].ok is False


async def test_a_turn_that_ends_the_text_ends_the_trajectory(tok, tmp_path):
    """Qwen3 lists <|endoftext|> beside <|im_end|> among its eos ids, and SGLang stops on either
    whatever it is asked. A turn that stops on the end of text gets no glue after it (no format
    follows an end of text): the trajectory ends there, its tool call not made."""
    from agent.chat import generation_eos_ids

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.end_id, 0]}))
    assert generation_eos_ids(tmp_path) == (tok.end_id, 0) and generation_eos_ids(tmp_path / "none") == ()
    qwen_like = ChatTokenizer(tok.tok, eos_ids=generation_eos_ids(tmp_path))
    assert 0 in qwen_like.stop_ids and qwen_like.decode([0], skip_special_tokens=False) == "<|endoftext|>"
    call = format_tool_call(*SEARCH, {"q": "Vienna river"})
    app = make_sglang(lambda ids: tok.encode(call) + [0])
    tools = FixedTools()
    with serve(app) as url:
        engine = SglangEngine([url], layers=LAYERS, top_k=TOP_K)
        t = await _run(engine, tools, qwen_like)
        await engine.aclose()
    assert app.state.requests[0]["sampling_params"]["stop_token_ids"] == qwen_like.stop_ids
    assert t.finish_reason == "answer" and len(t.turn_spans) == 1 and tools.calls == [] and t.reward == 0.0
    assert t.completion_ids[-1] == 0  # the end of text, as sampled, with nothing glued after it


def test_routes_are_narrowed_to_the_smallest_type_that_holds_them():
    """SGLang sends int32; a worker holds the routes of every trajectory it runs until each ends."""
    from services.rollout.agent import _narrow

    sent = np.arange(2 * 48 * 8, dtype=np.int32).reshape(2, 48, 8) % 128
    assert _narrow(sent).dtype == np.uint8 and np.array_equal(_narrow(sent), sent)
    assert _narrow(sent + 200).dtype == np.int16  # more than 256 experts
    assert _narrow(sent - 1).dtype == np.int16  # a -1 (no expert) is kept, not wrapped to 255


def test_the_builders_token_columns_are_not_walked_by_the_garbage_collector():
    """A worker holds hundreds of thousands of tokens in flight, and a full collection walks every
    entry of a list (7-10 ms for a paper-scale group, benchmarks/gc_pause.py): the columns are
    arrays, whose entries the collector does not visit, and give the trajectory the same numbers."""
    import gc

    from services.rollout.agent import _Builder

    b = _Builder([1, 2, 3])
    b.generated([5, 150_000], [-0.5, -0.25])
    b.glue([7])
    assert all(
        len(gc.get_referents(column)) <= 1 for column in (b.completion, b.mask, b.logprobs)
    )  # its type
    assert (b.completion.tolist(), b.mask.tolist(), b.logprobs.tolist()) == (
        [5, 150_000, 7],
        [1, 1, 0],
        [-0.5, -0.25, 0.0],
    )
    assert b.length == 6 and b.spans == [(0, 2)]
