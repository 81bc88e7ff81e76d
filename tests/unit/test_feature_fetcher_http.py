"""FeatureFetcher over http(s) against a local server: version checks with HEAD, retries of
transient statuses, redirect limits, and kept-alive connections."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.local_inputs import FEATURE_GRID, TINY_HIDDEN, features
from engine.feature_fetcher import FeatureFetcher
from engine.feature_jobs import FeatureJob, FetchConfig, FetchResult
from engine.feature_validation import FeatureSpec

SPEC = FeatureSpec(TINY_HIDDEN, 4, FEATURE_GRID)


class Origin:
    """A scripted HTTP/1.1 origin: per path, a list of (status, headers, body) answers
    (the last one repeats) and a delay before a GET's answer; logs (method, path, client
    port) of every request. Two headers of an answer script its body: `X-Test-Cut: N`
    sends N bytes of it and closes the connection, `X-Test-Trickle: N,S` sends it N bytes
    at a time, S seconds apart."""

    def __init__(self) -> None:
        self.answers: dict[str, list[tuple[int, dict[str, str], bytes]]] = {}
        self.log: list[tuple[str, str, int]] = []
        self.refuses_head: set[str] = set()  # paths whose HEAD is a 403 (presigned GETs)
        self.delay_s: dict[str, float] = {}  # path -> seconds before a GET is answered
        self.date: str | None = None  # the Date header of every answer; None: the clock's
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def _answer(self, with_body: bool) -> None:
                origin.log.append((self.command, self.path, self.client_address[1]))
                script = origin.answers.get(self.path, [(404, {}, b"")])
                status, headers, body = script.pop(0) if len(script) > 1 else script[0]
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                chunked = headers.get("Transfer-Encoding") == "chunked"
                if not chunked:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if with_body and chunked:  # 1 kB chunks, no declared length
                    for start in range(0, len(body), 1024):
                        piece = body[start : start + 1024]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.write(b"0\r\n\r\n")
                elif with_body and "X-Test-Cut" in headers:
                    self.wfile.write(body[: int(headers["X-Test-Cut"])])
                    self.wfile.flush()
                    self.close_connection = True
                elif with_body and "X-Test-Trickle" in headers:
                    size, pause = headers["X-Test-Trickle"].split(",")
                    for start in range(0, len(body), int(size)):
                        time.sleep(float(pause))
                        self.wfile.write(body[start : start + int(size)])
                        self.wfile.flush()
                elif with_body:
                    self.wfile.write(body)

            def date_time_string(self, timestamp=None) -> str:
                return origin.date or super().date_time_string(timestamp)

            def do_GET(self):  # noqa: N802
                time.sleep(origin.delay_s.get(self.path, 0.0))
                self._answer(True)

            def do_HEAD(self):  # noqa: N802
                if self.path in origin.refuses_head:
                    origin.log.append((self.command, self.path, self.client_address[1]))
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._answer(False)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@contextlib.contextmanager
def serving() -> Iterator[Origin]:
    """An Origin serving on a thread (other test_feature_fetcher_* files use it too)."""
    server = Origin()
    threading.Thread(target=server.httpd.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


@contextlib.contextmanager
def private_fetcher(**limits) -> Iterator[FeatureFetcher]:
    """A fetcher that may reach the local origin, with fast retries."""
    fetcher = FeatureFetcher(FetchConfig(allow_private_urls=True, backoff_s=0.01, **limits))
    try:
        yield fetcher
    finally:
        fetcher.close()


def hold_budget(fetcher: FeatureFetcher, num_bytes: int, seconds: float | None = None) -> None:
    """Takes `num_bytes` of the fetcher's byte budget, as other downloads would, and gives
    them back after `seconds` (None: never)."""
    import asyncio

    taken = asyncio.run_coroutine_threadsafe(
        fetcher._budget.acquire(num_bytes), fetcher._loop
    ).result()
    if seconds is not None:
        fetcher._loop.call_soon_threadsafe(
            fetcher._loop.call_later, seconds, fetcher._budget.release, taken
        )


def fetch(fetcher: FeatureFetcher, urls: list[str], *, force: bool = False) -> FetchResult:
    fetcher.submit("r", [FeatureJob(url, SPEC) for url in urls], force=force)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if results := fetcher.poll():
            return results[0]
        time.sleep(0.005)
    raise AssertionError("the fetch did not finish")


def test_a_known_version_is_checked_with_head_and_not_downloaded(origin, fetcher):
    first, second = features(1), features(2)
    origin.answers["/f"] = [(200, {"ETag": '"v1"'}, first)]
    url = f"{origin.base}/f"
    downloaded = fetch(fetcher, [url]).features[0]
    assert downloaded.embeds is not None
    again = fetch(fetcher, [url]).features[0]
    assert again.embeds is None and again.content_hash == downloaded.content_hash
    assert [method for method, _, _ in origin.log] == ["GET", "HEAD"]
    origin.answers["/f"] = [(200, {"ETag": '"v2"'}, second)]
    changed = fetch(fetcher, [url]).features[0]
    assert changed.embeds is not None and changed.content_hash != downloaded.content_hash
    assert [method for method, _, _ in origin.log] == ["GET", "HEAD", "HEAD", "GET"]


def test_a_server_that_refuses_head_is_read_with_get_every_time(origin, fetcher):
    """A presigned S3 GET URL refuses HEAD: the version check falls back to the download
    (before, the first request worked and every later one failed: access denied)."""
    origin.answers["/signed"] = [(200, {"ETag": '"v1"'}, features(4))]
    origin.refuses_head.add("/signed")
    url = f"{origin.base}/signed"
    first = fetch(fetcher, [url])
    again = fetch(fetcher, [url])
    assert first.error is None and again.error is None
    assert again.features[0].content_hash == first.features[0].content_hash
    assert [method for method, _, _ in origin.log] == ["GET", "HEAD", "GET"]


def test_an_invalid_s3_location_is_refused_not_retried():
    from botocore.exceptions import ParamValidationError

    from engine.feature_store import raise_s3
    from engine.feature_validation import FeatureError

    with pytest.raises(FeatureError, match="not a valid S3 location") as caught:
        raise_s3(ParamValidationError(report="Invalid bucket name 'BAD_bucket!!'"))
    assert caught.value.reason == "bad_format"  # a 400 at once; it was "connection failed"


def test_transient_statuses_are_retried(origin, fetcher):
    origin.answers["/busy"] = [(503, {}, b""), (500, {}, b""), (200, {}, features(3))]
    result = fetch(fetcher, [f"{origin.base}/busy"])
    assert result.error is None and result.features[0].embeds is not None
    assert len(origin.log) == 3


@pytest.mark.parametrize(
    ("answers", "words"),
    [
        ([(302, {"Location": "/loop"}, b"")], "more than 3 redirects"),
        ([(302, {}, b"")], "redirect without a location"),
    ],
)
def test_redirect_failures_are_http_errors_and_not_retried(origin, fetcher, answers, words):
    origin.answers["/loop"] = answers
    result = fetch(fetcher, [f"{origin.base}/loop"])
    assert result.error is not None and result.error.reason == "http_error"
    assert words in result.error.message
    assert len(origin.log) == (4 if "more than" in words else 1)


@pytest.mark.parametrize("headers", [{}, {"Transfer-Encoding": "chunked"}])
def test_bodies_over_the_cap_are_too_large(origin, headers):
    """Refused on the declared length, or while a chunked body streams in."""
    origin.answers["/big"] = [(200, headers, bytes(8192))]
    origin.answers["/fits"] = [(200, headers, features(5))]
    fetcher = FeatureFetcher(FetchConfig(allow_private_urls=True, max_bytes=4096))
    try:
        result = fetch(fetcher, [f"{origin.base}/big"])
        assert result.error is not None and result.error.reason == "too_large"
        assert fetch(fetcher, [f"{origin.base}/fits"]).error is None
    finally:
        fetcher.close()


def test_a_redirect_is_followed(origin, fetcher):
    origin.answers["/old"] = [(301, {"Location": "/new"}, b"")]
    origin.answers["/new"] = [(200, {}, features(4))]
    result = fetch(fetcher, [f"{origin.base}/old"])
    assert result.error is None and result.features[0].embeds is not None


def test_connections_are_kept_alive(origin, fetcher):
    """Object stores keep connections open; a connection per download costs the engine
    process a TCP handshake each time."""
    for i in range(4):
        origin.answers[f"/k{i}"] = [(200, {}, features(i))]
    urls = [f"{origin.base}/k{i}" for i in range(4)]
    for _ in range(3):
        assert fetch(fetcher, urls, force=True).error is None
    client_ports = {port for _, _, port in origin.log}
    assert len(origin.log) == 12 and len(client_ports) <= 4


def test_an_s3_object_is_asked_for_once_per_attempt(origin, monkeypatch):
    """botocore retried each of the fetcher's attempts once more (its `max_attempts: 1` is
    one retry): --feature-fetch-retries 0 made two GETs, the default 3 made eight."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    origin.answers["/bucket/broken"] = [(500, {}, b"")]
    config = FetchConfig(max_retries=1, backoff_s=0.01, s3_endpoint_url=origin.base)
    fetcher = FeatureFetcher(config)
    try:
        result = fetch(fetcher, ["s3://bucket/broken"])
    finally:
        fetcher.close()
    assert result.error is not None
    assert [entry[:2] for entry in origin.log] == [("GET", "/bucket/broken")] * 2


