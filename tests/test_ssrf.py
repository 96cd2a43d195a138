"""The SSRF guard: address rules, URL rules, and the fetcher against real loopback servers."""

from __future__ import annotations

import time

import pytest

from services.tools.fetch import FetchError, PlainFetcher
from services.tools.ssrf import BlockedAddress, address_problem, check_url
from tests.servers import serve
from tests.web_fakes import make_site


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "100.100.100.200",
        "0.0.0.0",
        "224.0.0.1",
        "192.0.2.1",
        "198.18.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fd00:ec2::254",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.1",  # IPv4-mapped
        "2002:7f00:1::1",
        "2002:a9fe:a9fe::1",  # 6to4 around 127.0.0.1 and 169.254.169.254
        "64:ff9b::a00:1",  # NAT64 around 10.0.0.1
        "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo whose client is 127.0.0.1
        "::7f00:1",
        "::8.8.8.8",  # IPv4-compatible (deprecated), which Python 3.11 calls global
        "64:ff9b:1::7f00:1",
        "64:ff9b:1:a00:1::",  # local-use NAT64, the same
    ],
)
def test_internal_addresses_are_refused(address):
    assert address_problem(address) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address):
    assert address_problem(address) is None


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/passwd", "only http and https"),
        ("ftp://example.org/x", "only http and https"),
        ("javascript:alert(1)", "only http and https"),
        ("gopher://127.0.0.1:6379/_INFO", "only http and https"),
        ("http:///path-only", "no host"),
        ("http://user:pw@example.org/", "credentials"),
        ("http://example.org:99999/", "malformed"),
    ],
)
def test_url_rules(url, reason):
    with pytest.raises(BlockedAddress, match=reason):
        check_url(url)


@pytest.fixture(scope="module")
def sites():
    with serve(make_site()) as other, serve(make_site(other_base=other)) as site:
        yield site, other


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


@pytest.mark.parametrize(
    "form",
    ["127.0.0.1", "localhost", "2130706433", "0x7f.1", "127.1", "[::ffff:127.0.0.1]", "017700000001"],
)
async def test_fetch_refuses_loopback_in_every_notation(sites, form):
    site, _ = sites
    fetcher = PlainFetcher(timeout_s=5)
    try:
        with pytest.raises(FetchError, match="refused"):
            await fetcher.fetch(f"http://{form}:{_port(site)}/page")
    finally:
        await fetcher.aclose()
    assert fetcher.backend.blocked >= 1


async def test_allowed_host_is_fetched_and_html_is_read(sites):
    site, _ = sites
    fetcher = PlainFetcher(allow=(f"127.0.0.1:{_port(site)}",), timeout_s=5)
    try:
        page = await fetcher.fetch(f"{site}/redirect-here")  # a redirect within the allowed host is followed
    finally:
        await fetcher.aclose()
    assert page.title == "Vienna" and page.url.endswith("/page")
    assert "The Danube flows through Vienna." in page.content
    assert "var x" not in page.content and "menu" not in page.content  # scripts and navigation dropped


async def test_redirect_to_another_loopback_port_is_refused(sites):
    site, _other = sites
    fetcher = PlainFetcher(allow=(f"127.0.0.1:{_port(site)}",), timeout_s=5)
    try:
        with pytest.raises(FetchError, match=r"refused.*loopback"):
            await fetcher.fetch(f"{site}/redirect-away")  # the hop to {other} is checked again
    finally:
        await fetcher.aclose()


async def test_caps_on_redirects_size_time_type_and_encoding(sites):
    site, _ = sites
    fetcher = PlainFetcher(
        # a generous timeout: on a loaded 2-core machine inflating the bomb's first 100 kB can take >1 s
        allow=(f"127.0.0.1:{_port(site)}",),
        timeout_s=10.0,
        max_bytes=100_000,
        max_redirects=3,
    )
    try:
        with pytest.raises(FetchError, match="more than 3 redirects"):
            await fetcher.fetch(f"{site}/redirect-loop")
        bomb = await fetcher.fetch(f"{site}/bomb")  # 50 MB of gzip-compressed text
        assert bomb.truncated and len(bomb.content) == 100_000
        # once read to the 10 s timeout (bytes after a gzip member, or empty blocks, inflate to
        # nothing, so the cap never came), holding every byte sent and copying it at each chunk
        started = time.monotonic()
        page = await fetcher.fetch(f"{site}/gzip-then-more")
        assert page.content == "The Danube flows through Vienna." and not page.truncated
        empty = await fetcher.fetch(f"{site}/gzip-empty-blocks")
        assert empty.truncated and empty.content == ""
        assert time.monotonic() - started < 5
        fetcher.timeout_s = 0.5  # /slow answers after 5 s
        with pytest.raises(FetchError, match="longer than"):
            await fetcher.fetch(f"{site}/slow")
        fetcher.timeout_s = 4.0
        with pytest.raises(FetchError, match="not a text page"):
            await fetcher.fetch(f"{site}/file.pdf")
        with pytest.raises(FetchError, match="content encoding"):
            await fetcher.fetch(f"{site}/brotli")
    finally:
        await fetcher.aclose()


class _SlowDns:
    """A getaddrinfo that answers only when told to, counting the lookups that reach it."""

    def __init__(self) -> None:
        import threading

        self.answer = threading.Event()
        self.asked: list[str] = []

    def __call__(self, host, port, type=0):
        self.asked.append(host)
        self.answer.wait(10)
        return [(2, 1, 6, "", ("93.184.215.14", port))]


async def test_slow_lookups_hold_only_the_resolvers_threads_and_the_next_fails_at_once():
    """A slow resolver keeps its thread past the read's timeout. In the loop's default executor a
    stream of slow hosts filled every thread, stalling the process's other threaded work; the
    resolver's own threads are bounded, and a lookup that finds them all waiting fails at once."""
    import asyncio

    import httpcore

    from services.tools.ssrf import Resolver

    dns = _SlowDns()
    resolver = Resolver(threads=2, lookup=dns)
    try:
        for host in ("a.example", "b.example"):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await resolver.addresses(host, 443)
        started = time.monotonic()
        with pytest.raises(httpcore.ConnectError, match="all 2 lookups are still waiting"):
            await resolver.addresses("c.example", 443)
        assert time.monotonic() - started < 1
        assert dns.asked == ["a.example", "b.example"]
        # the loop's default executor is untouched
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 2) == 7
        dns.answer.set()
        for _ in range(100):  # the threads finish and give their slots back
            try:
                assert await resolver.addresses("c.example", 443) == ["93.184.215.14"]
                break
            except httpcore.ConnectError:
                await asyncio.sleep(0.02)
        else:
            raise AssertionError("the slots were never given back")
    finally:
        dns.answer.set()
        resolver.close()


async def test_concurrent_lookups_of_one_host_share_a_thread_and_one_giving_up_leaves_the_rest():
    import asyncio

    from services.tools.ssrf import Resolver

    dns = _SlowDns()
    resolver = Resolver(threads=1, lookup=dns)
    try:
        waiting = [asyncio.create_task(resolver.addresses("Same.example", 80)) for _ in range(5)]
        await asyncio.sleep(0.05)
        waiting[0].cancel()
        dns.answer.set()
        rest = await asyncio.wait_for(asyncio.gather(*waiting[1:]), 5)
        assert rest == [["93.184.215.14"]] * 4
        assert dns.asked == ["Same.example"]
    finally:
        dns.answer.set()
        resolver.close()
