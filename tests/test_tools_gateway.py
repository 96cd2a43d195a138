"""The tool gateway over HTTP with the offline backend and a real Redis."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agent.catalogue import catalogue
from services.search.corpus import OfflineCorpus
from services.tools.app import create_app
from services.tools.backends import OfflineBackend
from services.tools.client import GatewayClient
from services.tools.gateway import InvalidCall, ToolGateway
from services.tools.settings import ToolsSettings
from services.tools.store import MemoryStore
from tests.servers import serve
from worldgen.build import build_world

SEARCH = ("search_and_scrape_webpage", "google_search")
READ = ("jina_scrape_llm_summary", "scrape_and_extract_info")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("gw-world")
    build_world(out, seed=5, entities=1500, n_rl=50, n_val=20, n_sft=20)
    return out


@pytest.fixture
def gateway_url(world, redis_url, key_prefix, monkeypatch):
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("PBSD_STREAM_PREFIX", key_prefix)
    settings = ToolsSettings(corpus=world / "corpus.jsonl", call_budget=3, max_result_chars=5000)
    with serve(create_app(settings)) as base:
        yield base


async def test_the_corpus_is_out_of_the_collectors_walk_while_the_gateway_serves(world):
    """The corpus is millions of objects that live as long as the gateway: a full collection that
    walked them stalled calls for ~120 ms (benchmarks/README.md, "tools")."""
    import gc

    app = create_app(ToolsSettings(corpus=world / "corpus.jsonl", use_redis=False))
    async with app.router.lifespan_context(app):
        corpus = app.state.gateway.backend.tools.corpus
        assert not any(o is corpus for o in gc.get_objects()) and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def _doc(world, n=0):
    return json.loads((world / "corpus.jsonl").read_text().splitlines()[n])


async def test_catalogue_and_health(gateway_url):
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        assert (await http.get("/health")).json() == {"status": "ok", "backend": "offline"}
        assert (await http.get("/tools")).json() == {"servers": catalogue()}
        # /call is served by a DirectRoute: its description stays what an ordinary route gives
        call = (await http.get("/openapi.json")).json()["paths"]["/call"]["post"]
        body = call["requestBody"]["content"]["application/json"]["schema"]
        assert set(body["properties"]) == {
            "server_name",
            "tool_name",
            "arguments",
            "trajectory_id",
            "call_index",
        }
        assert call["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/CallResponse"
        }
        assert {"404", "413", "422"} <= set(call["responses"])


async def test_search_and_read_through_http_with_cache(gateway_url, world, redis_url, key_prefix):
    doc = _doc(world, 7)
    client = GatewayClient(gateway_url)
    first = await client.call(*SEARCH, {"q": doc["title"], "num": 3})
    again = await client.call(*SEARCH, {"q": f"  {doc['title'].upper()} ", "num": 3})  # same normalised query
    assert first.ok and not first.cached and again.cached and again.text == first.text
    hits = json.loads(first.text)["organic"]
    assert hits[0]["link"] == doc["url"] and len(hits) <= 3
    page = await client.call(*READ, {"url": doc["url"], "info_to_extract": f"What is {doc['title']}?"})
    result = json.loads(page.text)
    assert result["success"] and doc["title"] in result["extracted_info"]["evidence"]
    await client.aclose()
    # entries expire: the cache keys carry the configured TTL
    import redis

    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{key_prefix}:tools:cache:*"))
    assert len(keys) == 2 and all(0 < r.ttl(k) <= 7 * 86400 for k in keys)
    r.close()


async def test_malformed_calls_are_4xx_naming_the_field(gateway_url):
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        r = await http.post(
            "/call", json={"server_name": "nope", "tool_name": "google_search", "arguments": {}}
        )
        assert r.status_code == 404 and r.json()["detail"][0]["loc"] == ["body", "server_name"]
        r = await http.post("/call", json={"server_name": SEARCH[0], "tool_name": "nope", "arguments": {}})
        assert r.status_code == 404 and r.json()["detail"][0]["loc"] == ["body", "tool_name"]
        r = await http.post(
            "/call",
            json={"server_name": SEARCH[0], "tool_name": SEARCH[1], "arguments": {"q": "x", "num": 0}},
        )
        assert r.status_code == 422
        assert (
            r.json()["detail"][0]["loc"] == ["body", "arguments", "num"]
            and "greater than" in r.json()["detail"][0]["msg"]
        )
        r = await http.post(
            "/call", json={"server_name": READ[0], "tool_name": READ[1], "arguments": {"url": "kb://x"}}
        )
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == [
            "body",
            "arguments",
            "info_to_extract",
        ]
        r = await http.post(
            "/call",
            json={
                "server_name": READ[0],
                "tool_name": READ[1],
                "arguments": {"url": "x", "info_to_extract": "y", "extra": 1},
            },
        )
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "arguments", "extra"]
        r = await http.post("/call", json={"tool_name": "x"})
        assert r.status_code == 422 and ["body", "server_name"] in [d["loc"] for d in r.json()["detail"]]
    # the rollout's client turns them into readable tool failures
    client = GatewayClient(gateway_url)
    reply = await client.call(SEARCH[0], SEARCH[1], {"q": "x", "num": 0})
    assert not reply.ok and reply.text.startswith(
        "Tool call to google_search on search_and_scrape_webpage failed. Error: arguments.num"
    )
    await client.aclose()


async def test_budget_unknown_pages_and_gateway_down(gateway_url):
    client = GatewayClient(gateway_url)
    for _ in range(3):
        assert (await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-1")).ok
    over = await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-1")
    assert not over.ok and "call budget of 3" in over.text
    assert (await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-2")).ok  # budgets are per trajectory
    missing = json.loads((await client.call(*READ, {"url": "kb://none/such", "info_to_extract": "x"})).text)
    assert missing == {
        "success": False,
        "url": "kb://none/such",
        "extracted_info": {},
        "error": "no page found at kb://none/such",
    }
    await client.aclose()
    down = GatewayClient("http://127.0.0.1:9")
    reply = await down.call(*SEARCH, {"q": "x"})
    assert not reply.ok and "tool gateway unreachable" in reply.text
    await down.aclose()


async def test_a_call_sent_again_at_its_place_counts_once(gateway_url):
    """The agent sends each call's place in its trajectory: a trajectory that goes on from a keep
    makes the calls of its unfinished exchange again, at the places they had, and is not refused
    calls it did not spend; a place past the budget is refused however few calls came before."""
    client = GatewayClient(gateway_url)  # call_budget=3
    for place in (0, 1, 1, 1, 2, 2):
        assert (await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-3", call_index=place)).ok
    over = await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-3", call_index=3)
    assert not over.ok and "call budget of 3" in over.text
    assert not (await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-4", call_index=7)).ok
    # the places do not spend the count kept for calls without one
    for _ in range(3):
        assert (await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-3")).ok
    assert not (await client.call(*SEARCH, {"q": "city"}, trajectory_id="t-3")).ok
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        r = await http.post(
            "/call", json={"server_name": SEARCH[0], "tool_name": SEARCH[1], "call_index": -1}
        )
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "call_index"]
    await client.aclose()


async def test_metrics_are_exported(gateway_url):
    """Two identical searches: two calls answered and timed, one cache miss then one hit. (Every
    series exists at zero from the start, so their names alone prove nothing.)"""
    from prometheus_client import REGISTRY

    def counts() -> tuple[float, ...]:
        tool = {"tool": "google_search"}
        return tuple(
            REGISTRY.get_sample_value(name, labels) or 0.0
            for name, labels in (
                ("pbsd_tools_calls_total", {**tool, "backend": "offline", "outcome": "ok"}),
                ("pbsd_tools_call_seconds_count", {**tool, "backend": "offline"}),
                ("pbsd_tools_cache_total", {**tool, "result": "miss"}),
                ("pbsd_tools_cache_total", {**tool, "result": "hit"}),
            )
        )

    before = counts()
    client = GatewayClient(gateway_url)
    await client.call(*SEARCH, {"q": "a river no other test searches for"})
    await client.call(*SEARCH, {"q": "a river no other test searches for"})
    await client.aclose()
    assert [b - a for a, b in zip(before, counts(), strict=True)] == [2, 2, 1, 1]
    text = httpx.get(f"{gateway_url}/metrics").text
    assert f'pbsd_tools_cache_total{{result="hit",tool="google_search"}} {counts()[3]}' in text


class SlowBackend(OfflineBackend):
    """The real offline backend, slowed down so that identical calls overlap."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0  # this backend's own: another test's calls must not count

    async def search(self, args):
        self.calls += 1
        await asyncio.sleep(0.3)
        return await super().search(args)