def test_s3_downloads_have_more_connections_than_one_request_uses():
    """botocore's pool of 10 was shared by every request: two requests' eight parallel
    downloads of slow objects held it, and a fast object waited seconds behind them."""
    fetcher = FeatureFetcher(FetchConfig(parallel=8))
    try:
        import asyncio

        client = asyncio.run_coroutine_threadsafe(fetcher._s3_client(), fetcher._loop).result(10)
        assert client.meta.config.max_pool_connections >= 64
    finally:
        fetcher.close()


def test_the_versions_remembered_are_bounded_oldest_first(origin):
    """One entry per URL ever fetched, its whole URL included, for the life of the process:
    distinct presigned URLs grew it without end."""
    fetcher = FeatureFetcher(FetchConfig(allow_private_urls=True, max_known_versions=2))
    try:
        urls = []
        for name in ("a", "b", "c"):
            origin.answers[f"/{name}"] = [(200, {"ETag": f'"{name}"'}, features(5))]
            urls.append(f"{origin.base}/{name}")
            assert fetch(fetcher, [urls[-1]]).error is None
        assert len(fetcher._versions) == 2
        del origin.log[:]
        fetch(fetcher, [urls[2]])  # remembered: checked with HEAD
        fetch(fetcher, [urls[0]])  # forgotten: downloaded again
        assert [method for method, _, _ in origin.log] == ["HEAD", "GET"]
    finally:
        fetcher.close()


