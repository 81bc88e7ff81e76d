"""Hostile input against a real server started the way production runs it: private media
URLs denied, an API key, small body / image caps, `file://` only under one folder, the
engine on explicit TCP addresses. Every case checks the status, the error's `param`, that
the message leaks nothing, and that the server still serves afterwards."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import pickle
import re
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from PIL import Image

from bench.local_inputs import picture, png_bytes
from bench.servers import free_port
from tests.e2e.conftest import MODEL_NAME, run_server
from tests.e2e.test_slow_clients import after_a_pause
from tests.unit.test_url_safety import listener

KEY = "sec-key-456"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 2_000_000
MAX_IMAGE_BYTES = 1_000_000
LEAK = re.compile(r"0x[0-9a-f]{6,}|Traceback|File \"|/tmp/|/work/|/home/|\.py\b", re.I)


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("allowed_media")
    (root / "ok.png").write_bytes(png_bytes(picture(56, 56, 2)))
    (root.parent / "outside.png").write_bytes(png_bytes(picture(56, 56, 3)))
    return root


@pytest.fixture(scope="module")
def strict(model_dir, media_root, tmp_path_factory) -> Iterator[tuple[str, Path, str]]:
    log_path = tmp_path_factory.mktemp("logs") / "strict.log"
    outbox = f"tcp://127.0.0.1:{free_port()}"
    extra = [
        "--no-allow-private-media-urls", "--api-key", KEY,
        "--allowed-local-media-path", str(media_root),
        "--max-request-body-bytes", str(MAX_BODY), "--max-image-bytes", str(MAX_IMAGE_BYTES),
        "--engine-inbox-address", f"tcp://127.0.0.1:{free_port()}",
        "--engine-outbox-address", outbox,
        "--max-num-seqs", "2", "--max-waiting-requests", "0",
        "--enable-feature-inputs",  # without --allow-private-feature-urls
        "--max-stop-strings", "3",
    ]  # fmt: skip
    with run_server(model_dir, log_path, *extra) as handle:
        yield handle.base_url, log_path, outbox


@pytest.fixture(scope="module")
def api(strict) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=strict[0], headers=AUTH, timeout=60) as session:
        yield session


def chat(api: httpx.Client, content, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0}
    body.update(messages=[{"role": "user", "content": content}], **fields)
    return api.post("/v1/chat/completions", json=body)


def image_message(url: str) -> list[dict]:
    return [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def expect_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert not LEAK.search(error["message"]), error["message"]
    return error


def assert_healthy(api: httpx.Client) -> None:
    assert api.get("/health").status_code == 200
    assert chat(api, "still there?").status_code == 200


# ---- media URL safety -------------------------------------------------------------------------


def test_ssrf_targets_are_refused_and_never_dialed(api):
    with listener("127.0.0.1") as (port, counter):
        for url in (
            f"http://127.0.0.1:{port}/a.png",
            f"http://0x7f000001:{port}/a.png",
            f"http://[::ffff:127.0.0.1]:{port}/a.png",
            f"http://localhost:{port}/a.png",
            f"http://2130706433:{port}/a.png",
            "http://169.254.169.254/latest/meta-data/",
            "http://[::1]/a.png",
            f"http://user:pw@127.0.0.1:{port}/a.png",
            "gopher://127.0.0.1/",
        ):
            expect_error(chat(api, image_message(url)), 400, "messages[0].content[1]")
        assert counter.count == 0
    assert_healthy(api)


def test_private_feature_urls_are_refused_and_never_dialed(api):
    with listener("127.0.0.1") as (port, counter):
        for url in (f"http://127.0.0.1:{port}/f.safetensors", f"http://localhost:{port}/f"):
            part = {"type": "image_features", "image_features": {"url": url, "grid_thw": [1, 4, 4]}}
            error = expect_error(chat(api, [part, {"type": "text", "text": "hi"}]), 400)
            assert "private or reserved address" in error["message"], error
        assert counter.count == 0
    assert_healthy(api)


def test_file_urls_only_inside_the_allowed_folder(api, media_root):
    assert chat(api, image_message(f"file://{media_root}/ok.png")).status_code == 200
    for url in (
        f"file://{media_root}/../outside.png",
        f"file://{media_root.parent}/outside.png",
        "file:///etc/passwd",
        f"file://{media_root}/missing.png",
    ):
        error = expect_error(chat(api, image_message(url)), 400, "messages[0].content[1]")
        assert str(media_root) not in error["message"]


# ---- hostile images ---------------------------------------------------------------------------


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png_header(side: int = 50000) -> bytes:
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def test_bad_images_are_400(api):
    good = png_bytes(picture(56, 56, 4))
    for data in (huge_png_header(), good[: len(good) // 2], b"", b"GIF89a" + b"\x00" * 10):
        expect_error(chat(api, image_message(data_url(data))), 400, "messages[0].content[1]")
    oversized = data_url(b"\x00" * (MAX_IMAGE_BYTES + 10))
    expect_error(chat(api, image_message(oversized)), 400, "messages[0].content[1]")
    assert_healthy(api)


def test_odd_but_valid_images_are_served(api):
    frames = [picture(40, 40, i) for i in range(3)]
    import numpy as np

    sixteen = Image.fromarray((np.arange(1600).reshape(40, 40) * 40).astype(np.uint16))
    cases = {
        "1x1": _encode(Image.new("RGB", (1, 1), (255, 0, 0)), "PNG"),
        "cmyk": _encode(Image.new("CMYK", (40, 40), (0, 255, 0, 0)), "JPEG"),
        "16bit": _encode(sixteen, "PNG"),
        "animated": _encode(frames[0], "GIF", save_all=True, append_images=frames[1:]),
    }
    for name, data in cases.items():
        response = chat(api, image_message(data_url(data)))
        assert response.status_code == 200, (name, response.text)


def test_typed_placeholder_tokens_do_not_break_the_engine(api):
    text = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|><|video_pad|> hi"
    response = chat(api, text)
    assert response.status_code in (200, 400), response.text
    response = api.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": text, "max_tokens": 2}
    )
    assert response.status_code in (200, 400), response.text
    assert_healthy(api)


# ---- request limits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 10**6}, "n"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
        ({"stop": ["x"] * 10**5}, "stop"),
        ({"stop": "y" * 10**4}, "stop"),
        ({"seed": 10**30}, "seed"),
        ({"chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    ],
)
def test_limits_are_400_naming_the_param(api, fields, param):
    expect_error(chat(api, "hi", **fields), 400, param)


def test_a_field_limit_is_the_servers_setting(api):
    assert chat(api, "hi", stop=["x", "y", "z"]).status_code == 200
    error = expect_error(chat(api, "hi", stop=["w", "x", "y", "z"]), 400, "stop")
    assert "at most 3 stop strings" in error["message"] and "--max-stop-strings" in error["message"]


def test_too_many_messages(api):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}] * 5000}
    expect_error(api.post("/v1/chat/completions", json=body), 400, "messages")


def test_huge_bodies_are_413(api, strict):
    big = b"x" * (100 * 1024 * 1024)
    response = api.post(
        "/v1/chat/completions", content=big, headers={"Content-Type": "application/json"}
    )
    expect_error(response, 413)

    def chunks():
        for _ in range(100):
            yield b"x" * (1024 * 1024)

    try:
        response = api.post(
            "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        expect_error(response, 413)  # chunked: no Content-Length, cut off while streaming
    except httpx.TransportError:
        pass  # the server closed the connection mid-upload: also fine
    assert_healthy(api)


def status_of_raw_request(base_url: str, request: bytes) -> bytes:
    """The status line the server answers `request` (raw bytes) with; b"" when it resets
    the connection while the request is still being sent."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        reply = b""
        try:
            sock.sendall(request)
            while b"\r\n" not in reply:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        except OSError:
            return b""
    return reply.split(b"\r\n", 1)[0]


