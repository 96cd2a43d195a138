"""Page reads through the web backend: Jina Reader (its JSON and text forms, its failures, the
address sent as the agent wrote it, the reply's cap) and the summariser, against local servers
that answer in Jina's and OpenAI's formats."""

from __future__ import annotations

import json

import httpx
import pytest

from agent.catalogue import ScrapeArgs
from services.llm import ChatClient, LlmSettings
from services.tools.resilience import Upstream, UpstreamLimits
from services.tools.web import JinaReader, LlmSummariser, Page, _parse_jina
from services.upstream import UpstreamError
from tests.openai_fake import make_app as make_openai
from tests.servers import serve
from tests.test_tools_web import FAST, _backend
from tests.web_fakes import JINA_KEY, make_jina, make_site


async def test_jina_json_and_summariser_evidence():
    jina_app = make_jina()
    answer = json.dumps(
        {
            "rational": "the page says so",
            "evidence": "The Danube flows through Vienna.",
            "summary": "The Danube flows through Vienna.",
        }
    )
    llm_app = make_openai([answer])
    with serve(jina_app) as jina, serve(llm_app) as llm:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina, summariser_base=llm)
            out = await backend.read(
                ScrapeArgs(url="https://example.org/vienna", info_to_extract="Which river?")
            )
    assert out == {
        "success": True,
        "url": "https://example.org/vienna",
        "extracted_info": {
            "evidence": "The Danube flows through Vienna.",
            "summary": "The Danube flows through Vienna.",
        },
        "error": "",
    }
    req = jina_app.state.requests[0]
    assert req["target"] == "https://example.org/vienna"
    assert req["headers"]["authorization"] == f"Bearer {JINA_KEY}"
    # the Reader's defaults: its article extraction (X-Return-Format markdown would skip it) and its
    # own deadline (an X-Timeout of 20 s or more makes it wait for the network to go idle)
    assert "x-return-format" not in req["headers"] and "x-timeout" not in req["headers"]
    prompt = llm_app.state.requests[0]["body"]["messages"][0]["content"]
    assert "The Danube flows through Vienna." in prompt and "Which river?" in prompt


async def test_summariser_shrinks_long_pages_and_retries_empty_answers():
    llm_app = make_openai(
        [400, '```json\n{"evidence": "", "summary": ""}\n```', '{"evidence": "E", "summary": "S"}']
    )
    with serve(make_jina()) as jina, serve(llm_app) as llm:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina, summariser_base=llm)
            backend.summariser.max_content_chars = 40
            out = await backend.read(ScrapeArgs(url="https://example.org/x", info_to_extract="goal"))
    assert out["extracted_info"] == {"evidence": "E", "summary": "S"}
    sizes = [len(r["body"]["messages"][0]["content"]) for r in llm_app.state.requests]
    assert sizes[0] > sizes[1] > sizes[2]  # each retry sends a shorter page


async def test_a_summary_of_brackets_nested_past_the_stack_is_text_not_a_failed_read():
    """json.loads and json_repair both give up on 500 to 4,000 opening brackets (a RecursionError, a
    ValueError "Input nesting exceeds"), which escaped: the read failed as an internal error and the
    log took a traceback of about a thousand frames. A page can get a summariser to echo them."""
    nested = "[" * 4000
    llm_app = make_openai(['{"evidence": ' + "[" * 600, nested])
    with serve(make_jina()) as jina, serve(llm_app) as llm:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina, summariser_base=llm)
            out = await backend.read(ScrapeArgs(url="https://example.org/x", info_to_extract="goal"))
    assert out["success"] and out["extracted_info"]["evidence"] == ""
    assert out["extracted_info"]["summary"].startswith('{"evidence": [[[')


async def test_a_null_summary_is_retried_and_the_temperature_can_be_left_out():
    """A reasoning model may answer null content: retried on a shorter page, as an empty answer is.
    With the temperature omitted the request carries none."""
    llm_app = make_openai([None, '{"evidence": "E", "summary": "S"}'])
    with serve(llm_app) as llm:
        async with httpx.AsyncClient() as http:
            summariser = LlmSummariser(
                ChatClient(LlmSettings(f"{llm}/v1", "o4-mini", None), http=http), temperature=None
            )
            got = await summariser.summarise(Page("u", "t", "x" * 100, "jina"), "goal")
    assert got == ("E", "S") and all("temperature" not in r["body"] for r in llm_app.state.requests)


