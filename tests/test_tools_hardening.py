"""The attacks of the fault-injection battery (issue #25) against the tool gateway, kept as tests:
hostile pages through the page reader, NaN and oversized bodies through ``/call``. Every target
is a server on loopback that the test starts itself."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import REGISTRY
from pydantic import SecretStr

from agent.catalogue import ScrapeArgs
from services.http_guard import MAX_ERRORS
from services.tools.app import create_app
from services.tools.fetch import FetchError, PlainFetcher
from services.tools.html_text import html_to_text
from services.tools.resilience import BreakerState, Upstream, UpstreamLimits
from services.tools.settings import ToolsSettings
from services.tools.web import SerperSearch, WebBackend
from services.upstream import RetryPolicy, UpstreamError
from tests.servers import serve
from tests.web_fakes import make_site
from worldgen.build import build_world

READ = {"server_name": "jina_scrape_llm_summary", "tool_name": "scrape_and_extract_info"}
SEARCH = {"server_name": "search_and_scrape_webpage", "tool_name": "google_search"}


@pytest.fixture(scope="module")
def site():
    with serve(make_site()) as base:
        yield base


def _reader(site: str) -> WebBackend:
    """The web backend with no Jina, so every page goes through the plain fetcher (the fallback
    the battery attacked); only the test site's address is exempt from the SSRF rules."""
    http = httpx.AsyncClient()
    serper = SerperSearch(http, Upstream("serper"), base_url="http://127.0.0.1:9", api_key=SecretStr("k"))
    fetcher = PlainFetcher(allow=(site.removeprefix("http://"),), timeout_s=30)
    return WebBackend(serper, None, fetcher, None)


def _counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.timeout(60)  # a hang guard: the standard library's parser takes hours on this page
async def test_a_page_built_to_make_parsing_quadratic_is_read_in_one_pass(site):
    reader = _reader(site)
    result = await reader.read(ScrapeArgs(url=f"{site}/quadratic?n=1000000", info_to_extract="before"))
    await reader.aclose()
    assert result["success"] and "before" in result["extracted_info"]["evidence"]


@pytest.mark.parametrize(
    "document",
    [
        "<a" * 100_000,
        "<!--" * 50_000,
        "</" * 100_000,
        "<![ x" * 40_000,
        "<script>" * 25_000,
        "<a x='>" * 30_000,
    ],
)
@pytest.mark.timeout(60)
def test_html_to_text_survives_unterminated_markup_of_every_kind(document):
    title, text = html_to_text("<title>T</title><p>kept</p>" + document)
    assert title == "T" and text.startswith("kept")


def test_html_to_text_reads_what_a_browser_shows():
    page = (
        "<!DOCTYPE html><html><head><title>Vie&amp;nna</title><style>p{}</style></head><body>"
        "<nav>menu</nav><h1>Vienna</h1><p>The Danube &lt;flows&gt; through Vienna.</p>"
        "<script>var s = '</p><p>not text';</script><div>Second<br/>line</div><!-- hidden -->"
        "a < b <![CDATA[data]]> <p/>end<footer>links</footer></body></html>"
    )
    title, text = html_to_text(page)
    assert title == "Vie&nna"
    assert text == "Vienna\n\nThe Danube <flows> through Vienna.\n\nSecond\nline\na < b data\nend"
    assert html_to_text("<title>Vienna<p>a title left open keeps the page's text") == (
        "Vienna",
        "a title left open keeps the page's text",
    )


