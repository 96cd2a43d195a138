"""The web backend: Serper for search, Jina Reader (plain HTTP as fallback) for pages, and a
summariser LLM that extracts evidence and a summary for the agent's goal.

Result shapes are the offline backend's (:mod:`services.search.offline`). Secrets
(Serper and Jina keys) travel in headers only; no error message or log line carries
them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import httpx
from json_repair import repair_json
from pydantic import SecretStr

from agent.catalogue import GoogleSearchArgs, ScrapeArgs
from services.llm import ChatClient
from services.search.extractive import IdfTable, extract
from services.search.offline import read_result
from services.tools import metrics
from services.tools.blocklist import Blocklist
from services.tools.cpu import CpuPool
from services.tools.fetch import AddressRefused, EncodingRefused, FetchError, PlainFetcher
from services.tools.resilience import Upstream
from services.tools.ssrf import BlockedAddress, check_url
from services.upstream import UpstreamError

log = logging.getLogger(__name__)

__all__ = ["JinaReader", "LlmSummariser", "Page", "SerperSearch", "WebBackend"]

SUMMARY_PROMPT = """Extract what a research agent needs from a web page.

## Page
{content}

## The agent's goal
{goal}

## Instructions
1. Find the parts of the page that bear on the goal.
2. Evidence: copy those parts word for word, as completely as needed; do not paraphrase.
3. Summary: in a few sentences, say what the page tells about the goal, and say plainly if it does not answer it.

Answer with a JSON object with the keys "rational", "evidence" and "summary", and nothing else."""


@dataclass(frozen=True)
class Page:
    url: str
    title: str
    content: str
    source: str  # "jina" or "http"


class SerperSearch:
    """``POST {base}/search`` with ``X-API-KEY``; keeps organic results, answer box and knowledge graph."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        upstream: Upstream,
        *,
        base_url: str,
        api_key: SecretStr,
        blocked_hosts: tuple[str, ...] = (),
        max_num: int = 10,
    ) -> None:
        self.http = http
        self.upstream = upstream
        self.max_num = max_num
        self.url = base_url.rstrip("/") + "/search"
        self.api_key = api_key
        self.blocklist = Blocklist(blocked_hosts)

    async def search(self, args: GoogleSearchArgs) -> dict[str, Any]:
        body = args.model_dump(exclude_none=True)
        body["num"] = min(body.get("num", 10), self.max_num)
        headers = {"X-API-KEY": self.api_key.get_secret_value(), "Content-Type": "application/json"}
        response = await self.upstream.call(lambda: self.http.post(self.url, json=body, headers=headers))
        try:
            data = response.json()
            organic = data.get("organic", [])
            if not isinstance(organic, list):
                raise TypeError("organic is not a list")
        except (ValueError, TypeError, AttributeError) as exc:
            raise UpstreamError("serper", f"malformed search response ({exc})") from None
        credits = data.get("credits")
        if type(credits) in (int, float) and 0 <= credits < 1e6:  # what the search cost, as Serper says
            metrics.SERPER_CREDITS.inc(credits)
        results = []
        for item in organic:
            if not isinstance(item, dict) or not item.get("link") or self.blocked(item["link"]):
                continue
            hit = {k: item[k] for k in ("title", "link", "snippet", "date") if item.get(k)}
            hit["position"] = len(results) + 1
            results.append(hit)
        out: dict[str, Any] = {"organic": results}
        for key in ("answerBox", "knowledgeGraph"):
            box = data.get(key)
            # a box quoting a dataset page (its link or source, at any depth) leaks as much as the page
            if isinstance(box, dict) and not self.blocklist.blocks_any(box):
                out[key] = box
        return out

    def blocked(self, link: str) -> bool:
        """Hosts that would leak benchmark answers (dataset pages): dropped from results, never read."""
        return self.blocklist.blocks(link)