async def test_a_summariser_400_that_is_not_about_length_fails_at_once():
    """Only a context-length 400 is worth a shorter page; any other fails alike on every page."""
    refusal = ("error", 400, "Unsupported value: 'temperature' does not support 0.0 with this model.")
    llm_app = make_openai([refusal] * 4)
    with serve(make_jina()) as jina, serve(llm_app) as llm:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina, summariser_base=llm)
            with pytest.raises(UpstreamError, match="Unsupported value"):
                await backend.read(ScrapeArgs(url="https://example.org/x", info_to_extract="goal"))
    assert len(llm_app.state.requests) == 1


async def test_a_page_jina_could_not_load_is_not_summarised_as_read():
    """Jina answers 200 with the target's error page and a warning: the read falls back to a plain
    fetch (here the site is down too), so the agent sees a failed read, not a summary of a 404."""
    # a page the backend may read: a refused address never reaches Jina, and this test read one
    # (http://127.0.0.1:9/gone) and allowed Jina no request at all, so it never saw the warning
    jina_app = make_jina(["target-404"])
    with serve(jina_app) as jina, serve(make_site()) as site:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina, site=site)
            out = await backend.read(ScrapeArgs(url=f"{site}/gone", info_to_extract="goal"))
            await backend.aclose()
    assert len(jina_app.state.requests) == 1  # the Reader was asked, and its answer refused
    assert not out["success"] and out["error"]
    assert "404 Not Found" not in json.dumps(out.get("extracted_info"))


async def test_the_readers_text_form_warning_of_a_failed_target_is_seen():
    """A Reader that answers in its text form (it ignored Accept: application/json) puts the
    target's failure in a ``Warning:`` header line, as the JSON form puts it in ``warning``: no
    page titled "Not Found" comes of it."""
    with serve(make_jina(["target-404", None])) as jina:
        async with httpx.AsyncClient() as http:
            gone = await http.get(f"{jina}/https://example.org/gone")
            there = await http.get(f"{jina}/https://example.org/there")
    assert "json" not in gone.headers["content-type"] and "\nWarning: Target URL" in gone.text
    with pytest.raises(UpstreamError, match="Target URL returned error 404: Not Found"):
        _parse_jina("https://example.org/gone", gone)
    page = _parse_jina("https://example.org/there", there)
    assert page.title == "Danube" and "Vienna" in page.content


@pytest.mark.parametrize("jina_failure", [402, 422, 524])
async def test_jina_failure_falls_back_to_a_plain_fetch(jina_failure):
    with serve(make_jina([jina_failure] * 3)) as jina, serve(make_site()) as site:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina, site=site)
            out = await backend.read(
                ScrapeArgs(url=f"{site}/page", info_to_extract="Which river flows through Vienna?")
            )
    assert out["success"] and "The Danube flows through Vienna." in out["extracted_info"]["evidence"]


async def test_reads_of_internal_addresses_and_benchmark_leaks_never_reach_jina():
    jina_app = make_jina()
    with serve(jina_app) as jina:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina)
            for url, why in (
                ("http://169.254.169.254/latest/meta-data/", "refused"),
                ("http://127.0.0.1:6379/", "refused"),
                ("file:///etc/passwd", "refused"),
                # a page the search results would never have shown: it would leak the answers
                ("https://huggingface.co/datasets/openai/browsecomp", "leak"),
                ("https://huggingface.co/spaces/some/leaderboard", "leak"),
                # other spellings of that page passed a substring test of the link as written
                ("https://huggingface.co:443/datasets/openai/browsecomp", "leak"),
                ("https://huggingface.co./datasets/x", "leak"),
                ("https://HuggingFace.co/%64atasets/x", "leak"),
                ("https://huggingface.co//datasets/x", "leak"),
                ("https://huggingface.co/models/../datasets/x", "leak"),
                ("https://huggingface.co/%44ATASETS/x", "leak"),  # capitals once decoded
            ):
                out = await backend.read(ScrapeArgs(url=url, info_to_extract="secrets"))
                assert not out["success"] and why in out["error"], url
    assert jina_app.state.requests == []


