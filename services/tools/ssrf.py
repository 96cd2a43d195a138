"""Keeping the page reader from being turned against the network it runs in (SSRF).

Rules (after pydantic-ai's ``safe_download``):

* only ``http`` and ``https`` URLs, with a host and without credentials;
* the host is resolved here, and the connection fails if *any* address it resolves
  to is not globally routable: private, loopback, link-local (cloud metadata at
  169.254.169.254 included), CGNAT 100.64/10, reserved, multicast, unspecified, and
  the same ranges hidden in IPv6 (IPv4-mapped ``::ffff:a.b.c.d``, 6to4, Teredo, NAT64), and
  the IPv6 forms whose target depends on the network (IPv4-compatible ``::a.b.c.d``, local-use
  NAT64 ``64:ff9b:1::/48``);
* the connection goes to the address that was checked, so a DNS answer that
  changes between check and connect (rebinding) cannot slip through; TLS still
  verifies the certificate against the host name;
* literal hosts in odd notations ("2130706433", "0x7f.1", "127.1") resolve to the
  address they denote and are judged by it.

``allow`` names ``host:port`` pairs exempt from the address rules: the escape hatch
for a deliberately internal source, and how tests reach their loopback servers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

import httpcore
import httpx

__all__ = ["BlockedAddress", "GuardedNetworkBackend", "Resolver", "address_problem", "check_url"]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Refused whatever they embed (Python 3.11 calls both global): no public host uses the deprecated
# IPv4-compatible form, and a local-use NAT64 prefix reaches whatever the network maps it to.
_UNROUTED = {
    ipaddress.ip_network("::/96"): "a deprecated IPv4-compatible address (RFC 4291)",
    ipaddress.ip_network("64:ff9b:1::/48"): "in the local-use NAT64 prefix (RFC 8215)",
}


class BlockedAddress(Exception):
    """The URL or the address it resolves to is not allowed."""


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped:
        return ip.ipv4_mapped
    if ip.sixtofour:
        return ip.sixtofour
    if ip.teredo:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_problem(address: str) -> str | None:
    """Why an IP address may not be contacted, or None when it is a public unicast address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner is not None:
            problem = address_problem(str(inner))
            return f"{ip} embeds {inner}: {problem}" if problem else None
        if not (ip.is_loopback or ip.is_unspecified):  # ::1 and :: are said below as what they are
            unrouted = next((why for net, why in _UNROUTED.items() if ip in net), None)
            if unrouted:
                return f"{ip} is {unrouted}"
    if ip.is_loopback:
        return f"{ip} is a loopback address"
    if ip.is_link_local:
        return f"{ip} is link-local (cloud metadata lives here)"
    if ip.is_multicast:
        return f"{ip} is multicast"
    if ip.is_unspecified:
        return f"{ip} is unspecified"
    if ip.is_private:
        return f"{ip} is a private address"
    if not ip.is_global:
        return f"{ip} is not globally routable (reserved, CGNAT or documentation range)"
    return None


def check_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an acceptable URL; BlockedAddress otherwise. Addresses are checked at connect time."""
    try:
        parts = urlsplit(url)
        port = parts.port
        httpx.URL(url)  # what the client would refuse to send (a control character) is refused here
    except (ValueError, httpx.InvalidURL) as exc:
        raise BlockedAddress(f"malformed URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise BlockedAddress(f"only http and https URLs can be read, not {scheme or 'a relative URL'!r}")
    if not parts.hostname:
        raise BlockedAddress("the URL has no host")
    if parts.username or parts.password:
        raise BlockedAddress("URLs with credentials are not read")
    return scheme, parts.hostname, port or (443 if scheme == "https" else 80)


class Resolver:
    """``getaddrinfo`` in threads of its own, at most ``threads`` lookups at a time.

    A lookup cannot be cancelled: a slow resolver holds its thread until it answers, long after
    the read that asked has timed out. In the event loop's default executor a stream of slow
    hosts would fill every thread and stall the process's other lookups and threaded work (Redis's
    connections included); here it fills only these threads, and a lookup that finds them all
    taken fails at once. Concurrent lookups of the same host and port share one thread.
    """

    def __init__(self, threads: int = 16, lookup: Callable[..., list] = socket.getaddrinfo) -> None:
        self.threads = threads
        self._lookup = lookup
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pbsd-resolve")
        # the lookups in flight, one a thread: each leaves as its thread finishes, however late
        self._pending: dict[tuple[str, int], Future] = {}

    async def addresses(self, host: str, port: int) -> list[str]:
        """Every address ``host:port`` resolves to, in the resolver's order, without repeats."""
        key = (host.lower(), port)
        pending = self._pending.get(key)
        if pending is None:
            if len(self._pending) >= self.threads:
                raise httpcore.ConnectError(
                    f"cannot resolve {host}: all {self.threads} lookups are still waiting on slow answers"
                )
            pending = self._pool.submit(self._lookup, host, port, type=socket.SOCK_STREAM)
            self._pending[key] = pending
            pending.add_done_callback(lambda _f: self._pending.pop(key, None))
        # Shielded: a caller that gives up must not cancel a lookup others wait on. Its waiter then
        # finishes unwatched, so its outcome is taken here rather than logged as never retrieved.
        waiter = asyncio.wrap_future(pending)
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        infos = await asyncio.shield(waiter)
        return list(dict.fromkeys(info[4][0] for info in infos))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that resolves, checks, then connects to the checked address."""

    def __init__(
        self,
        allow: Iterable[str] = (),
        inner: httpcore.AsyncNetworkBackend | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.allow = {a.lower() for a in allow}
        self.inner = inner or httpcore.AnyIOBackend()
        self.resolver = resolver or Resolver()
        self.blocked = 0

    async def resolve(self, host: str, port: int) -> str:
        """The address to connect to for ``host:port``, or BlockedAddress."""
        if f"{host.lower()}:{port}" in self.allow:
            return host
        try:
            addresses = await self.resolver.addresses(host, port)
        except socket.gaierror as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from None
        for address in addresses:
            problem = address_problem(address)
            if problem:
                self.blocked += 1
                raise BlockedAddress(f"{host} resolves to {problem}")
        if not addresses:
            raise httpcore.ConnectError(f"{host} has no address")
        return addresses[0]

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        address = await self.resolve(host, port)
        return await self.inner.connect_tcp(
            address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise BlockedAddress("unix sockets are never read")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)