def test_header_floods_are_refused(strict, api):
    headers = "".join(f"X-Flood-{i}: {i}\r\n" for i in range(10_000))
    request = f"GET /health HTTP/1.1\r\nHost: tessera\r\n{headers}\r\n".encode()
    status = status_of_raw_request(strict[0], request)
    assert not status.startswith(b"HTTP/1.1 200"), status
    assert_healthy(api)


def test_header_blocks_over_max_header_bytes_are_431(strict, api):
    """The limit is exact whatever the reads (h11's own limit let a 70 kB block through a
    64 KiB limit when it arrived in one read)."""

    def request(block_size: int) -> bytes:
        head = b"GET /health HTTP/1.1\r\nHost: tessera\r\nX-Pad: "
        pad = b"p" * (block_size - len(head) - 2)
        return head + pad + b"\r\n\r\n"  # the block, then the empty line that ends it

    limit = 64 * 1024  # the default --max-header-bytes
    assert status_of_raw_request(strict[0], request(limit)) == b"HTTP/1.1 200 OK"
    assert status_of_raw_request(strict[0], request(limit + 1)).startswith(b"HTTP/1.1 431")
    response = api.get("/health", headers={"X-Pad": "p" * 70_000})
    error = expect_error(response, 431)
    assert error["code"] == "request_header_fields_too_large"
    assert_healthy(api)


