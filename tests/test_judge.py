"""The LLM judge against a local server speaking the OpenAI chat-completions API."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from services.llm import ChatClient, LlmSettings
from services.llm.judge import GRADER_TEMPLATE, JudgeSettings, LlmJudge, parse_verdict
from services.upstream import RetryPolicy, UpstreamError
from tests.openai_fake import make_app
from tests.servers import serve

YES = "extracted_final_answer: Danube\n\nreasoning: same river.\n\ncorrect: yes\n\nconfidence: 90%"
NO = "extracted_final_answer: Rhine\n\nreasoning: different river.\n\ncorrect: no\n\nconfidence: 100"


def _judge(base: str, **kw) -> LlmJudge:
    settings = LlmSettings(
        base_url=f"{base}/v1",
        model="grader",
        api_key=SecretStr("sk-secret-123"),
        retry=RetryPolicy(max_attempts=3, base_delay_s=0.01),
        **kw,
    )
    return LlmJudge(ChatClient(settings, name="judge"))


async def test_judge_round_trip_and_prompt():
    app = make_app([YES, NO])
    with serve(app) as base:
        judge = _judge(base)
        v = await judge.judge("Which river?", r"It is \boxed{the Danube}", "Danube")
        assert v.correct and v.extracted == "Danube"
        v = await judge.judge("Which river?", "Rhine", "Danube")
        assert not v.correct and v.extracted == "Rhine"
        await judge.aclose()
    sent = app.state.requests[0]
    assert sent["body"]["model"] == "grader" and sent["body"]["temperature"] == 0.0
    prompt = sent["body"]["messages"][0]["content"]
    assert prompt == GRADER_TEMPLATE.format(
        question="Which river?", response=r"It is \boxed{the Danube}", correct_answer="Danube"
    )
    assert sent["headers"]["authorization"] == "Bearer sk-secret-123"


async def test_judge_retries_429_with_retry_after_and_5xx(caplog):
    app = make_app([("retry-after", 0), 503, YES])
    with serve(app) as base:
        judge = _judge(base)
        v = await judge.judge("q", "r", "a")
        await judge.aclose()
    assert v.correct and len(app.state.requests) == 3
    assert "sk-secret-123" not in caplog.text


async def test_judge_gives_up_cleanly_and_never_leaks_the_key(caplog):
    for script, match in (
        ([500, 500, 500], "HTTP 500 after 3 attempts"),
        (["malformed"], "malformed"),
        ([401], "HTTP 401"),
    ):
        with serve(make_app(script)) as base:
            judge = _judge(base)
            with pytest.raises(UpstreamError, match=match) as info:
                await judge.judge("q", "r", "a")
            await judge.aclose()
        assert "sk-secret-123" not in str(info.value)
    assert "sk-secret-123" not in caplog.text
    assert "sk-secret-123" not in repr(
        LlmSettings(base_url="x", model="m", api_key=SecretStr("sk-secret-123"))
    )


async def test_judge_timeout_is_an_upstream_error():
    import asyncio

    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        await asyncio.sleep(2)

    with serve(app) as base:
        judge = _judge(base, timeout_s=0.2)
        with pytest.raises(UpstreamError, match="timed out"):
            await judge.judge("q", "r", "a")
        await judge.aclose()


def test_parse_verdict_edge_cases():
    assert not parse_verdict("no verdict line").correct
    assert parse_verdict("Correct: YES").correct
    assert parse_verdict("extracted_final_answer: None\ncorrect: no").extracted is None


def test_judge_settings_from_env(monkeypatch):
    monkeypatch.setenv("PBSD_JUDGE_BASE_URL", "http://127.0.0.1:1/v1")
    monkeypatch.setenv("PBSD_JUDGE_API_KEY", "sk-from-env-789")
    s = JudgeSettings()
    assert s.enabled and s.llm().base_url == "http://127.0.0.1:1/v1"
    assert "sk-from-env-789" not in repr(s) and "sk-from-env-789" not in repr(s.llm())
