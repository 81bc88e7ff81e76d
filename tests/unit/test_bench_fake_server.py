"""`tessera bench serve` against a scripted local server: streams aiohttp's line reader
cannot read, malformed events, and the checks that end a run before any load is sent."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest

import bench.client
from bench.client import CHAT_PATH, _LineSplitter, stream_chat
from bench.serve import check_writable, main

MODEL = "m"


def sse(*events: object) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode() + b"data: [DONE]\n\n"


def token(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


class FakeServer:
    """GET /v1/models lists MODEL; every POST answers `self.stream` as an SSE body. Logs the
    path of every request."""

    def __init__(self) -> None:
        self.stream = sse(token("a"), token("b", finish="stop"), USAGE)
        self.paths: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, content_type: str, body: bytes) -> None:
                fake.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                self._send("application/json", json.dumps({"data": [{"id": MODEL}]}).encode())

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                self._send("text/event-stream", fake.stream)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    threading.Thread(target=server.httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def send_one(server: FakeServer):
    async def go():
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "stream": True}
            return await stream_chat(session, server.base_url + CHAT_PATH, body, {})

    return asyncio.run(go())


def test_lines_are_split_across_reads_at_any_length():
    lines = _LineSplitter()
    assert lines.feed(b"data: 1\r\n\r\nda") == [b"data: 1\r", b"\r"]
    assert lines.feed(b"ta: ") == [] and lines.feed(b"x" * 5) == []
    assert lines.feed(b"x\ndata: 3\n") == [b"data: " + b"x" * 6, b"data: 3"]


def test_an_event_over_aiohttp_line_limit_is_read(fake):
    """One `prompt_logprobs` event of a long prompt is megabytes on one line; aiohttp's
    readline stops at 512 KiB (LineTooLong), which once ended the whole run."""
    huge = {"choices": [], "prompt_logprobs": ["x" * 2_000_000]}
    fake.stream = sse(huge, token("a"), token("b", finish="stop"), USAGE)
    record = send_one(fake)
    assert record.is_success, record.error
    assert (record.num_prompt_tokens, record.num_output_tokens) == (3, 2)
    assert len(record.itl_s) == 1


def test_a_malformed_event_fails_its_request_not_the_run(fake, tmp_path, capsys):
    fake.stream = sse({"choices": [1]})
    out = tmp_path / "result.json"
    flags = ["--base-url", fake.base_url, "--model", MODEL, "--num-requests", "2",
             "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(flags) == 1  # none completed; the report and the JSON are still written
    assert "Serving Benchmark Result" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["summary"]["failed"] == 2
    assert all("malformed stream" in r["error"] for r in result["requests"])


def test_an_unexpected_client_error_is_a_failed_record(fake, monkeypatch):
    def broken(self, data, now):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench.client._StreamState, "on_event", broken)
    record = send_one(fake)
    assert not record.is_success
    assert record.error == "client error: RuntimeError: boom"


def test_an_unreachable_server_with_model_is_a_one_line_error(capsys):
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        code = main(["--base-url", url, "--model", MODEL, "--num-requests", "3", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip() == f"tessera bench serve: cannot reach {url}: ClientConnectorError"
    assert captured.out == ""  # no report of failed requests


def test_an_unwritable_out_is_refused_before_the_run(fake, tmp_path, capsys):
    out = tmp_path / "missing" / "result.json"
    flags = ["--base-url", fake.base_url, "--model", MODEL, "--num-requests", "1", "--no-progress",
             "--out", str(out)]  # fmt: skip
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera bench serve: cannot write --out") and "\n" not in err
    assert fake.paths == []  # no load was sent

    kept = tmp_path / "kept.json"
    kept.write_text("old")
    check_writable(kept)
    check_writable(tmp_path / "new.json")
    assert kept.read_text() == "old" and not (tmp_path / "new.json").exists()
