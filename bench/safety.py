"""Where `tessera bench serve` may send load: loopback servers only, unless --allow-remote.

A load generator pointed at a server that is not yours is an attack, and a typo in a URL
should not make one. The host is resolved here and every address it resolves to must be a
loopback address (127.0.0.0/8, ::1).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


class BenchConfigError(Exception):
    """A bad flag, or a server the benchmark refuses to (or cannot) load. Exit status 2."""


def check_loopback(base_url: str, *, allow_remote: bool) -> None:
    """Raise BenchConfigError unless `base_url` is an http(s) URL (with a valid port, if
    any) of a loopback host."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchConfigError(f"--base-url must be an http(s) URL, got {base_url!r}")
    try:
        port = parts.port  # parsed on access: raises for "8x" or 99999
    except ValueError as exc:
        raise BenchConfigError(f"--base-url has a bad port: {base_url!r}") from exc
    if allow_remote:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, port or 80, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise BenchConfigError(f"cannot resolve host {parts.hostname!r}") from exc
    addresses = {str(info[4][0]).split("%", 1)[0] for info in infos}
    remote = sorted(a for a in addresses if not ipaddress.ip_address(a).is_loopback)
    if remote or not addresses:
        raise BenchConfigError(
            f"refusing to load {parts.hostname!r}: it resolves to non-loopback address(es) "
            f"{', '.join(remote)}; pass --allow-remote to benchmark a server you operate"
        )