def test_a_redirect_out_of_the_allowed_prefixes_is_not_followed(origin):
    """The prefixes were checked on the client's URL only: an allowed store's redirect to
    a file outside them was followed (fuzz15)."""
    origin.answers["/allowed/a"] = [(302, {"Location": "/secret/x"}, b"")]
    origin.answers["/allowed/b"] = [(302, {"Location": "/allowed/c"}, b"")]
    origin.answers["/allowed/c"] = [(200, {}, features(6))]
    origin.answers["/secret/x"] = [(200, {}, features(7))]
    config = FetchConfig(allow_private_urls=True, allowed_url_prefixes=(f"{origin.base}/allowed/",))
    fetcher = FeatureFetcher(config)
    try:
        refused = fetch(fetcher, [f"{origin.base}/allowed/a"])
        assert refused.error is not None and "prefix" in str(refused.error)
        assert ("GET", "/secret/x") not in [entry[:2] for entry in origin.log]
        assert fetch(fetcher, [f"{origin.base}/allowed/b"]).error is None
    finally:
        fetcher.close()


def test_a_store_that_goes_silent_mid_answer_is_a_timeout(origin):
    """Headers, then no body for longer than the timeout, while the download waited for
    room in the byte budget (its own deadline paused): aiohttp's read timer fired, and the
    download failed as a network fault (502 feature_network), where a store that does not
    answer in time is a 504 feature_timeout (fuzz75)."""
    body = features(1)
    origin.answers["/slow"] = [(200, {"X-Test-Trickle": f"{len(body)},1.5"}, body)]
    with private_fetcher(timeout_s=1.0, max_retries=0, max_bytes_in_flight=len(body)) as client:
        hold_budget(client, len(body), 0.8)
        error = fetch(client, [f"{origin.base}/slow"]).error
    assert error is not None and (error.status, error.reason) == (504, "timeout"), error