def test_characters_that_lengthen_when_lowered_shift_nothing():
    """ "\u0130".lower() is two characters: a page once used it to shift the search copy against the
    page, so that script showed as text and tags leaked."""
    page = "\u0130" * 6 + "<p>hello world</p><script>var secret=1</script><p>Vienna</p><SCRIPT>x=2</SCRIPT>"
    assert html_to_text(page) == ("", "\u0130" * 6 + "\nhello world\n\nVienna")


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        ("/charset/idna", "The Danube flows through Vienna."),  # each of these raised UnicodeError
        ("/charset/undefined", "The Danube flows through Vienna."),
        ("/charset/punycode", "The Danube flows through Vienna."),
        ("/charset/base64", "The Danube flows through Vienna."),  # a bytes-to-bytes codec
        ("/marked-section", "The Danube flows through Vienna."),  # AssertionError in html.parser
        ("/p\u00e4ge", "Die Isar flie\u00dft durch M\u00fcnchen."),  # a non-ASCII URL
        ("/redirect-non-ascii", "Die Isar flie\u00dft durch M\u00fcnchen."),  # a non-ASCII Location
    ],
)
async def test_pages_that_crashed_the_reader_are_read(site, path, expect):
    reader = _reader(site)
    result = await reader.read(ScrapeArgs(url=f"{site}{path}", info_to_extract="Which river?"))
    await reader.aclose()
    assert result["success"], result
    assert expect in result["extracted_info"]["evidence"]


async def test_a_corrupt_gzip_body_is_a_failed_read_with_its_cause(site):
    reader = _reader(site)
    result = await reader.read(ScrapeArgs(url=f"{site}/corrupt-gzip", info_to_extract="Which river?"))
    await reader.aclose()
    assert not result["success"] and "corrupt gzip body" in result["error"]


async def test_any_exception_in_the_fetcher_is_a_fetch_error_with_its_cause(site, monkeypatch):
    import services.tools.fetch as fetch

    def broken(body, content_type):
        raise AssertionError("a parser bug")

    monkeypatch.setattr(fetch, "_page_text", broken)
    fetcher = PlainFetcher(allow=(site.removeprefix("http://"),), timeout_s=10)
    try:
        with pytest.raises(FetchError, match="AssertionError: a parser bug"):
            await fetcher.fetch(f"{site}/page")
    finally:
        await fetcher.aclose()


async def test_a_trial_call_that_ends_without_a_verdict_does_not_hold_the_breaker_open():
    """The half-open breaker let one trial through and waited for its verdict. A trial cut off
    by the gateway's deadline (Serper's four 60 s attempts outlast its 240 s) or refused by httpx
    before it went out gave none, and the breaker refused every call after it, for good."""
    now = [0.0]
    healthy = [False]
    transport = httpx.MockTransport(
        lambda r: httpx.Response(200, json={"organic": []}) if healthy[0] else httpx.Response(503)
    )
    limits = UpstreamLimits(failure_threshold=1, reset_after_s=30, retry=RetryPolicy(max_attempts=1))
    async with httpx.AsyncClient(transport=transport) as http:
        upstream = Upstream("serper", limits, clock=lambda: now[0])

        async def hangs() -> httpx.Response:
            await asyncio.sleep(3600)
            raise AssertionError("cut off before")

        async def refused() -> httpx.Response:
            return await http.get("https://serper.test/a\x01b")

        with pytest.raises(UpstreamError, match="HTTP 503"):
            await upstream.call(lambda: http.get("https://serper.test/"))
        healthy[0] = True
        for trial, ends in ((hangs, TimeoutError), (refused, httpx.InvalidURL)):
            now[0] += 31  # half-open: the next call is the trial
            with pytest.raises(ends):
                async with asyncio.timeout(0.05):
                    await upstream.call(trial)
            assert upstream.breaker.state is BreakerState.HALF_OPEN
        assert (await upstream.call(lambda: http.get("https://serper.test/"))).status_code == 200
        assert upstream.breaker.state is BreakerState.CLOSED
        # a call that went out while the breaker was closed and is cancelled during a trial leaves
        # the trial's place alone: only one trial at a time
        early = asyncio.create_task(upstream.call(hangs))
        await asyncio.sleep(0)
        healthy[0] = False
        with pytest.raises(UpstreamError, match="HTTP 503"):
            await upstream.call(lambda: http.get("https://serper.test/"))
        now[0] += 31
        trial = asyncio.create_task(upstream.call(hangs))
        await asyncio.sleep(0)
        early.cancel()
        with pytest.raises(asyncio.CancelledError):
            await early
        with pytest.raises(UpstreamError, match="circuit open"):
            await upstream.call(lambda: http.get("https://serper.test/"))
        trial.cancel()
        with pytest.raises(asyncio.CancelledError):
            await trial


