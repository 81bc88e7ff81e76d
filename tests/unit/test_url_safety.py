"""SSRF guard: address classes, static URL checks, file:// containment, and the guarded
transport against local listeners that count connections (loopback only)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine import url_safety
from engine.errors import MediaError
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.url_safety import UnsafeUrlError, UrlPolicy, is_blocked_address, resolve_checked
from server.media_fetch import MediaFetchConfig, MediaFetcher

BLOCKED = [
    "127.0.0.1",
    "127.1.2.3",
    "0.0.0.0",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",
    "100.64.0.1",
    "224.0.0.1",
    "239.255.255.250",
    "255.255.255.255",
    "240.0.0.1",
    "::1",
    "::",
    "::ffff:127.0.0.1",
    "::ffff:169.254.169.254",
    "fe80::1",
    "fd00:ec2::254",
    "ff02::1",
    "64:ff9b::7f00:1",
    "2002:7f00:1::",
    "::127.0.0.1",
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"]  # IPv4-mapped: always blocked


@pytest.mark.parametrize("text", BLOCKED)
def test_blocked_addresses(text):
    assert is_blocked_address(ipaddress.ip_address(text))


@pytest.mark.parametrize("text", PUBLIC)
def test_public_addresses(text):
    assert not is_blocked_address(ipaddress.ip_address(text))


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/a.png",
        "gopher://x/",
        "file:///etc/passwd",
        "http://u:p@example.com/",
        "http://example.com\\@127.0.0.1/",
        "http://exa mple.com/",
        "http://127.0.0.1/a.png",
        "http://[::ffff:127.0.0.1]/",
        "http://169.254.169.254/latest/meta-data/",
        "http:///x",
        "http://[::1]:8000/",
    ],
)
def test_check_url_rejects(url):
    with pytest.raises(UnsafeUrlError):
        UrlPolicy().check_url(url)


def test_domain_allowlist():
    policy = UrlPolicy.from_strings(
        allow_private=False,
        allowed_domains="images.example.com, cdn.example.org",
        allowed_local_path=None,
    )
    assert (
        policy.check_url("https://IMAGES.example.com./a.png").host.rstrip(".")
        == "images.example.com"
    )
    with pytest.raises(UnsafeUrlError, match="allowed media domains"):
        policy.check_url("https://evil.example.com/a.png")


@pytest.mark.parametrize("host", ["0x7f000001", "2130706433", "127.1", "localhost", "0"])
def test_resolution_tricks_are_blocked(host):
    with pytest.raises(UnsafeUrlError, match="private"):
        asyncio.run(resolve_checked(host, 80, allow_private=False))


def test_mixed_dns_answer_is_blocked(monkeypatch):
    async def fake_getaddrinfo(host, port, **kwargs):
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
            for ip in ("8.8.8.8", "127.0.0.1")
        ]

    loop = asyncio.new_event_loop()
    monkeypatch.setattr(loop, "getaddrinfo", fake_getaddrinfo)
    with pytest.raises(UnsafeUrlError):
        loop.run_until_complete(resolve_checked("rebind.test", 80, allow_private=False))
    loop.close()


def test_file_urls_stay_inside_the_root(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(b"x")
    (tmp_path / "secret.txt").write_text("s")
    (root / "link.png").symlink_to(tmp_path / "secret.txt")
    policy = UrlPolicy(allowed_local_path=str(root))
    assert policy.resolve_local_path(f"file://{root}/ok.png") == (root / "ok.png").resolve()
    for url in (
        f"file://{root}/../secret.txt",
        f"file://{root}/link.png",
        f"file://{root}/%2e%2e/secret.txt",
        f"file://{root}/missing.png",
        f"file://otherhost{root}/ok.png",
        "file:///etc/passwd",
    ):
        with pytest.raises(UnsafeUrlError):
            policy.resolve_local_path(url)
    with pytest.raises(UnsafeUrlError, match="disabled"):
        UrlPolicy().resolve_local_path(f"file://{root}/ok.png")


def test_a_file_url_outside_the_root_never_tells_whether_the_file_exists(tmp_path):
    """A missing file said "does not exist" and an existing one "not under the allowed
    local media path": a probe of any path on the server (fuzz60)."""
    root = tmp_path / "media"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("s")
    policy = UrlPolicy(allowed_local_path=str(root))
    messages = set()
    for name in ("secret.txt", "no-such-file.txt"):
        with pytest.raises(UnsafeUrlError) as refused:
            policy.resolve_local_path(f"file://{tmp_path}/{name}")
        messages.add(str(refused.value))
    assert messages == {"the local file is not under the allowed local media path"}
    with pytest.raises(UnsafeUrlError, match="does not exist"):  # inside the root, it may say
        policy.resolve_local_path(f"file://{root}/missing.png")


class _Counter:
    def __init__(self) -> None:
        self.count = 0
        self.cookies: list[str | None] = []  # the Cookie header of every request


