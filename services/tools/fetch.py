"""The plain HTTP page fetcher: the fallback when Jina Reader cannot read a page.

Everything an agent-chosen URL could abuse is bounded here: the SSRF guard on every
connection (:mod:`services.tools.ssrf`), redirects followed by hand (at most
``max_redirects``, each hop's URL checked again), a byte cap on the *decoded* body
(so a gzip bomb stops at the cap instead of filling memory), only identity and gzip
encodings accepted, and one deadline for the whole fetch. Whatever else a page provokes
(a charset Python cannot decode with, a corrupt gzip stream, a non-ASCII URL or redirect)
is a :class:`FetchError` with its cause: an unsuccessful read for the agent, never a crash.
Decoding and HTML to text run in the gateway's CPU pool, in time linear in the page.
"""

from __future__ import annotations

import asyncio
import codecs
import encodings
import encodings.aliases
import pkgutil
import zlib
from dataclasses import dataclass
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

import httpcore

from services.tools.cpu import CpuPool
from services.tools.html_text import html_to_text
from services.tools.ssrf import BlockedAddress, GuardedNetworkBackend, Resolver, check_url

__all__ = ["AddressRefused", "EncodingRefused", "FetchError", "FetchedPage", "PlainFetcher", "ascii_url"]

_REDIRECTS = {301, 302, 303, 307, 308}
_TEXTUAL = ("text/", "application/xhtml", "application/json", "application/xml")
# text codecs that raise on any page (idna, undefined) or decode in pure Python (punycode)
_UNFIT_CHARSETS = frozenset({"idna", "punycode", "undefined"})
# what percent-encoding leaves alone: every reserved character, and existing escapes
_URL_SAFE = "/:?#[]@!$&'()*+,;=%~"


class FetchError(Exception):
    """The page could not be fetched (the message is safe to show the agent)."""


class AddressRefused(FetchError):
    """The SSRF guard refused the URL or an address it resolves to."""