async def test_a_url_the_client_cannot_send_is_refused_as_malformed(site):
    got = await _reader(site).read(ScrapeArgs(url="https://example.com/a\x01b", info_to_extract="x"))
    assert not got["success"] and "malformed URL" in got["error"]


async def test_refused_encodings_are_counted_apart_from_ssrf_refusals(site):
    reader = _reader(site)
    ssrf, encoding = _counter("pbsd_tools_ssrf_blocked_total"), _counter("pbsd_tools_encoding_refused_total")
    refused = await reader.read(ScrapeArgs(url=f"{site}/brotli", info_to_extract="x"))
    assert not refused["success"] and "content encoding" in refused["error"]
    assert _counter("pbsd_tools_ssrf_blocked_total") == ssrf
    assert _counter("pbsd_tools_encoding_refused_total") == encoding + 1
    port = site.rsplit(":", 1)[1]
    blocked = await reader.read(ScrapeArgs(url=f"http://127.0.0.2:{port}/page", info_to_extract="x"))
    assert not blocked["success"] and "loopback" in blocked["error"]
    assert _counter("pbsd_tools_ssrf_blocked_total") == ssrf + 1
    assert _counter("pbsd_tools_encoding_refused_total") == encoding + 1
    await reader.aclose()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    world = tmp_path_factory.mktemp("hardening-world")
    build_world(world, seed=3, entities=300, n_rl=10, n_val=5, n_sft=5)
    settings = ToolsSettings(corpus=world / "corpus.jsonl", use_redis=False, max_body_bytes=4096)
    with serve(create_app(settings)) as base:
        yield base


def _post(base: str, raw: bytes | str, **headers) -> httpx.Response:
    return httpx.post(f"{base}/call", content=raw, headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize(
    "raw",
    [
        '{"server_name": NaN, "tool_name": "google_search", "arguments": {}}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": Infinity, "arguments": {}}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", "arguments": NaN}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", "arguments": {"q": NaN}}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", '
        '"arguments": {"q": "x", "num": NaN}}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", '
        '"arguments": {"q": "x", "extra": -Infinity}}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", '
        '"arguments": {"q": "x"}, "trajectory_id": NaN}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", "arguments": {}, "x": NaN}',
        '{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", "arguments": {"q": 1e999}}',
    ],
)
def test_nan_anywhere_in_a_call_is_a_4xx_that_names_the_field(gateway, raw):
    r = _post(gateway, raw)
    assert 400 <= r.status_code < 500, r.text
    detail = r.json()["detail"]  # valid JSON: nothing non-finite echoed back
    assert detail and all(d["loc"][0] == "body" and d["msg"] for d in detail)


def test_an_invalid_call_answers_in_a_bounded_size(gateway):
    """A body of unknown keys: the errors listed stop at the cap (20,000 keys in 249 KB once
    answered 2 MB)."""
    keys = {f"k{i}": 0 for i in range(300)}
    body = json.dumps({**SEARCH, "arguments": {"q": "x", **keys}})
    assert len(body) < 4096
    r = _post(gateway, body)
    assert r.status_code == 422 and len(r.json()["detail"]) == MAX_ERRORS, r.text
    assert all(d["loc"][:2] == ["body", "arguments"] for d in r.json()["detail"])


def test_malformed_json_is_a_422(gateway):
    r = _post(gateway, '{"server_name": ')
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"


def test_an_oversized_body_is_refused_before_it_is_read(gateway):
    big = json.dumps({**SEARCH, "arguments": {"q": "x" * 10_000}})
    assert _post(gateway, big).status_code == 413

    def chunks():  # no Content-Length: the cap holds while streaming
        yield b'{"server_name": "search_and_scrape_webpage", "tool_name": "google_search", "arguments": {"q": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}}'

    assert _post(gateway, chunks()).status_code == 413


def test_the_gateway_still_answers_after_the_attacks(gateway):
    assert httpx.get(f"{gateway}/health").status_code == 200
    r = _post(gateway, json.dumps({**SEARCH, "arguments": {"q": "river", "num": 2}}))
    assert r.status_code == 200 and r.json()["ok"]
    assert httpx.post(f"{gateway}/call", json={**READ, "arguments": {}}).status_code == 422
