"""SSRF guard for every URL fetched on a client's behalf: media (server/media_fetch.py)
and pre-encoded features (engine/feature_fetcher.py).

Two layers, both needed:

* `UrlPolicy.check_url` — static checks before any socket exists: scheme allowlist
  (http, https), no userinfo or odd characters (URL-parser mismatch tricks), the
  `--allowed-media-domains` allowlist, literal IPs checked at once.
* `GuardedTransport` — an httpx transport whose network backend resolves the host ITSELF,
  rejects the connection if ANY resolved address is not public, and dials exactly the
  address it checked. Resolution and dial are one step, so DNS rebinding (a first answer
  that is public, a second that is 127.0.0.1) has nothing to race. Every redirect hop
  opens its connections through the same backend, so redirects are re-checked too.
  The Host header and TLS SNI keep the hostname (httpcore passes them separately).

`file://` URLs are resolved by `resolve_local_path` only under `--allowed-local-media-path`.
Nothing in this module imports the server or the engine, so any fetcher can reuse it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Networks `ipaddress` does not flag as non-global on every Python version.
_EXTRA_BLOCKED = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",  # "this network"; 0.0.0.0 reaches loopback on Linux
        "100.64.0.0/10",  # CGNAT
        "192.0.0.0/24",  # IETF protocol assignments
        "198.18.0.0/15",  # benchmarking
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, broadcast
        "fc00::/7",  # unique local (fd00:ec2::254 is AWS's IPv6 metadata address)
        "fe80::/10",  # link-local
        "ff00::/8",  # multicast
    )
)
# IPv6 prefixes that embed an IPv4 address in their low 32 bits (NAT64).
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class UnsafeUrlError(Exception):
    """A URL (or one of its resolved addresses) is not allowed. The message is safe to
    show to the client: it never contains the resolved addresses."""


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in net for net in _NAT64) or (
        address.packed[:12] == bytes(12) and int(address) > 1  # deprecated IPv4-compatible
    ):
        return ipaddress.IPv4Address(address.packed[-4:])
    return None


def is_blocked_address(address: IPAddress) -> bool:
    """True for loopback, private, link-local (cloud metadata), CGNAT, multicast,
    unspecified, reserved addresses, IPv6 forms that embed one of those, and every
    IPv4-mapped IPv6 address (public hosts never need one)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None and is_blocked_address(embedded):
            return True
        if address.scope_id:
            return True
    if (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
        or not address.is_global
    ):
        return True
    return any(address.version == net.version and address in net for net in _EXTRA_BLOCKED)


def _parse_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


@dataclass(frozen=True)
class UrlPolicy:
    """What the server may fetch. `allowed_domains` None = any public host."""

    allow_private: bool = False
    allowed_domains: frozenset[str] | None = None
    allowed_local_path: str | None = None

    @classmethod
    def from_strings(
        cls, *, allow_private: bool, allowed_domains: str | None, allowed_local_path: str | None
    ) -> UrlPolicy:
        domains = None
        if allowed_domains is not None:
            domains = frozenset(
                d.strip().lower().rstrip(".") for d in allowed_domains.split(",") if d.strip()
            )
        return cls(allow_private, domains, allowed_local_path or None)

    def check_url(self, url: str) -> httpx.URL:
        """Static checks of an http(s) URL; returns the parsed URL to fetch (the SAME parse
        the client will use, so the checked host is the fetched host)."""
        if any(ch.isspace() or ord(ch) < 0x20 or ch == "\\" for ch in url):
            raise UnsafeUrlError("the URL contains whitespace, control characters or '\\'")
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError, TypeError):
            raise UnsafeUrlError("the URL is not valid") from None
        if parsed.scheme not in ("http", "https"):
            raise UnsafeUrlError("only http and https URLs can be fetched")
        if parsed.userinfo:
            raise UnsafeUrlError("URLs with a user name or password are not allowed")
        host = parsed.host.lower().rstrip(".")
        if not host:
            raise UnsafeUrlError("the URL has no host")
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise UnsafeUrlError("the URL's host is not in the allowed media domains")
        literal = _parse_ip(host)
        if literal is not None and not self.allow_private and is_blocked_address(literal):
            raise UnsafeUrlError("the URL points to a private or reserved address")
        return parsed

    def resolve_local_path(self, url: str) -> Path:
        """A file:// URL -> a real path inside `allowed_local_path` (symlinks followed)."""
        if self.allowed_local_path is None:
            raise UnsafeUrlError("file:// URLs are disabled (--allowed-local-media-path)")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise UnsafeUrlError("a file:// URL must be file:///absolute/path")
        root = Path(self.allowed_local_path).resolve()
        try:
            path = Path(unquote(parts.path)).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):
            raise UnsafeUrlError("the local file does not exist") from None
        if not path.is_relative_to(root) or not path.is_file():
            raise UnsafeUrlError("the local file is not under the allowed local media path")
        return path


async def resolve_checked(host: str, port: int, *, allow_private: bool) -> list[str]:
    """Resolve `host`; raise UnsafeUrlError if ANY answer is blocked (a mixed answer is a
    rebinding trick). Returns the addresses to dial, in resolver order."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise UnsafeUrlError("the URL's host could not be resolved") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise UnsafeUrlError("the URL's host could not be resolved")
    if not allow_private:
        for text in addresses:
            address = _parse_ip(text)
            if address is None or is_blocked_address(address):
                raise UnsafeUrlError("the URL points to a private or reserved address")
    return addresses


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend: resolve, check, then dial the checked address."""

    def __init__(self, *, allow_private: bool) -> None:
        self.allow_private = allow_private
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve_checked(host, port, allow_private=self.allow_private)
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error or httpcore.ConnectError("no address to connect to")

    async def connect_unix_socket(self, *args, **kwargs) -> httpcore.AsyncNetworkStream:
        raise UnsafeUrlError("unix sockets are not allowed")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx transport that opens every connection through `GuardedBackend`; proxies from
    the environment are ignored (a proxy would dial for us, unchecked)."""

    def __init__(self, *, allow_private: bool, limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits(max_connections=32, max_keepalive_connections=8)
        super().__init__(trust_env=False, limits=limits)
        ssl_context = self._pool._ssl_context  # keep httpx's default verification context
        # httpx exposes no network_backend argument; replace its pool with an equal one.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=GuardedBackend(allow_private=allow_private),
        )


def guarded_client(
    policy: UrlPolicy, *, timeout_s: float, limits: httpx.Limits | None = None
) -> httpx.AsyncClient:
    """An AsyncClient whose every connection is SSRF-checked; redirects are NOT followed
    (callers follow them by hand, calling `policy.check_url` on each hop)."""
    return httpx.AsyncClient(
        transport=GuardedTransport(allow_private=policy.allow_private, limits=limits),
        follow_redirects=False,
        timeout=httpx.Timeout(timeout_s),
        trust_env=False,
    )
