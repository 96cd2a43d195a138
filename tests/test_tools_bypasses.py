"""Ways around the gateway's guards that mutation testing found untested: an internal address
among a host's answers or reached by name, a lookup's answer kept, user names in URLs, a leak page
behind a Unicode full stop, an escaped path, a huge answer box or a redirect, the cache answering
one call with another's result or a failure, a merged caller's cancel, and budget windows that
slide."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import SecretStr

from agent.catalogue import ScrapeArgs
from services.tools.blocklist import MAX_STRINGS, Blocklist, canonical_link
from services.tools.fetch import PlainFetcher
from services.tools.gateway import ToolGateway
from services.tools.resilience import Upstream, UpstreamLimits
from services.tools.ssrf import BlockedAddress, GuardedNetworkBackend, Resolver, address_problem, check_url
from services.tools.store import MemoryStore
from services.tools.web import SerperSearch, WebBackend
from services.upstream import UpstreamError
from tests.servers import serve

SEARCH = ("search_and_scrape_webpage", "google_search")
READ = ("jina_scrape_llm_summary", "scrape_and_extract_info")


def _infos(*addresses: str) -> list:
    """What socket.getaddrinfo answers for these addresses."""
    return [
        (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 443))
        for a in addresses
    ]


# ---------------------------------------------------------------- ssrf.py -----------------------
# only the first answer was checked
@pytest.mark.parametrize("answer", [("93.184.216.34", "127.0.0.1"), ("93.184.216.34", "169.254.169.254")])
async def test_a_host_with_any_internal_address_among_its_answers_is_refused(answer):
    backend = GuardedNetworkBackend(resolver=Resolver(lookup=lambda host, port, **kw: _infos(*answer)))
    try:
        with pytest.raises(BlockedAddress, match=answer[1]):
            await backend.resolve("rebind.example", 443)
        assert backend.blocked == 1
    finally:
        backend.resolver.close()


class _Recorder:
    """An inner network backend that records where it was asked to connect."""

    def __init__(self) -> None:
        self.connected: list[tuple[str, int]] = []

    async def connect_tcp(self, host, port, **kwargs):
        self.connected.append((host, port))
        raise OSError("recorded, not connected")


# the connection went to the name, re-resolved (DNS rebinding)
async def test_the_connection_goes_to_the_address_that_was_checked_not_the_name():
    inner = _Recorder()
    backend = GuardedNetworkBackend(
        inner=inner, resolver=Resolver(lookup=lambda host, port, **kw: _infos("93.184.216.34"))
    )
    try:
        assert await backend.resolve("public.example", 443) == "93.184.216.34"
        with pytest.raises(OSError, match="recorded"):
            await backend.connect_tcp("public.example", 443)
        assert inner.connected == [("93.184.216.34", 443)]
    finally:
        backend.resolver.close()


# the first answer (or failure) stuck for good
async def test_a_finished_lookup_is_not_reused_by_the_next_one():
    answers = iter([_infos("93.184.216.34"), _infos("93.184.216.35")])
    calls = []

    def dns(host, port, **kw):
        calls.append(host)
        return next(answers)

    resolver = Resolver(threads=2, lookup=dns)
    try:
        assert await resolver.addresses("a.example", 443) == ["93.184.216.34"]
        assert await resolver.addresses("a.example", 443) == ["93.184.216.35"]
        assert calls == ["a.example", "a.example"]
    finally:
        resolver.close()


# a user name alone passed
def test_a_url_with_a_user_name_only_is_refused():
    with pytest.raises(BlockedAddress, match="credentials"):
        check_url("http://admin@example.org/")


# NAT64 around a public address is public (DNS64 networks)
@pytest.mark.parametrize("address", ["64:ff9b::808:808", "64:ff9b::5db8:d822"])
def test_nat64_around_a_public_address_passes(address):
    assert address_problem(address) is None


# ---------------------------------------------------------------- blocklist.py ------------------
LEAKS = Blocklist(("huggingface.co/datasets",))


# httpx sends "huggingface。co" to huggingface.co
def test_an_ideographic_full_stop_in_the_host_does_not_hide_a_leak():
    assert httpx.URL("https://huggingface\u3002co/datasets/x").host == "huggingface.co"
    assert LEAKS.blocks("https://huggingface\u3002co/datasets/openai/browsecomp")


# as the blocklist's docstring says: "%2564 is %64 is d"
def test_a_doubly_escaped_path_is_decoded_to_its_page():
    assert canonical_link("https://huggingface.co/%2564atasets/x") == "huggingface.co/datasets/x"
    assert LEAKS.blocks("https://huggingface.co/%2564atasets/x")


def test_the_query_is_decoded_and_lowered_too():
    assert canonical_link("https://example.org/s?q=%42rowse%43omp") == "example.org/s?q=browsecomp"
    assert Blocklist(("q=browsecomp",)).blocks("https://example.org/s?q=%42rowse%43omp")


# a box past MAX_STRINGS was let through unread
def test_an_answer_box_too_large_to_look_at_in_full_is_kept_out():
    assert not LEAKS.blocks_any({"answer": "x", "sources": ["a"] * 10})
    box = {"sources": ["https://huggingface.co/datasets/a"] + ["harmless"] * MAX_STRINGS}
    assert LEAKS.blocks_any(box)


# an entry written with a scheme or a trailing slash
def test_an_entry_matches_the_link_as_written_too():
    assert Blocklist(("https://huggingface.co/datasets",)).blocks("https://huggingface.co/datasets/x")
    assert Blocklist(("huggingface.co/datasets/",)).blocks("https://huggingface.co/datasets/")


# ---------------------------------------------------------------- gateway.py --------------------
class _EchoBackend:
    """Answers with what it was asked: two calls with different arguments get different answers."""

    name = "echo"

    def __init__(self, *, fail_reads: int = 0, delay: float = 0.0, error_text: str = "") -> None:
        self.fail_reads, self.delay, self.error_text = fail_reads, delay, error_text
        self.searches = self.reads = 0

    async def search(self, args):
        self.searches += 1
        await asyncio.sleep(self.delay)
        if self.error_text:
            raise UpstreamError("serper", self.error_text)
        return {"organic": [{"title": args.q, "link": f"https://example.org/{self.searches}"}]}

    async def read(self, args):
        self.reads += 1
        if self.reads <= self.fail_reads:
            return {"success": False, "url": args.url, "extracted_info": {}, "error": "timed out"}
        return {
            "success": True,
            "url": args.url,
            "extracted_info": {"evidence": args.info_to_extract, "summary": ""},
            "error": "",
        }


# the whole query and a read's goal are in the key; case and spacing are not
async def test_the_cache_never_answers_one_call_with_anothers_result():
    gw = ToolGateway(_EchoBackend(), MemoryStore())
    url = "https://example.org/page"
    first = await gw.call(*READ, {"url": url, "info_to_extract": "the population"})
    other = await gw.call(*READ, {"url": url, "info_to_extract": "the mayor"})
    assert not other.cached and "the mayor" in other.text and "population" not in other.text
    same = await gw.call(*READ, {"url": f" {url} ", "info_to_extract": "  The   Population "})
    assert same.cached and same.text == first.text  # case and spacing only: the same call
    await gw.call(*SEARCH, {"q": "river delta"})
    mouth = await gw.call(*SEARCH, {"q": "river mouth"})
    assert not mouth.cached and "river mouth" in mouth.text
    assert (await gw.call(*SEARCH, {"q": "River   Delta"})).cached


# a failed read (maybe transient) was cached for a week
async def test_a_failed_read_is_not_cached():
    backend = _EchoBackend(fail_reads=1)
    gw = ToolGateway(backend, MemoryStore())
    args = {"url": "https://example.org/flaky", "info_to_extract": "x"}
    failed = await gw.call(*READ, args)
    assert failed.ok and json.loads(failed.text)["success"] is False
    again = await gw.call(*READ, args)
    assert not again.cached and json.loads(again.text)["success"] is True and backend.reads == 2


# one caller giving up cancelled everyone's call
async def test_a_merged_caller_that_gives_up_leaves_the_call_to_the_others():
    backend = _EchoBackend(delay=0.3)
    gw = ToolGateway(backend, MemoryStore())
    leader = asyncio.create_task(gw.call(*SEARCH, {"q": "festival"}))
    await asyncio.sleep(0.05)
    quitter = asyncio.create_task(gw.call(*SEARCH, {"q": "festival"}))
    stayer = asyncio.create_task(gw.call(*SEARCH, {"q": "festival"}))
    await asyncio.sleep(0.05)
    quitter.cancel()
    first, merged = await asyncio.gather(leader, stayer)
    assert first.ok and merged.ok and merged.merged and merged.text == first.text
    assert backend.searches == 1


async def test_a_failed_calls_text_is_cut_like_a_result():
    gw = ToolGateway(_EchoBackend(error_text="e" * 5000), MemoryStore(), max_result_chars=200)
    out = await gw.call(*SEARCH, {"q": "x"})
    assert not out.ok and len(out.text) <= 200 + len("\n... [Result truncated]")


# ---------------------------------------------------------------- store.py ----------------------
# each call pushed the window on, so it never ended
async def test_an_in_process_budget_window_starts_at_the_first_call():
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    assert await store.incr("budget:t", 10) == 1
    now[0] = 9
    assert await store.incr("budget:t", 10) == 2
    now[0] = 11  # ten seconds after the first call: a new window
    assert await store.incr("budget:t", 10) == 1


# the Redis window was pushed on by every call
async def test_a_redis_budget_window_starts_at_the_first_call(redis_url, key_prefix):
    from services.bus import redis_client
    from services.tools.store import RedisStore

    client = redis_client(redis_url)
    try:
        store = RedisStore(client, key_prefix)
        assert (await store.incr_and_get("budget:w", 60, "cache:none"))[0] == 1
        await client.expire(f"{key_prefix}:tools:budget:w", 5)  # as if 55 s had gone by
        assert (await store.incr_and_get("budget:w", 60, "cache:none"))[0] == 2
        assert 0 < await client.ttl(f"{key_prefix}:tools:budget:w") <= 5
    finally:
        await client.aclose()


# ---------------------------------------------------------------- web.py ------------------------
def _leaky_site() -> FastAPI:
    app = FastAPI()

    @app.get("/go")
    async def go():
        return RedirectResponse("/datasets/answers", status_code=302)

    @app.get("/datasets/answers")
    async def answers():
        return HTMLResponse("<html><body><p>The answer is SECRET-ANSWER-42.</p></body></html>")

    return app


# the page checked is the one the fetch landed on, not the link asked for
async def test_a_plain_fetch_redirected_onto_a_benchmark_page_is_not_read():
    with serve(_leaky_site()) as site:
        port = int(site.rsplit(":", 1)[1])
        async with httpx.AsyncClient() as http:
            limits = UpstreamLimits()
            serper = SerperSearch(
                http,
                Upstream("serper", limits),
                base_url="http://127.0.0.1:9",
                api_key=SecretStr("k"),
                blocked_hosts=("127.0.0.1/datasets",),
            )
            backend = WebBackend(serper, None, PlainFetcher(allow=(f"127.0.0.1:{port}",), timeout_s=5), None)
            try:
                out = await backend.read(ScrapeArgs(url=f"{site}/go", info_to_extract="the answer"))
            finally:
                await backend.aclose()
    assert not out["success"] and "leak benchmark answers" in out["error"]
    assert "SECRET-ANSWER-42" not in json.dumps(out)