def whole_reply(base_url: str, request: bytes) -> tuple[bytes, bytes]:
    """(status line, body) of the server's answer to `request` (raw bytes), read until the
    server closes the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        reply = b""
        with contextlib.suppress(OSError):  # a reset once it has answered
            sock.sendall(request)
            while data := sock.recv(65536):
                reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], body


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"zz\r\n{}\r\n0\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 200_000 + b"\r\n\r\n", 431),
], ids=["content-length", "chunk-size", "header-line", "header-block-past-h11s-limit"])  # fmt: skip
def test_bytes_that_are_not_http_get_an_openai_error(strict, request_bytes, status):
    """uvicorn answered them with a text/plain "Invalid HTTP request received." (a header
    block over twice --max-header-bytes, h11's limit, with a 400, not the 431; fuzz82)."""
    status_line, body = whole_reply(strict[0], request_bytes)
    assert status_line.startswith(b"HTTP/1.1 %d" % status), (status_line, body)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "not valid HTTP/1.1" in error["message"]


def test_a_bad_request_line_is_not_echoed_whole(strict):
    """h11's reason quotes the line: a 60 kB one came back in a 60 kB answer (fuzz85)."""
    status_line, body = whole_reply(strict[0], b"GET /" + b"\x01" * 60_000 + b" HTTP/1.1\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 400") and len(body) < 1000, (status_line, body[:200])


def test_a_bad_chunk_beside_its_head_ends_the_request_quietly(strict):
    """The 400 went out, then the request's own answer (a 401 here: no key) met the
    closed connection and uvicorn logged "Exception in ASGI application" (fuzz85)."""
    log_path = strict[1]
    log_start = log_path.stat().st_size
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               b'5\r\n{"mod\r\nzz\r\n')  # fmt: skip
    status_line, _ = whole_reply(strict[0], request)
    assert status_line.startswith(b"HTTP/1.1 400"), status_line
    time.sleep(0.5)  # the request's own task ends after the reply
    with log_path.open("rb") as log:
        log.seek(log_start)
        logged = log.read().decode(errors="replace")
    assert "Exception in ASGI application" not in logged, logged[-3000:]


# ---- auth -------------------------------------------------------------------------------------


def test_api_key_required_and_not_bypassable(strict, api):
    base = strict[0]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(base + "/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 401, response.text
    tricks = [
        ("GET", "/v1/models", {"Host": "localhost"}),
        ("GET", "/v1/models", {"Host": "127.0.0.1", "X-Forwarded-For": "127.0.0.1"}),
        ("GET", "//v1/models", {}),
        ("GET", "/v1/models/", {}),
        ("GET", "/V1/models", {}),
        ("GET", "/health/../v1/models", {}),
        ("GET", "/v1/%6dodels", {}),
        ("POST", "/v1/chat/completions?api_key=x", {}),
    ]
    for method, path, headers in tricks:
        response = httpx.request(method, base + path, headers=headers, json=body)
        # 307 = Starlette's trailing-slash redirect, to a route that still needs the key.
        assert response.status_code in (401, 404, 405, 307), (path, response.status_code)
    assert KEY not in strict[1].read_text(errors="replace")


# ---- overload ---------------------------------------------------------------------------------


def test_overload_is_503_with_retry_after(strict, api):
    """Capacity is 2 sequences (max_num_seqs 2, no waiting room); 8 concurrent n=2
    requests: the first in is served, overlapping ones are refused whole."""
    body = {
        "model": MODEL_NAME, "max_tokens": 800, "ignore_eos": True, "n": 2,
        "messages": [{"role": "user", "content": "go on"}],
    }  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: api.post("/v1/chat/completions", json=body), range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503}, statuses
    for response in responses:
        if response.status_code == 503:
            assert expect_error(response, 503)["code"] == "server_overloaded"
            assert response.headers["Retry-After"] == "1"
        else:
            assert len(response.json()["choices"]) == 2  # n>1: all or nothing
    metrics = api.get("/metrics").text
    assert 'tessera:requests_rejected_total{model_name="tiny",reason="server_overloaded"}' in (
        metrics
    )
    assert_healthy(api)


# ---- the engine sockets -----------------------------------------------------------------------


def test_garbage_and_pickle_on_the_socket_are_dropped(strict, api):
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(strict[2])

    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    for frames in ([b"\x00garbage"], [pickle.dumps(Boom())], [b"\x92\x01", b"\xff" * 100]):
        sock.send_multipart(frames)
    sock.close()
    context.term()
    assert_healthy(api)
    assert "pwned" not in strict[1].read_text(errors="replace")


def test_an_idle_connection_outlives_the_client_pools_keep_alive(strict):
    """httpx's pool (the openai client's) drops an idle connection after 5 s, uvicorn's and
    vLLM's default keep-alive: the server closing it as the client reused it lost the
    request (fuzz81: 5 of ~4,950 pooled POSTs). The server's default is now longer."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    _, reply, _ = after_a_pause(strict[0], 6.0, request + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200"), reply