async def test_a_place_past_the_budget_is_refused_without_a_round_trip(world):
    """A refused place costs the store nothing, so a store that is down still answers it as a
    refusal and not as the store's failure."""

    class Down(MemoryStore):
        async def get(self, key):
            raise AssertionError("the store was asked")

    gw = ToolGateway(OfflineBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl")), Down(), call_budget=2)
    out = await gw.call(*SEARCH, {"q": "festival"}, trajectory_id="t", call_index=2)
    assert not out.ok and "call budget of 2" in out.text


async def test_identical_calls_in_flight_are_merged(world):
    backend = SlowBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl"))
    gw = ToolGateway(backend, MemoryStore())
    outs = await asyncio.gather(*(gw.call(*SEARCH, {"q": "festival"}) for _ in range(5)))
    assert backend.calls == 1
    assert sum(o.merged for o in outs) == 4 and len({o.text for o in outs}) == 1


async def test_a_call_past_its_deadline_is_a_failed_call_not_a_hung_one(world):
    """Retries and fallbacks can outlast the rollout client's timeout (Jina, a plain fetch, four
    summariser attempts): the gateway answers a failed call at its deadline, and caches nothing."""
    gw = ToolGateway(
        SlowBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl")), MemoryStore(), deadline_s=0.05
    )
    out = await gw.call(*SEARCH, {"q": "festival"})
    assert not out.ok and "no answer within 0.05 s" in out.text and out.error
    gw.deadline_s = 5.0
    assert (await gw.call(*SEARCH, {"q": "festival"})).ok  # nothing cached from the timed-out call


async def test_cache_expiry_and_truncation(world):
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    gw = ToolGateway(
        OfflineBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl")),
        store,
        search_ttl_s=60,
        max_result_chars=80,
    )
    first = await gw.call(*SEARCH, {"q": "river"})
    assert first.text.endswith("\n... [Result truncated]")
    assert (await gw.call(*SEARCH, {"q": "river"})).cached
    now[0] = 61
    assert not (await gw.call(*SEARCH, {"q": "river"})).cached
    with pytest.raises(InvalidCall):
        gw.validate(*SEARCH, ["not", "a", "dict"])


async def test_answers_cached_under_another_configuration_are_not_served(world, tmp_path):
    """The cache keys carry what shapes an answer besides its arguments. A restart with a host added
    to the blocked list, or on a rebuilt corpus, must not serve what the old configuration cached
    (the shared cache outlives the gateway: Redis keeps it on disk)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text((world / "corpus.jsonl").read_text())
    base = ToolsSettings(corpus=corpus, use_redis=False)
    tags = {
        "base": base.answers_tag(),
        "same": ToolsSettings(corpus=corpus, use_redis=False, port=9, call_budget=5).answers_tag(),
        "blocked": ToolsSettings(corpus=corpus, blocked_result_hosts=["example.org"]).answers_tag(),
    }
    corpus.write_text(corpus.read_text() + "\n")  # rebuilt: another size
    tags["rebuilt"] = base.answers_tag()
    assert tags["same"] == tags["base"] and len(set(tags.values())) == 3

    store = MemoryStore()  # one cache, two gateways in turn
    backend = OfflineBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl"))
    before = ToolGateway(backend, store, answers_tag=tags["base"])
    assert not (await before.call(*SEARCH, {"q": "river"})).cached
    assert (await ToolGateway(backend, store, answers_tag=tags["same"]).call(*SEARCH, {"q": "river"})).cached
    after = ToolGateway(backend, store, answers_tag=tags["blocked"])
    assert not (await after.call(*SEARCH, {"q": "river"})).cached


def test_settings_fail_fast():
    with pytest.raises(ValueError, match="SERPER_API_KEY"):
        ToolsSettings(backend="web")
    with pytest.raises(ValueError, match="PBSD_TOOLS_CORPUS"):
        ToolsSettings(backend="offline")
    s = ToolsSettings(backend="web", serper_api_key="serper-secret-1", redis_url="redis://:hunter2@h:6379/0")
    assert "serper-secret-1" not in repr(s) and "hunter2" not in repr(s)


def test_empty_environment_values_are_unset(monkeypatch):
    """Compose's ${VAR:-} and the example secrets set "" for a key a deployment leaves out: that is no
    key (no "Bearer " header to Jina, no passing the web backend's check), not an empty one."""
    for name in ("SERPER_API_KEY", "JINA_API_KEY", "SUMMARISER_API_KEY", "SUMMARISER_BASE_URL"):
        monkeypatch.setenv(f"PBSD_TOOLS_{name}", "")
    monkeypatch.setenv("PBSD_TOOLS_BACKEND", "web")
    with pytest.raises(ValueError, match="SERPER_API_KEY"):
        ToolsSettings()
    monkeypatch.setenv("PBSD_TOOLS_SERPER_API_KEY", "k")
    s = ToolsSettings()
    assert s.jina_api_key is None and s.summariser_api_key is None and s.summariser_base_url is None


async def test_the_gateway_keeps_answering_while_redis_is_down(world):
    """Redis holds the cache and the budgets; while it is out of reach they live in the process
    (no call fails with a ConnectionError), and once it is back they are shared again."""
    from prometheus_client import REGISTRY

    from services.bus import redis_client
    from services.local_redis import LocalRedis, free_port
    from services.tools.store import RedisStore

    def fallbacks(op: str) -> float:
        return REGISTRY.get_sample_value("pbsd_tools_store_fallbacks_total", {"op": op}) or 0.0

    port = free_port()  # nothing listens here yet
    client = redis_client(f"redis://127.0.0.1:{port}/0")
    gw = ToolGateway(
        OfflineBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl")), RedisStore(client, "down")
    )
    gw.call_budget = 2
    before = fallbacks("incr")
    first = await gw.call(*SEARCH, {"q": "festival"}, trajectory_id="t1")
    again = await gw.call(*SEARCH, {"q": "festival"}, trajectory_id="t1")
    assert first.ok and not first.cached and again.ok and again.cached  # the in-process cache
    over = await gw.call(*SEARCH, {"q": "museum"}, trajectory_id="t1")
    assert not over.ok and "call budget of 2" in over.text  # budgets still hold
    assert fallbacks("incr") == before + 3
    with LocalRedis(port=port) as server:
        assert server.port == port
        near = await gw.call(*SEARCH, {"q": "festival"}, trajectory_id="t2")
        assert near.ok and near.cached  # the near copy, for up to near_ttl_s
        back = await gw.call(*SEARCH, {"q": "museum"}, trajectory_id="t2")
        assert back.ok and not back.cached  # Redis is the store again (and starts empty)
        assert await client.exists("down:tools:budget:t2")
        assert await client.get("down:tools:budget:t2") == b"2"
    await client.aclose()


async def test_cpu_work_runs_off_the_event_loop_a_bounded_number_at_a_time():
    """At most ``workers`` jobs run at once; the others wait in the event loop, where a cancelled
    one never starts; a job cancelled while it runs keeps its slot until it ends."""
    import threading

    from services.tools.cpu import CpuPool

    pool = CpuPool(workers=1)
    loop_thread = threading.get_ident()
    release, started = threading.Event(), []

    def job(name):
        started.append((name, threading.get_ident() != loop_thread))
        release.wait(10)
        return name

    first = asyncio.create_task(pool.run(job, "first"))
    waiting = asyncio.create_task(pool.run(job, "waiting"))
    await asyncio.sleep(0.2)
    assert started == [("first", True)]  # off the loop, and alone
    waiting.cancel()
    first.cancel()  # already running: it finishes, and only then frees its slot
    third = asyncio.create_task(pool.run(job, "third"))
    await asyncio.sleep(0.2)
    assert started == [("first", True)]
    release.set()
    assert await third == "third"
    assert [name for name, _ in started] == ["first", "third"]  # "waiting" never ran
    assert first.cancelled() and waiting.cancelled()
    pool.close()


async def test_a_call_stuck_in_cpu_work_is_answered_at_its_deadline(world):
    """The deadline holds for work in the CPU pool too: the call fails at its deadline while the
    job finishes in the background."""
    import threading

    release = threading.Event()

    class StuckBackend(OfflineBackend):
        async def search(self, args):
            return await self.cpu.run(release.wait, 10)

    gw = ToolGateway(
        StuckBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl")), MemoryStore(), deadline_s=0.2
    )
    out = await gw.call(*SEARCH, {"q": "festival"})
    release.set()
    assert not out.ok and "no answer within 0.2 s" in out.text


async def test_an_unexpected_backend_exception_is_a_failed_call_not_a_500(world, caplog):
    class BrokenBackend(OfflineBackend):
        async def read(self, args):
            raise AssertionError("a bug")

    gw = ToolGateway(BrokenBackend(OfflineCorpus.from_jsonl(world / "corpus.jsonl")), MemoryStore())
    out = await gw.call(*READ, {"url": "kb://x", "info_to_extract": "y"})
    assert not out.ok and "internal error in the tool gateway (AssertionError)" in out.text
    assert "failed unexpectedly" in caplog.text


async def test_replicas_keep_near_copies_and_count_budgets_in_one_round_trip(redis_url, key_prefix):
    """A cache entry read from Redis is answered from the process next time (for at most
    ``near_ttl_s``); a budgeted call counts and looks up together, and counts in Redis even when
    the answer is near."""
    from services.bus import redis_client
    from services.tools.store import RedisStore

    client = redis_client(redis_url)
    writer, reader = RedisStore(client, key_prefix), RedisStore(client, key_prefix, near_ttl_s=600)
    uncached = RedisStore(client, key_prefix, near_ttl_s=0)
    await writer.set("cache:k", "answer", 60)
    assert await reader.get("cache:k") == "answer"
    assert await uncached.get("cache:k") == "answer"
    await client.delete(f"{key_prefix}:tools:cache:k")
    assert await reader.get("cache:k") == "answer"  # its near copy
    assert await uncached.get("cache:k") is None  # asks Redis every time
    assert await reader.incr_and_get("budget:t", 60, "cache:k") == (1, "answer")
    assert await uncached.incr_and_get("budget:t", 60, "cache:missing") == (2, None)
    assert 0 < await client.ttl(f"{key_prefix}:tools:budget:t") <= 60
    await client.aclose()