async def test_a_host_that_resolves_slowly_is_a_failed_read_within_the_fetch_time():
    """The lookup before the read (so that not even Jina is asked for an internal address) had no
    bound of its own: a slow resolver held the call to its 240 s deadline."""
    import asyncio
    import time

    async with httpx.AsyncClient() as http:
        backend = _backend(http, "http://127.0.0.1:9")
        backend.fetcher.timeout_s = 0.2

        async def slow(host, port):
            await asyncio.sleep(30)

        backend.fetcher.backend.resolve = slow
        started = time.monotonic()
        out = await backend.read(ScrapeArgs(url="https://slow-dns.example/x", info_to_extract="goal"))
    assert time.monotonic() - started < 5
    assert not out["success"] and "did not resolve in 0.2 s" in out["error"]


async def test_a_short_link_that_lands_on_a_benchmark_page_is_not_read():
    with serve(make_jina(["landed:https://huggingface.co/datasets/openai/browsecomp"])) as jina:
        async with httpx.AsyncClient() as http:
            backend = _backend(http, "http://127.0.0.1:9", jina_base=jina)
            out = await backend.read(ScrapeArgs(url="https://example.org/s/x1", info_to_extract="answers"))
    assert not out["success"] and "leak benchmark answers" in out["error"]
    assert "Danube" not in json.dumps(out)


@pytest.mark.parametrize("form", ["json", "text"])
async def test_a_huge_reader_reply_is_read_only_up_to_the_cap(form):
    """The plain fetcher caps what it reads of a page; the Reader's reply is capped the same way. A
    JSON reply cut short is a failed read (the plain fetch then runs, capped as well)."""
    accept = {"json": "application/json", "text": "text/plain"}[form]
    with serve(make_jina(["huge"])) as base:
        async with httpx.AsyncClient() as http:
            reader = JinaReader(
                http,
                Upstream("jina", UpstreamLimits(retry=FAST)),
                base_url=base,
                api_key=None,
                max_bytes=100_000,
            )
            if form == "json":
                with pytest.raises(UpstreamError, match="malformed reader response"):
                    await reader.read("https://example.org/big")
            else:
                reply = await reader._post("https://example.org/big", {"Accept": accept})
                page = _parse_jina("https://example.org/big", reply)
                assert len(reply.content) == 100_000 and page.content.startswith("# Page about")


async def test_summaries_in_flight_are_capped_by_the_summariser_concurrency():
    import asyncio
    from types import SimpleNamespace

    from services.tools.web import Page

    class SlowModel:  # stands in for the chat client: counts the calls running at once
        running = peak = 0

        async def complete(self, messages, **kw):
            SlowModel.running += 1
            SlowModel.peak = max(SlowModel.peak, SlowModel.running)
            await asyncio.sleep(0.02)
            SlowModel.running -= 1
            return SimpleNamespace(text=json.dumps({"evidence": "e", "summary": "s"}))

    summariser = LlmSummariser(SlowModel(), concurrency=2)
    page = Page(url="https://example.org", title="t", content="text", source="http")
    results = await asyncio.gather(*(summariser.summarise(page, "goal") for _ in range(6)))
    assert results == [("e", "s")] * 6 and SlowModel.peak == 2


@pytest.mark.parametrize(
    "url",
    [
        "https://en.example.org/wiki/What%3F",
        "https://example.org/s?q=AT%26T&x=1",
        "https://example.org/#/route",
    ],
    ids=["escaped-question-mark", "escaped-ampersand", "hash-route"],
)
async def test_the_reader_gets_the_address_exactly_as_the_agent_wrote_it(url):
    """In the path of a GET the Reader decodes the address once (What%3F became What?, a query
    ending in AT&T another one), and a #route never left the client; the form body carries it."""
    jina_app = make_jina()
    with serve(jina_app) as base:
        async with httpx.AsyncClient() as http:
            reader = JinaReader(
                http, Upstream("jina", UpstreamLimits(retry=FAST)), base_url=base, api_key=None
            )
            page = await reader.read(url)
    assert [r["target"] for r in jina_app.state.requests] == [url] and page.url == url
    assert jina_app.state.requests[0]["method"] == "POST"