class EncodingRefused(FetchError):
    """The page came in a content encoding the reader does not decode."""


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
        cpu: CpuPool | None = None,
        resolver_threads: int = 16,
    ) -> None:
        self.cpu = cpu or CpuPool()
        self.backend = GuardedNetworkBackend(allow, resolver=Resolver(resolver_threads))
        self.pool = httpcore.AsyncConnectionPool(network_backend=self.backend, max_connections=64, retries=0)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self.user_agent = user_agent

    async def aclose(self) -> None:
        await self.pool.aclose()
        self.backend.resolver.close()

    async def fetch(self, url: str) -> FetchedPage:
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that comes
            # as the fetch completes (CPython gh-86296), and the request it belonged to runs on
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url)
        except FetchError:
            raise
        except TimeoutError:
            raise FetchError(f"fetching {url} took longer than {self.timeout_s:.0f}s") from None
        except BlockedAddress as exc:
            raise AddressRefused(f"refused to fetch {url}: {exc}") from None
        except httpcore.TimeoutException:
            raise FetchError(f"fetching {url} timed out") from None
        except (httpcore.ConnectError, httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise FetchError(f"could not fetch {url}: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # anything else a hostile server can provoke
            raise FetchError(f"could not read {url}: {type(exc).__name__}: {exc}") from None

    async def _fetch(self, url: str) -> FetchedPage:
        current = ascii_url(url)
        for _hop in range(self.max_redirects + 1):
            check_url(current)
            headers = [
                (b"User-Agent", self.user_agent.encode()),
                (b"Accept", b"text/html,text/plain;q=0.9,*/*;q=0.5"),
                (b"Accept-Encoding", b"gzip, identity"),
            ]
            async with self.pool.stream("GET", current, headers=headers) as response:
                raw = {k.lower(): v for k, v in response.headers}
                if response.status in _REDIRECTS:
                    location = raw.get(b"location")
                    if not location:
                        raise FetchError(f"{current} redirected without a Location")
                    # servers send UTF-8 here as often as ASCII, as browsers assume
                    current = ascii_url(urljoin(current, location.decode("utf-8", errors="replace")))
                    continue
                if response.status >= 400:
                    raise FetchError(f"{current} answered HTTP {response.status}")
                ctype = raw.get(b"content-type", b"text/html").decode("latin-1").lower()
                if not ctype.startswith(_TEXTUAL):
                    raise FetchError(f"{current} is {ctype.split(';')[0]}, not a text page")
                encoding = raw.get(b"content-encoding", b"identity").decode("latin-1")
                body, truncated = await self._read_body(response, current, encoding)
            title, content = await self.cpu.run(_page_text, body, ctype)
            return FetchedPage(current, title, content, truncated)
        raise FetchError(f"more than {self.max_redirects} redirects from {url}")

    async def _read_body(self, response, url: str, encoding: str) -> tuple[bytes, bool]:
        encoding = encoding.strip().lower()
        if encoding not in ("identity", "gzip", "x-gzip", ""):
            raise EncodingRefused(f"refused content encoding {encoding!r} from {url}")
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if "gzip" in encoding else None
        chunks: list[bytes] = []
        size = sent = 0
        async for raw in response.aiter_stream():
            try:
                data = inflater.decompress(raw, self.max_bytes - size + 1) if inflater else raw
            except zlib.error as exc:
                raise FetchError(f"{url} sent a corrupt gzip body ({exc})") from None
            chunks.append(data)
            size, sent = size + len(data), sent + len(raw)
            # the sent bytes are capped too: gzip's empty blocks inflate to nothing, endlessly
            if size > self.max_bytes or sent > self.max_bytes or (inflater and inflater.unconsumed_tail):
                # cap reached: stop reading, never inflate further
                return b"".join(chunks)[: self.max_bytes], True
            if inflater and inflater.eof:  # the page ends with its gzip member, whatever follows
                break
        return b"".join(chunks), False


def ascii_url(url: str) -> str:
    """``url`` as it goes on the wire: an internationalised host in IDNA, any other non-ASCII
    character and spaces percent-encoded as UTF-8, as browsers send them."""
    if url.isascii() and " " not in url:
        return url
    parts = urlsplit(url.strip())
    netloc = parts.netloc
    host = parts.hostname or ""
    if not host.isascii():
        try:
            netloc = host.encode("idna").decode("ascii") + (f":{parts.port}" if parts.port else "")
        except UnicodeError as exc:
            raise FetchError(f"{url} has a host name that cannot be encoded ({exc})") from None
    path, query, fragment = (quote(p, safe=_URL_SAFE) for p in (parts.path, parts.query, parts.fragment))
    return urlunsplit((parts.scheme, netloc, path, query, fragment))


def _page_text(body: bytes, content_type: str) -> tuple[str, str]:
    """(title, text) of a page's bytes: CPU-bound, linear in the body."""
    text = body.decode(_charset(content_type), errors="replace")
    return html_to_text(text) if "html" in content_type else ("", text)


# the names Python's codec search knows (its aliases and the codec modules): it caches every name
# it is asked for, found or not, so only these are ever looked up
_KNOWN_CHARSETS = frozenset(encodings.aliases.aliases) | {
    m.name for m in pkgutil.iter_modules(encodings.__path__)
}


def _known_charset(name: str) -> bool:
    if len(name) > 64:
        return False
    key = encodings.normalize_encoding(name.lower())
    return key in _KNOWN_CHARSETS or key.replace(".", "_") in _KNOWN_CHARSETS


def _charset(content_type: str) -> str:
    """The declared charset when Python decodes pages with it, else UTF-8 (as browsers fall back)."""
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key != "charset" or not value:
            continue
        name = value.strip("\"' ")
        # a name Python does not know is never looked up: each hostile page would leave one in the
        # codec registry's cache for good
        if not _known_charset(name):
            break
        try:
            codec = codecs.lookup(name)
            if codec.name in _UNFIT_CHARSETS:
                break
            "".encode(codec.name)  # LookupError for the bytes-to-bytes codecs (base64, zlib, ...)
        except (LookupError, UnicodeError):
            break
        return codec.name
    return "utf-8"
