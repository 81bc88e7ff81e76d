"""SSRF guard for every URL fetched on a client's behalf: media (server/media_fetch.py)
and pre-encoded features (engine/feature_fetcher.py).

Two layers, both needed:

* `UrlPolicy.check_url` — static checks before any socket exists: scheme allowlist
  (http, https), no userinfo or odd characters (URL-parser mismatch tricks), the
  `--allowed-media-domains` allowlist, literal IPs checked at once.
* `guarded_session` — an aiohttp session whose resolver (`GuardedResolver`) resolves the
  host ITSELF, rejects the connection if ANY resolved address is not public, and hands
  aiohttp exactly the addresses it checked to dial. Resolution and dial are one step, so
  DNS rebinding (a first answer that is public, a second that is 127.0.0.1) has nothing
  to race. aiohttp dials literal IPs without asking the resolver, which is why
  `check_url` parses with yarl, the parser aiohttp itself uses, and the caller passes on
  the URL object it returned: the checked host is the dialed host.
* `open_checked` — one GET/HEAD that follows redirects by hand, each hop through
  `check_url` again, at most `max_redirects` of them; `read_capped` reads a body under a
  byte cap (both fetchers, S3 bodies included).

aiohttp, not httpx: the feature fetcher runs in the engine process, beside its busy loop,
and an httpx AsyncClient GET of a 2 kB object cost that thread 3.4-3.8 ms of CPU against
0.55-0.75 ms with aiohttp (docs/benchmarks.md, "Pre-encoded feature downloads";
encode/httpx#3215). aiohttp is installed anyway, for aioboto3.
The session keeps no cookies: one client's URL must not set cookies that another
client's fetch then sends.

`file://` URLs are resolved by `resolve_local_path` only under `--allowed-local-media-path`.
Nothing in this module imports the server or the engine, so any fetcher can reuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

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
    # Every hop, redirects included, must start with one of these (yarl's form of the URL,
    # as fetched); None = any. The feature fetcher's `--allowed-feature-url-prefixes`.
    allowed_prefixes: tuple[str, ...] | None = None

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

    def check_url(self, url: str) -> URL:
        """Static checks of an http(s) URL; returns the parsed URL to fetch (the SAME parse
        aiohttp will use, so the checked host is the fetched host)."""
        if any(ch.isspace() or ord(ch) < 0x20 or ch == "\\" for ch in url):
            raise UnsafeUrlError("the URL contains whitespace, control characters or '\\'")
        try:
            parsed = URL(url)
        except (ValueError, TypeError):
            raise UnsafeUrlError("the URL is not valid") from None
        if parsed.scheme not in ("http", "https"):
            raise UnsafeUrlError("only http and https URLs can be fetched")
        if parsed.raw_user is not None or parsed.raw_password is not None:
            raise UnsafeUrlError("URLs with a user name or password are not allowed")
        host = (parsed.host or "").lower().rstrip(".")
        if not host:
            raise UnsafeUrlError("the URL has no host")
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise UnsafeUrlError("the URL's host is not in the allowed media domains")
        if self.allowed_prefixes is not None and not is_under_prefixes(url, self.allowed_prefixes):
            raise UnsafeUrlError("the URL is not under an allowed feature URL prefix")
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
        outside = UnsafeUrlError("the local file is not under the allowed local media path")
        try:  # symlinks followed as far as they exist
            path = Path(unquote(parts.path)).resolve()
        except (OSError, RuntimeError, ValueError):
            raise outside from None
        # Inside the root first: checked the other way round, a client could tell which
        # files exist anywhere on the server ("does not exist" against "not under").
        if not path.is_relative_to(root):
            raise outside
        if not path.is_file():
            raise UnsafeUrlError("the local file does not exist")
        return path


async def resolve_checked(host: str, port: int, *, allow_private: bool) -> list[ResolveResult]:
    """Resolve `host`; raise UnsafeUrlError if ANY answer is blocked (a mixed answer is a
    rebinding trick). Returns the addresses to dial, in resolver order."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise UnsafeUrlError("the URL's host could not be resolved") from None
    results: dict[str, ResolveResult] = {}
    for family, _, proto, _, sockaddr in infos:
        text = str(sockaddr[0])
        address = _parse_ip(text)
        if not allow_private and (address is None or is_blocked_address(address)):
            raise UnsafeUrlError("the URL points to a private or reserved address")
        results.setdefault(
            text,
            ResolveResult(hostname=host, host=text, port=port, family=family, proto=proto, flags=0),
        )
    if not results:
        raise UnsafeUrlError("the URL's host could not be resolved")
    return list(results.values())


