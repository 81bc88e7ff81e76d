"""Slow and stalled clients against a real server with a 1 s read timeout and a 2 s write
timeout: connections that send nothing or half a header block are closed, a body that
stalls or trickles below the rate floor is a 408, an idle kept-alive connection lasts its
keep-alive, a client that stops reading a stream is cut off and gives its room back, and
running out of file descriptors is one log line, not a flood."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerHandle, run_server


@pytest.fixture(scope="module")
def impatient_server(model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    log_path = tmp_path_factory.mktemp("logs") / "impatient.log"
    with run_server(model_dir, log_path, "--request-read-timeout-s", "1",
                    "--write-timeout-s", "2", "--max-model-len", "4096",
                    "--max-num-seqs", "1", "--max-waiting-requests", "0") as handle:  # fmt: skip
        yield handle


@pytest.fixture(scope="module")
def impatient(impatient_server) -> str:
    return impatient_server.base_url


def _silence_after(base_url: str, sent: bytes) -> tuple[bytes, float]:
    """What the server answers a connection that sends `sent` and then nothing, and when
    (b"" once it closes the connection)."""
    host, port = base_url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(sent)
        reply = b""
        while data := sock.recv(65536):
            reply += data
    return reply, time.monotonic() - started


def test_connections_that_stall_are_closed_and_a_stalled_body_is_408(impatient):
    """Nothing, half a header block, or half a body: each held its connection forever (and
    a stalled body held every drain to its deadline)."""
    headers = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for sent in (b"", headers):
        reply, waited = _silence_after(impatient, sent)
        assert reply == b"" and waited < 8, (sent, reply, waited)
    reply, waited = _silence_after(impatient, headers + b'Content-Length: 100\r\n\r\n{"model":')
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408") and waited < 8, reply
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_body_trickled_slower_than_the_rate_floor_is_408(impatient):
    """Each byte inside the read timeout, but two a second: below the default floor of 240
    bytes a second, so it is cut once the read timeout (1 s here) has passed. It held its
    connection for as long as the client liked, and a few thousand such clients took every
    file descriptor (fuzz82)."""
    host, port = impatient.removeprefix("http://").split(":")
    body = b'{"model": "' + b"m" * 200 + b'"}'
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))  # fmt: skip
        sock.settimeout(0.5)
        reply = b""
        for byte in body:
            try:
                sock.sendall(bytes([byte]))
                reply = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset once the server has answered and closed
                break
            if reply:
                break
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                reply += data
    status, _, answer = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), reply
    assert time.monotonic() - started < 8
    error = json.loads(answer)["error"]
    assert error["code"] == "request_timeout" and "240 bytes a second" in error["message"]


def test_a_request_longer_than_the_read_timeout_is_answered_on_a_kept_alive_connection(
    impatient,
):
    """The header deadline stops once a request begins: a generation of several seconds
    is answered whole, and the connection takes the next request after a pause."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Talk."}],
            "max_tokens": 1900, "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=impatient, timeout=60) as session:
        started = time.monotonic()
        long = session.post("/v1/chat/completions", json=body)
        assert long.status_code == 200 and time.monotonic() - started > 1.0
        time.sleep(0.5)
        again = session.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert again.status_code == 200


