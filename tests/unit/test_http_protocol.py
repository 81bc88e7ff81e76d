"""The h11 protocol's write deadline (server/http_protocol.py), with a real uvicorn server
and a real client socket on 127.0.0.1: a client that takes nothing of its response loses
its connection; one that reads slowly but steadily gets the whole response."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import uvicorn

from server.http_protocol import timed_h11_protocol, unsent_bytes

BIG = 1 << 20  # far more than the sockets' buffers hold (below): the writer pauses


class _App:
    """Sends one big body chunk, then a small one; records how the response ended."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ended: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * self.size, "more_body": True})
        await send({"type": "http.response.body", "body": b"end", "more_body": False})
        self.ended.append("sent")  # a disconnected client's sends return at once


@contextlib.contextmanager
def _server(write_timeout_s: float, size: int = BIG):
    app = _App(size)
    listener = socket.socket()
    # Accepted sockets inherit it: a fixed 64 KiB send queue, not one autotuned to MBs.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=timed_h11_protocol(30, write_timeout_s),
                            log_config=None, lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])))
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield app, listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


def _request(port: int) -> socket.socket:
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
    client.connect(("127.0.0.1", port))
    client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return client


def test_a_client_that_takes_nothing_loses_its_connection_after_the_write_timeout():
    with _server(write_timeout_s=1) as (app, port), _request(port) as client:
        time.sleep(0.5)  # the server has written all it can
        started = time.monotonic()
        while not app.ended and time.monotonic() - started < 10:
            time.sleep(0.05)
        waited = time.monotonic() - started
        assert app.ended == ["sent"] and 0.4 < waited < 1.25 + 0.5, waited
        received = 0
        with contextlib.suppress(ConnectionResetError):  # aborted: a reset, not a close
            while data := client.recv(1 << 16):
                received += len(data)
        assert received < BIG  # the buffered rest was dropped, not waited out


def test_a_slow_steady_reader_gets_the_whole_response():
    """A few KB every 20 ms, so the big chunk takes seconds to leave against a 0.2 s
    timeout: progress is counted in bytes taken, not in sends (each of uvicorn's sends
    waits until the previous one has nearly drained)."""
    with _server(write_timeout_s=0.2) as (app, port), _request(port) as client:
        received, started = b"", time.monotonic()
        while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
            data = client.recv(64 * 1024)
            assert data, "the server closed the connection"
            received += data
            time.sleep(0.02)
        assert app.ended == ["sent"] and time.monotonic() - started > 1  # it was slow


def test_unsent_bytes_counts_the_sockets_send_queue():
    async def run() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            peer = socket.socket()
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
            peer.connect(listener.getsockname())
            ours, _ = listener.accept()
        with peer, ours:
            transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
            transport.write(b"y" * (6 * BIG))  # past loopback's autotuned send queue
            await asyncio.sleep(0.1)
            before = unsent_bytes(transport)
            peer.recv(1 << 16)
            await asyncio.sleep(0.1)
            after = unsent_bytes(transport)
            transport.abort()
        return before, after

    before, after = asyncio.run(run())
    # Nothing read yet: all of it counts, wherever it waits, but what the reader's kernel
    # has taken into its own (tiny) receive buffer.
    assert 6 * BIG - (1 << 16) <= before <= 6 * BIG
    assert after < before