@contextlib.contextmanager
def listener(address: str, redirect_to: str | None = None) -> Iterator[tuple[int, _Counter]]:
    """An HTTP server on `address` counting requests; answers 302 -> redirect_to, or 200
    with a Set-Cookie."""
    counter = _Counter()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            counter.count += 1
            counter.cookies.append(self.headers.get("Cookie"))
            if redirect_to:
                self.send_response(302)
                self.send_header("Location", redirect_to)
                self.end_headers()
            else:
                self.send_response(200)
                self.send_header("Set-Cookie", "session=secret; Path=/")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((address, 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], counter
    finally:
        httpd.shutdown()
        httpd.server_close()


def _fetcher(**changes) -> MediaFetcher:
    return MediaFetcher(MediaFetchConfig(timeout_s=5.0, **changes), ImageProcessorConfig())


async def _fetch(fetcher: MediaFetcher, url: str) -> bytes:
    try:
        return await fetcher.fetch_url_bytes(url, param="messages[0].content[0]")
    finally:
        await fetcher.aclose()


def test_loopback_listener_sees_zero_connections():
    with listener("127.0.0.1") as (port, counter):
        for host in ("127.0.0.1", "0x7f000001", "localhost", "[::ffff:127.0.0.1]"):
            with pytest.raises(MediaError) as info:
                asyncio.run(_fetch(_fetcher(), f"http://{host}:{port}/a.png"))
            assert info.value.param == "messages[0].content[0]"
            assert "127.0.0.1" not in info.value.message
        assert counter.count == 0
        # The test-only switch lets loopback through.
        assert (
            asyncio.run(_fetch(_fetcher(allow_private_urls=True), f"http://127.0.0.1:{port}/a.png"))
            == b"ok"
        )
        assert counter.count == 1


def test_redirect_to_loopback_is_blocked(monkeypatch):
    """An "allowed public host" (127.0.0.2, whitelisted for this test only) redirects to
    127.0.0.1: the redirect is followed through the guard and refused."""
    real = url_safety.is_blocked_address
    allowed = ipaddress.ip_address("127.0.0.2")
    monkeypatch.setattr(url_safety, "is_blocked_address", lambda a: a != allowed and real(a))
    with listener("127.0.0.1") as (target_port, target):
        target_url = f"http://localhost:{target_port}/a.png"
        with listener("127.0.0.2", redirect_to=target_url) as (port, redirector):
            with pytest.raises(MediaError, match="private"):
                asyncio.run(_fetch(_fetcher(), f"http://127.0.0.2:{port}/a.png"))
            assert redirector.count == 1
        assert target.count == 0


def test_redirect_hops_are_bounded():
    with listener("127.0.0.1", redirect_to="/again") as (port, counter):
        with pytest.raises(MediaError, match="redirects"):
            asyncio.run(
                _fetch(
                    _fetcher(allow_private_urls=True, max_redirects=2),
                    f"http://127.0.0.1:{port}/start",
                )
            )
        assert counter.count == 3


def test_cookies_set_by_one_fetch_are_not_sent_by_the_next():
    """The fetch session is shared by all clients' requests: a cookie that one client's
    URL sets must not travel with another client's fetch (httpx's client kept a jar)."""

    async def twice(url: str) -> None:
        fetcher = _fetcher(allow_private_urls=True)
        try:
            for _ in range(2):
                assert await fetcher.fetch_url_bytes(url, param="p") == b"ok"
        finally:
            await fetcher.aclose()

    with listener("127.0.0.1") as (port, counter):
        asyncio.run(twice(f"http://127.0.0.1:{port}/a.png"))
    assert counter.cookies == [None, None]


@contextlib.contextmanager
def hanging_listener() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        server.close()


def test_a_host_that_hangs_cannot_take_every_connection():
    """Media fetches share one connection pool. Without a limit a host, requests of many
    URLs on a host that never answers held every connection, and other hosts' media waited
    for their timeouts."""
    with hanging_listener() as stuck_port, listener("127.0.0.1") as (port, _):

        async def scenario() -> float:
            fetcher = _fetcher(allow_private_urls=True, max_connections=4,
                               max_connections_per_host=2)  # fmt: skip
            stuck = [asyncio.create_task(fetcher.fetch_url_bytes(
                f"http://127.0.0.1:{stuck_port}/{i}.png", param="p")) for i in range(4)]  # fmt: skip
            await asyncio.sleep(0.3)  # two connect and hang; two wait for that host's slots
            started = time.monotonic()
            try:
                fetched = await fetcher.fetch_url_bytes(f"http://127.0.0.1:{port}/a", param="p")
                assert fetched == b"ok"
                return time.monotonic() - started
            finally:
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
                await fetcher.aclose()

        assert asyncio.run(scenario()) < 2.0


def test_a_burst_of_media_from_one_host_is_fetched_at_once():
    """40 images of one request burst from one (healthy) host: with 16 connections a host
    they queued in three waves, and the wait counted against each fetch's deadline (a 400
    "took longer than" for a third of them). The default allows 64."""

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            time.sleep(0.5)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 64  # socketserver's 5 would queue the burst in the kernel

    httpd = Server(("127.0.0.1", 0), Slow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]

    async def scenario() -> list[bytes]:
        fetcher = MediaFetcher(MediaFetchConfig(timeout_s=1.2, allow_private_urls=True),
                               ImageProcessorConfig())  # fmt: skip
        try:
            return await asyncio.gather(*(fetcher.fetch_url_bytes(
                f"http://127.0.0.1:{port}/{i}.png", param="p") for i in range(40)))  # fmt: skip
        finally:
            await fetcher.aclose()

    try:
        assert asyncio.run(scenario()) == [b"ok"] * 40
    finally:
        httpd.shutdown()
        httpd.server_close()