class GuardedResolver(AbstractResolver):
    """aiohttp resolver: resolve, check every answer, return only checked addresses."""

    def __init__(self, *, allow_private: bool) -> None:
        self.allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return await resolve_checked(host, port, allow_private=self.allow_private)

    async def close(self) -> None:
        pass


def guarded_session(
    policy: UrlPolicy,
    *,
    timeout_s: float,
    max_connections: int = 256,
    max_connections_per_host: int = 64,
    total_timeout: bool = True,
    identity_encoding: bool = False,
) -> aiohttp.ClientSession:
    """A session whose every connection is SSRF-checked, with no cookie jar and no proxies
    from the environment (a proxy would dial for us, unchecked). Create it on the event
    loop that uses it; fetch through `open_checked`, which follows redirects by hand.

    `max_connections_per_host` keeps one host that hangs from taking every connection: with
    one shared limit alone, four requests of 16 URLs on such a host made every other
    host's media wait for their timeouts. `total_timeout` False: `timeout_s` bounds each
    connect and read, and the caller bounds the whole (the feature fetcher pauses its
    deadline while a download waits for room; aiohttp's own total ran on). `identity_encoding`:
    bodies as stored, never compressed (a body's declared length is then its size)."""
    connector = aiohttp.TCPConnector(
        resolver=GuardedResolver(allow_private=policy.allow_private),
        limit=max_connections,
        limit_per_host=max_connections_per_host,
    )
    if total_timeout:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
    else:
        timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=timeout,
        trust_env=False,
        headers={"Accept-Encoding": "identity"} if identity_encoding else None,
    )


_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


class RedirectError(Exception):
    """Too many redirects, or one without a Location. The message is client-safe."""


@contextlib.asynccontextmanager
async def open_checked(
    session: aiohttp.ClientSession,
    policy: UrlPolicy,
    method: str,
    url: str,
    *,
    max_redirects: int,
) -> AsyncIterator[aiohttp.ClientResponse]:
    """The first non-redirect response to `method url`, its body not yet read. Every hop
    passes `policy.check_url` and the guarded resolver. Raises UnsafeUrlError,
    RedirectError, or aiohttp.ClientError / TimeoutError from the network."""
    checked = policy.check_url(url)
    for _ in range(max_redirects + 1):
        async with session.request(method, checked, allow_redirects=False) as response:
            if response.status not in _REDIRECT_STATUSES:
                yield response
                return
            location = response.headers.get("location")
        if not location:
            raise RedirectError("redirect without a location")
        try:
            target = checked.join(URL(location))
        except (ValueError, TypeError):
            raise UnsafeUrlError("the redirect location is not valid") from None
        checked = policy.check_url(str(target))
    raise RedirectError(f"more than {max_redirects} redirects")


class BodyTooLargeError(Exception):
    """A body (declared or received) over the caller's byte cap."""


async def read_capped(
    chunks: AsyncIterable[bytes], max_bytes: int, *, declared_length: int | None = None
) -> bytes:
    """The whole body, refused up front when its declared length is over `max_bytes` and
    as soon as the bytes received pass it (a chunked or lying body is never buffered
    whole)."""
    if declared_length is not None and declared_length > max_bytes:
        raise BodyTooLargeError
    received, total = [], 0
    async for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            raise BodyTooLargeError
        received.append(chunk)
    return b"".join(received)


def as_fetched(url: str) -> str:
    """An http(s) URL as aiohttp will ask for it (yarl's form: scheme and host lower-case,
    the default port dropped, dot segments resolved, percent-encoded ones too); any other
    URL as it is (an s3:// key reaches S3 literally)."""
    if not url.lower().startswith(("http://", "https://")):
        return url
    try:
        return str(URL(url))
    except ValueError:
        return url


def is_under_prefixes(url: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `url`, as it will be fetched, starts with one of `prefixes` (in
    `as_fetched`'s form). An encoded slash or backslash in an http(s) path is refused: a
    store that decodes it could still climb out of the allowed folder."""
    if not url.lower().startswith(("http://", "https://")):
        return url.startswith(prefixes)
    try:
        parsed = URL(url)
    except ValueError:
        return False
    path = parsed.raw_path.lower()
    return "%2f" not in path and "%5c" not in path and str(parsed).startswith(prefixes)


def http_prefixes(setting: str | None) -> tuple[str, ...] | None:
    """The http(s) prefixes of a comma-separated `--allowed-feature-url-prefixes`, in
    yarl's form (what a fetched URL is compared in); None when the setting is unset."""
    if setting is None:
        return None
    prefixes = [item.strip() for item in setting.split(",")]
    return tuple(as_fetched(p) for p in prefixes if p.lower().startswith(("http://", "https://")))
