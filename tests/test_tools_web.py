"""The web backend against local servers speaking Serper's format: searches, and the retries, rate
limits and circuit breakers every upstream shares. Page reads (Jina Reader, the summariser):
test_tools_reader.py, which builds its backend with ``_backend`` here."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from pydantic import SecretStr

from agent.catalogue import GoogleSearchArgs
from services.llm import ChatClient, LlmSettings
from services.search.offline import render
from services.tools.fetch import PlainFetcher
from services.tools.gateway import ToolGateway
from services.tools.resilience import BreakerState, CircuitBreaker, RateLimiter, Upstream, UpstreamLimits
from services.tools.store import MemoryStore
from services.tools.web import JinaReader, LlmSummariser, SerperSearch, WebBackend
from services.upstream import RetryPolicy, UpstreamError
from tests.servers import serve
from tests.web_fakes import JINA_KEY, SERPER_KEY, make_serper

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.0)


class Sleeps:
    """Records the delays an upstream asks to wait instead of waiting them."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def _backend(http, serper_base, *, jina_base=None, summariser_base=None, site=None, sleeps=None, limits=None):
    sleeps = sleeps or Sleeps()
    limits = limits or UpstreamLimits(retry=FAST)
    serper = SerperSearch(
        http,
        Upstream("serper", limits, sleep=sleeps),
        base_url=serper_base,
        api_key=SecretStr(SERPER_KEY),
        blocked_hosts=("huggingface.co/datasets", "huggingface.co/spaces"),
    )
    jina = (
        JinaReader(
            http, Upstream("jina", limits, sleep=sleeps), base_url=jina_base, api_key=SecretStr(JINA_KEY)
        )
        if jina_base
        else None
    )
    summariser = None
    if summariser_base:
        llm = LlmSettings(f"{summariser_base}/v1", "summariser", SecretStr("sk-sum-secret"), retry=FAST)
        summariser = LlmSummariser(ChatClient(llm, http=http, name="summariser"), max_content_chars=10_000)
    # example.org cannot be resolved without a network: exempt it, as an operator would an internal source
    allow = ("example.org:443", *((site.removeprefix("http://"),) if site else ()))
    return WebBackend(serper, jina, PlainFetcher(allow=allow, timeout_s=5), summariser)


@pytest.mark.parametrize(("max_num", "sent", "credits"), [(10, 10, 1), (100, 50, 2)])
async def test_a_search_asks_serper_for_at_most_max_num_results_and_counts_its_credits(
    max_num, sent, credits
):
    """num > 10 is billed two credits a query, and Google serves at most 10 a page: the agent's
    num: 50 goes out as 10 unless the operator raises the cap; the reply's credits are counted."""
    from prometheus_client import REGISTRY

    def spent() -> float:
        return REGISTRY.get_sample_value("pbsd_tools_serper_credits_total") or 0.0

    app = make_serper()
    with serve(app) as base:
        async with httpx.AsyncClient() as http:
            searcher = SerperSearch(
                http,
                Upstream("serper", UpstreamLimits(retry=FAST)),
                base_url=base,
                api_key=SecretStr(SERPER_KEY),
            )
            searcher.max_num = max_num
            before = spent()
            await searcher.search(GoogleSearchArgs(q="danube", num=50))
            await searcher.search(GoogleSearchArgs(q="danube", num=3))
    assert [r["body"]["num"] for r in app.state.requests] == [sent, 3]
    assert spent() - before == credits + 1


async def test_serper_search_keeps_results_drops_leaks_and_sends_the_key():
    app = make_serper()
    with serve(app) as base:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, base)
            out = await backend.search(GoogleSearchArgs(q="danube length", num=5))
    links = [r["link"] for r in out["organic"]]
    assert links == ["https://en.wikipedia.org/wiki/Danube", "https://www.britannica.com/place/Danube-River"]
    assert [r["position"] for r in out["organic"]] == [1, 2]
    assert out["organic"][1]["date"] == "Oct 1, 2025"
    assert out["answerBox"]["answer"] == "2,850 km" and out["knowledgeGraph"]["type"] == "River"
    # a box quoting a dataset page leaks as much as the page itself
    leaky = {"organic": [], "answerBox": {"answer": "x", "link": "https://huggingface.co/datasets/a/b"}}
    backend.searcher.http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json=leaky))
    )
    assert "answerBox" not in await backend.search(GoogleSearchArgs(q="q"))
    await backend.searcher.http.aclose()
    # nested, and spelt with a port: only the top level's values were looked at, as written
    leaky["answerBox"] = {"answer": "x", "sources": [{"link": "https://huggingface.co:443/datasets/a"}]}
    leaky["organic"] = [{"title": "t", "link": "https://huggingface.co./datasets/a"}]
    backend.searcher.http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json=leaky))
    )
    assert await backend.search(GoogleSearchArgs(q="q")) == {"organic": []}
    await backend.searcher.http.aclose()
    sent = app.state.requests[0]
    assert sent["headers"]["x-api-key"] == SERPER_KEY
    assert sent["body"] == {
        "q": "danube length",
        "gl": "us",
        "hl": "en",
        "num": 5,
        "page": 1,
        "autocorrect": True,
    }


async def test_retry_after_is_honoured_and_5xx_retried():
    app = make_serper([("retry-after", 7), 503])
    sleeps = Sleeps()
    with serve(app) as base:
        async with httpx.AsyncClient() as http:
            out = await _backend(http, base, sleeps=sleeps).search(GoogleSearchArgs(q="x"))
    assert out["organic"] and len(app.state.requests) == 3
    assert sleeps.delays[0] == 7.0  # the upstream's Retry-After, not our own backoff
    assert len(sleeps.delays) == 2