class JinaReader:
    """``POST {base}/`` with the page's address as the form field ``url`` and a bearer key; JSON or
    text replies. Not ``GET {base}/{url}``, as MiroThinker and Tongyi call it: the Reader decodes
    that path once (jina-ai/reader, src/api/crawler.ts), so an escaped ``?``, ``&``, ``=`` or ``/``
    in the address (``wiki/What%3F``, ``?q=AT%26T``) reaches it unescaped and names another page,
    and a ``#`` route never leaves the client. Its README gives the form body for such addresses."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        upstream: Upstream,
        *,
        base_url: str,
        api_key: SecretStr | None,
        max_bytes: int = 5_000_000,
    ) -> None:
        self.http = http
        self.upstream = upstream
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.max_bytes = max_bytes  # of the reply read, as the plain fetcher caps a page

    async def read(self, url: str) -> Page:
        # The Reader's defaults, as MiroThinker and Tongyi use it: no X-Return-Format (its default,
        # content, extracts the article; markdown converts the whole page, menus and footers
        # included) and no X-Timeout (from 20 s on it waits for the page's network to go idle,
        # slowing every read; our client's timeout bounds it).
        headers = {"Accept": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        response = await self.upstream.call(lambda: self._post(url, headers))
        return _parse_jina(url, response)

    async def _post(self, url: str, headers: dict[str, str]) -> httpx.Response:
        """The reply with at most ``max_bytes`` of its body read: a page of hundreds of MB (a hostile
        one) costs the gateway no more memory than the plain fetcher's cap. A JSON reply cut short
        no longer parses, and the read falls back to the plain fetch, capped as well."""
        async with self.http.stream(
            "POST", f"{self.base_url}/", data={"url": url}, headers=headers
        ) as response:
            body = bytearray()
            async for chunk in response.aiter_bytes():  # decompressed: the cap is on what is held
                body += chunk
                if len(body) > self.max_bytes:
                    del body[self.max_bytes :]
                    break
            kept = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "retry-after")}
            return httpx.Response(
                response.status_code, headers=kept, content=bytes(body), request=response.request
            )


def _parse_jina(url: str, response: httpx.Response) -> Page:
    ctype = response.headers.get("content-type", "")
    if "json" in ctype:
        try:
            data = response.json()["data"]
            page = Page(data.get("url") or url, data.get("title") or "", str(data["content"]), "jina")
        except (ValueError, KeyError, TypeError):
            raise UpstreamError("jina", "malformed reader response") from None
        # The Reader answers 200 for a target that failed, with the error page as content and a
        # warning ("Target URL returned error 404: Not Found"): that is no page to summarise.
        warning = str(data.get("warning") or "")
        if "returned error" in warning:
            raise UpstreamError("jina", warning[:200])
        if not page.content.strip():
            raise UpstreamError("jina", "empty reader response")
        return page
    text = response.text
    title, content = "", text
    if text.startswith("Title:"):
        head, _, rest = text.partition("Markdown Content:")
        for line in head.splitlines():
            if line.startswith("Title:"):
                title = line[6:].strip()
            # the text form's header carries the same warning ("Warning: Target URL returned error 404")
            if line.startswith("Warning:") and "returned error" in line:
                raise UpstreamError("jina", line[8:].strip()[:200])
        content = rest.strip() or text
    if not content.strip():
        raise UpstreamError("jina", "empty reader response")
    return Page(url, title, content, "jina")


class LlmSummariser:
    """Evidence and summary for a goal from an OpenAI-compatible model; long pages are cut."""

    def __init__(
        self,
        client: ChatClient,
        *,
        max_content_chars: int = 120_000,
        max_attempts: int = 3,
        concurrency: int = 32,
        temperature: float | None = 0.0,
    ) -> None:
        self.client = client
        self.temperature = temperature
        self.max_content_chars = max_content_chars
        self.max_attempts = max_attempts
        # a summary holds up to 120K characters of page in the model's context: cap how many run at once
        self.slots = asyncio.Semaphore(concurrency)

    async def summarise(self, page: Page, goal: str) -> tuple[str, str]:
        async with self.slots:
            return await self._summarise(page, goal)

    async def _summarise(self, page: Page, goal: str) -> tuple[str, str]:
        limit = self.max_content_chars
        for _attempt in range(self.max_attempts):
            content = page.content[:limit]
            try:
                result = await self.client.complete(
                    [{"role": "user", "content": SUMMARY_PROMPT.format(content=content, goal=goal)}],
                    temperature=self.temperature,
                )
            except UpstreamError as exc:
                if exc.status == 400 and _too_long(str(exc)):  # the page overflows the context
                    limit = int(limit * 0.5)
                    continue
                raise  # another 400 (a bad model name, an unsupported parameter) fails alike on any page
            evidence, summary = _parse_summary(result.text)
            if summary or evidence:
                return evidence, summary
            limit = int(limit * 0.7)  # an empty answer: retry on a shorter page, as Tongyi's reader does
        raise UpstreamError("summariser", "no usable summary after shrinking the page")


def _too_long(message: str) -> bool:
    """An OpenAI-compatible 400 about the context length (vLLM, SGLang and OpenAI say it so)."""
    text = message.lower()
    return any(w in text for w in ("context", "too long", "maximum", "max_tokens", "token limit"))


def _parse_summary(text: str) -> tuple[str, str]:
    raw = text.strip()
    if raw.startswith("```"):
        raw = raw.strip("`").removeprefix("json").strip()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: brackets nested past Python's stack
        try:
            data = repair_json(raw, return_objects=True)
        except (ValueError, RecursionError):  # json_repair gives up on such nesting too: the text
            data = None
    if isinstance(data, dict):
        return _as_text(data.get("evidence")), _as_text(data.get("summary"))
    return "", text.strip()


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


class WebBackend:
    name = "web"

    def __init__(
        self,
        search: SerperSearch,
        jina: JinaReader | None,
        fetcher: PlainFetcher,
        summariser: LlmSummariser | None,
        *,
        extract_chars: int = 2000,
        max_content_chars: int = 120_000,
    ) -> None:
        self.searcher = search
        self.jina = jina
        self.fetcher = fetcher
        self.summariser = summariser
        self.extract_chars = extract_chars
        # extraction reads as much of a page as the summariser would: its cost stays bounded
        self.max_content_chars = max_content_chars
        self._flat_idf = IdfTable()

    @property
    def cpu(self) -> CpuPool:
        return self.fetcher.cpu

    async def search(self, args: GoogleSearchArgs) -> dict[str, Any]:
        return await self.searcher.search(args)

    async def read(self, args: ScrapeArgs) -> dict[str, Any]:
        if self.searcher.blocked(args.url):  # a page the search results would never have shown
            return read_result(args.url, error=f"refused to read {args.url}: it would leak benchmark answers")
        try:
            _scheme, host, port = check_url(args.url)
            # Resolve and check here too, so that not even Jina is asked for an internal address;
            # within the fetch's time, as the fetch's own lookup is (a slow resolver held the call
            # to its 240 s deadline; the executor's thread still waits for the resolver's answer)
            async with asyncio.timeout(self.fetcher.timeout_s):
                await self.fetcher.backend.resolve(host, port)
        except BlockedAddress as exc:
            metrics.SSRF_BLOCKED.inc()
            return read_result(args.url, error=f"refused to read {args.url}: {exc}")
        except TimeoutError:
            return read_result(
                args.url,
                error=f"cannot read {args.url}: its host did not resolve in {self.fetcher.timeout_s:g} s",
            )
        except Exception as exc:  # unresolvable host: an unsuccessful read, not a tool failure
            return read_result(args.url, error=f"cannot read {args.url}: {exc}")
        page = await self._page(args.url)
        if isinstance(page, str):
            return read_result(args.url, error=page)
        if self.searcher.blocked(page.url):  # a short link or a redirect that ends on such a page
            return read_result(args.url, error=f"refused to read {args.url}: it would leak benchmark answers")
        if self.summariser is not None:
            evidence, summary = await self.summariser.summarise(page, args.info_to_extract)
        else:
            ex = await self.cpu.run(
                partial(
                    extract,
                    page.content[: self.max_content_chars],
                    args.info_to_extract,
                    self._flat_idf,
                    title=page.title,
                    max_chars=self.extract_chars,
                )
            )
            evidence, summary = " ".join(ex.evidence), ex.summary
        return read_result(args.url, evidence=evidence, summary=summary)

    async def _page(self, url: str) -> Page | str:
        """The page, or why it could not be read (a normal, unsuccessful result for the agent)."""
        if self.jina is not None:
            try:
                return await self.jina.read(url)
            except UpstreamError as exc:
                log.info(
                    "jina could not read %s (%s); falling back to a plain fetch", urlsplit(url).netloc, exc
                )
        try:
            fetched = await self.fetcher.fetch(url)
        except FetchError as exc:
            if isinstance(exc, AddressRefused):
                metrics.SSRF_BLOCKED.inc()
            elif isinstance(exc, EncodingRefused):
                metrics.ENCODING_REFUSED.inc()
            return str(exc)
        return Page(fetched.url, fetched.title, fetched.content, "http")

    async def aclose(self) -> None:
        await self.fetcher.aclose()
