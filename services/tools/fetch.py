"""The plain HTTP page fetcher: the fallback when Jina Reader cannot read a page.

Everything an agent-chosen URL could abuse is bounded here: the SSRF guard on every
connection (:mod:`services.tools.ssrf`), redirects followed by hand (at most
``max_redirects``, each hop's URL checked again), a byte cap on the *decoded* body
(so a gzip bomb stops at the cap instead of filling memory), only identity and gzip
encodings accepted, and one deadline for the whole fetch.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from urllib.parse import urljoin

import httpcore

from services.tools.html_text import html_to_text
from services.tools.ssrf import BlockedAddress, GuardedNetworkBackend, check_url

__all__ = ["FetchError", "FetchedPage", "PlainFetcher"]

_REDIRECTS = {301, 302, 303, 307, 308}
_TEXTUAL = ("text/", "application/xhtml", "application/json", "application/xml")


class FetchError(Exception):
    """The page could not be fetched (the message is safe to show the agent)."""


@dataclass(frozen=True)
class FetchedPage:
    url: str  # after redirects
    title: str
    content: str
    truncated: bool


class PlainFetcher:
    def __init__(
        self,
        *,
        allow: tuple[str, ...] = (),
        max_bytes: int = 5_000_000,
        timeout_s: float = 20.0,
        max_redirects: int = 5,
        user_agent: str = "pbsd-tools/0.1 (+https://github.com/pbsd)",
    ) -> None:
        self.backend = GuardedNetworkBackend(allow)
        self.pool = httpcore.AsyncConnectionPool(network_backend=self.backend, max_connections=64, retries=0)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self.user_agent = user_agent

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def fetch(self, url: str) -> FetchedPage:
        try:
            return await asyncio.wait_for(self._fetch(url), timeout=self.timeout_s)
        except TimeoutError:
            raise FetchError(f"fetching {url} took longer than {self.timeout_s:.0f}s") from None
        except BlockedAddress as exc:
            raise FetchError(f"refused to fetch {url}: {exc}") from None
        except httpcore.TimeoutException:
            raise FetchError(f"fetching {url} timed out") from None
        except (httpcore.ConnectError, httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise FetchError(f"could not fetch {url}: {type(exc).__name__}: {exc}") from None

    async def _fetch(self, url: str) -> FetchedPage:
        current = url
        for _hop in range(self.max_redirects + 1):
            check_url(current)
            headers = [
                (b"User-Agent", self.user_agent.encode()),
                (b"Accept", b"text/html,text/plain;q=0.9,*/*;q=0.5"),
                (b"Accept-Encoding", b"gzip, identity"),
            ]
            async with self.pool.stream("GET", current, headers=headers) as response:
                hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in response.headers}
                if response.status in _REDIRECTS:
                    location = hdrs.get("location")
                    if not location:
                        raise FetchError(f"{current} redirected without a Location")
                    current = urljoin(current, location)
                    continue
                if response.status >= 400:
                    raise FetchError(f"{current} answered HTTP {response.status}")
                ctype = hdrs.get("content-type", "text/html").lower()
                if not ctype.startswith(_TEXTUAL):
                    raise FetchError(f"{current} is {ctype.split(';')[0]}, not a text page")
                body, truncated = await self._read_body(response, hdrs.get("content-encoding", "identity"))
            text = body.decode(_charset(ctype), errors="replace")
            if "html" in ctype:
                title, content = html_to_text(text)
            else:
                title, content = "", text
            return FetchedPage(current, title, content, truncated)
        raise FetchError(f"more than {self.max_redirects} redirects from {url}")

    async def _read_body(self, response, encoding: str) -> tuple[bytes, bool]:
        encoding = encoding.strip().lower()
        if encoding not in ("identity", "gzip", "x-gzip", ""):
            raise FetchError(f"refused content encoding {encoding!r}")
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if "gzip" in encoding else None
        chunks: list[bytes] = []
        size = 0
        async for raw in response.aiter_stream():
            data = inflater.decompress(raw, self.max_bytes - size + 1) if inflater else raw
            chunks.append(data)
            size += len(data)
            if size > self.max_bytes or (inflater and inflater.unconsumed_tail):
                return b"".join(chunks)[
                    : self.max_bytes
                ], True  # cap reached: stop reading, never inflate further
        return b"".join(chunks), False


def _charset(content_type: str) -> str:
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key == "charset" and value:
            try:
                "".encode(value.strip('"'))
                return value.strip('"')
            except LookupError:
                break
    return "utf-8"