@pytest.mark.parametrize(
    ("script", "message"), [([500, 500, 500], "HTTP 500 after 3 attempts"), (["malformed"], "malformed")]
)
async def test_failures_become_tool_results(script, message, caplog):
    caplog.set_level(logging.DEBUG)
    with serve(make_serper(script)) as base:
        async with httpx.AsyncClient() as http:
            gateway = ToolGateway(_backend(http, base), MemoryStore())
            out = await gateway.call("search_and_scrape_webpage", "google_search", {"q": "x"})
    assert not out.ok and out.text.startswith(
        "Tool call to google_search on search_and_scrape_webpage failed. Error:"
    )
    assert message in out.text
    assert SERPER_KEY not in caplog.text and SERPER_KEY not in out.text


async def test_timeouts_become_tool_results():
    with serve(make_serper(["slow", "slow", "slow"])) as base:
        async with httpx.AsyncClient(timeout=0.3) as http:
            gateway = ToolGateway(_backend(http, base), MemoryStore())
            out = await gateway.call("search_and_scrape_webpage", "google_search", {"q": "x"})
    assert not out.ok and "timed out after 3 attempts" in out.text


async def test_breaker_opens_fails_fast_then_closes():
    now = [0.0]
    limits = UpstreamLimits(failure_threshold=2, reset_after_s=30, retry=RetryPolicy(max_attempts=1))
    app = make_serper([500, 500])
    with serve(app) as base:
        async with httpx.AsyncClient() as http:
            upstream = Upstream("serper", limits, clock=lambda: now[0])
            serper = SerperSearch(http, upstream, base_url=base, api_key=SecretStr(SERPER_KEY))
            for _ in range(2):
                with pytest.raises(UpstreamError, match="HTTP 500"):
                    await serper.search(GoogleSearchArgs(q="x"))
            assert upstream.breaker.state is BreakerState.OPEN
            with pytest.raises(UpstreamError, match="circuit open"):
                await serper.search(GoogleSearchArgs(q="x"))
            assert len(app.state.requests) == 2  # failing fast: the upstream was not asked
            now[0] = 31.0
            assert upstream.breaker.state is BreakerState.HALF_OPEN
            assert (await serper.search(GoogleSearchArgs(q="x")))["organic"]  # the trial succeeds
            assert upstream.breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize(
    ("status", "message", "opens"),
    [
        (403, "Unauthorized.", True),
        (402, "Unauthorized.", True),
        (400, "Not enough credits", True),  # Serper's empty balance, a 400 by status
        (400, "Query too long", False),
        (404, "Unauthorized.", False),
    ],
)
async def test_a_refused_key_opens_the_breaker_a_bad_request_does_not(status, message, opens):
    """Serper's 403 {"message": "Unauthorized."}, its 400 {"message": "Not enough credits"} or
    Jina's 402 fail every request that follows; another 400 or a 404 is the request's own fault.
    The upstream's words reach the error."""
    limits = UpstreamLimits(failure_threshold=2, reset_after_s=30, retry=RetryPolicy(max_attempts=1))
    body = {"message": message, "statusCode": status}
    transport = httpx.MockTransport(lambda r: httpx.Response(status, json=body))
    async with httpx.AsyncClient(transport=transport) as http:
        upstream = Upstream("serper", limits)
        serper = SerperSearch(http, upstream, base_url="https://serper.test/search", api_key=SecretStr("k"))
        for _ in range(2):
            with pytest.raises(UpstreamError, match=f"HTTP {status}: .*{message}"):
                await serper.search(GoogleSearchArgs(q="x"))
    assert (upstream.breaker.state is BreakerState.OPEN) == opens


def test_the_jina_rate_keeps_under_jinas_published_limit_for_the_key():
    """Jina's Reader takes 500 requests a minute with a key and 20 without; the default rate keeps
    under whichever applies, and a rate set by hand (None: no limit) is kept."""
    from services.tools.settings import ToolsSettings

    web = {"backend": "web", "serper_api_key": "s"}
    assert ToolsSettings(**web, jina_api_key="j").jina_rate_per_s * 60 < 500
    assert ToolsSettings(**web).jina_rate_per_s * 60 < 20
    assert ToolsSettings(**web, jina_rate_per_s=None).jina_rate_per_s is None
    assert ToolsSettings(**web, jina_rate_per_s=30.0).jina_rate_per_s == 30.0


def test_breaker_failed_trial_reopens():
    now = [0.0]
    b = CircuitBreaker("t", failure_threshold=1, reset_after_s=10, clock=lambda: now[0])
    b.failure()
    assert b.state is BreakerState.OPEN
    now[0] = 10
    b.before()  # the half-open trial
    with pytest.raises(UpstreamError):
        b.before()  # only one trial at a time
    b.failure()
    assert b.state is BreakerState.OPEN


async def test_rate_limiter_spaces_calls():
    now = [0.0]
    limiter = RateLimiter(2.0, burst=2, clock=lambda: now[0])
    waited = []

    async def fake_sleep(s):
        waited.append(s)
        now[0] += s

    import services.tools.resilience as r

    original = r.asyncio.sleep
    r.asyncio.sleep = fake_sleep
    try:
        for _ in range(4):
            await limiter.acquire()
    finally:
        r.asyncio.sleep = original
    assert waited == [0.5, 0.5]  # two from the burst, then one every 1/rate seconds


def test_render_is_the_agent_text():
    assert json.loads(render({"organic": []})) == {"organic": []}