def test_running_out_of_file_descriptors_logs_a_line_not_a_flood(impatient_server):
    """With every descriptor taken, each accept fails; CPython 3.11's loop retried it up to
    the backlog (2048) times a tick, logging a traceback each time: 300,869 tracebacks in
    30 s (fuzz82). Now a line every few seconds, and the server accepts again once the
    connections that held the descriptors are closed (here by the 1 s header deadline)."""
    host, port = impatient_server.base_url.removeprefix("http://").split(":")
    pid = impatient_server.process.pid
    log_start = impatient_server.log_path.stat().st_size
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 8, limits[1]))
    try:
        held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(40)]
        time.sleep(2.5)
        for sock in held:
            sock.close()
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    with httpx.Client(base_url=impatient_server.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
    with impatient_server.log_path.open("rb") as log:
        log.seek(log_start)
        logged = log.read().decode(errors="replace")
    assert logged.count("out of system resource") == 0, logged[-3000:]
    assert 1 <= logged.count("cannot accept connections") <= 2, logged[-3000:]


def after_a_pause(base_url: str, pause_s: float, then: bytes) -> tuple[bytes, bytes, float]:
    """On one connection: GET /health, `pause_s` of silence, then `then`; returns the first
    reply, what came after `then` (b"" once the server closed), and when it came."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole answer, body included
            first += sock.recv(65536)
        time.sleep(pause_s)
        started = time.monotonic()
        reply = b""
        with contextlib.suppress(OSError):  # a reset: closed
            sock.sendall(then)
            reply = sock.recv(65536)
        return first, reply, time.monotonic() - started


def test_a_kept_alive_connection_waits_out_its_keep_alive_not_the_read_timeout(impatient):
    """Its next request's header block has the read timeout (1 s here) from its first byte;
    the idle time before is the keep-alive's (65 s by default). The read timeout, armed at
    the previous response, closed it after 1 s: a keep-alive above the read timeout could
    not hold."""
    first, reply, _ = after_a_pause(impatient, 2.5, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and reply.startswith(b"HTTP/1.1 200"), reply
    first, reply, waited = after_a_pause(impatient, 0.2, b"GET /health HTTP/1.1\r\nHost")
    assert reply == b"" and waited < 8, (reply, waited)  # half a header block: still cut


def test_half_a_pipelined_header_block_has_the_read_timeout(impatient):
    """Sent with the request before it, it waited out the keep-alive (65 s), not the read
    timeout (1 s here) (fuzz88)."""
    host, port = impatient.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHo")
        reply = b""
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                reply += data
        waited = time.monotonic() - started
    assert reply.count(b"HTTP/1.1 200") == 1 and waited < 8, (reply, waited)


def test_a_stream_its_client_stops_reading_gives_back_its_room(impatient_server):
    """A client that asks for a stream and then reads nothing, connection open: once every
    buffer between is full its request held the server's one sequence (--max-num-seqs 1)
    for as long as the client liked, and everyone else got 503. After --write-timeout-s
    (2 s) in which it takes nothing the connection is aborted, and the stream ends."""
    base = impatient_server.base_url
    host, port = base.removeprefix("http://").split(":")
    # The first event carries 3000 prompt positions' top-20 logprobs: megabytes, more than
    # the kernel's socket buffers hold, so the next send waits on the client.
    body = json.dumps({"model": MODEL_NAME, "prompt": [100 + i % 1400 for i in range(3000)],
                       "max_tokens": 64, "ignore_eos": True, "stream": True,
                       "prompt_logprobs": 20}).encode()  # fmt: skip
    with socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
        stalled.connect((host, int(port)))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        deadline = time.monotonic() + 90  # the 3000-token prefill takes seconds here
        while True:
            other = httpx.post(base + "/v1/completions", timeout=30,
                               json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})  # fmt: skip
            if other.status_code == 200:
                break
            assert other.status_code == 503 and time.monotonic() < deadline, other.text
            time.sleep(0.5)
        # Aborted, its megabytes dropped: a close would have waited for the client to
        # read them (and a SIGTERM's drain for that connection, to its deadline).
        stalled.settimeout(10)
        with pytest.raises(ConnectionResetError):
            while stalled.recv(1 << 16):
                pass
    log = impatient_server.log_tail(20000)
    assert "took none of its response for 2 s" in log
    # named by its request id too, which its request log line carries
    line = next(line for line in log.splitlines() if "took none of its response" in line)
    request_id = line.split("(request_id=")[1].split(")")[0]
    assert f"request_id={request_id}" in log.replace(line, "")
