"""Real-server fixtures: a tiny checkpoint, `python -m server.cli serve` on a free port on
127.0.0.1, and a local HTTP server for image URLs. Servers are session-scoped (one shared
server for most tests) and always torn down: terminate, then kill; no orphans."""

from __future__ import annotations

import contextlib
import functools
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from bench.local_inputs import moving_pictures, picture, png_bytes, video_bytes
from bench.servers import TINY_MODEL_NAME, TINY_SERVER_FLAGS, tiny_server
from engine.tiny_model import make_tiny_model

MODEL_NAME = TINY_MODEL_NAME
API_KEY = "test-key-123"


@dataclass(frozen=True)
class ServerHandle:
    base_url: str
    process: subprocess.Popen
    model_dir: Path
    log_path: Path

    def log_tail(self, num_chars: int = 4000) -> str:
        return _tail(self.log_path, num_chars)


def _tail(log_path: Path, num_chars: int = 4000) -> str:
    return log_path.read_text(errors="replace")[-num_chars:]


@contextlib.contextmanager
def run_server(
    model_dir: Path, log_path: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[ServerHandle]:
    """`bench.servers.tiny_server` with the e2e flags and one engine thread (and `env`);
    a server that does not come up fails the test with the tail of its log."""
    with contextlib.ExitStack() as stack:
        try:
            base_url, process = stack.enter_context(
                tiny_server(
                    model_dir, log_path, *TINY_SERVER_FLAGS, *extra, engine_threads=1, env=env
                )
            )
        except RuntimeError as exc:  # exited or never healthy
            pytest.fail(f"{exc}:\n{_tail(log_path)}")
        yield ServerHandle(base_url, process, model_dir, log_path)


@pytest.fixture
def private_tmpdir() -> Iterator[Path]:
    """A temporary folder of the test's own, for a server's TMPDIR: the folders its
    processes make there are its alone, whatever other test workers' servers make in
    /tmp meanwhile. Short, as a unix socket's path must be (108 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="t-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def is_gone(pid: int) -> bool:
    """`pid` has exited; a zombie waiting for its reaper counts as exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_all_gone(pids: list[int], timeout: float) -> None:
    """Every process of `pids` exits within `timeout` s (a zombie counts as exited)."""
    deadline = time.monotonic() + timeout
    while not all(is_gone(pid) for pid in pids):
        alive = [pid for pid in pids if not is_gone(pid)]
        assert time.monotonic() < deadline, f"processes {alive} outlived the server"
        time.sleep(0.05)


def stream_in_background(
    base_url: str, body: dict
) -> tuple[threading.Thread, dict, threading.Event]:
    """POST a streaming chat request on a thread; `started` is set once a generated chunk
    (not just the role chunk, which precedes the engine) arrived. result["lines"]: the
    data lines so far (a broken stream just ends them early)."""
    started, result = threading.Event(), {"lines": []}

    def run() -> None:
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    result["lines"].append(line)
                    if len(result["lines"]) >= 2:
                        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result, started


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("e2e_model"))


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    log_path = tmp_path_factory.mktemp("logs") / "server.log"
    with run_server(model_dir, log_path) as handle:
        yield handle


@pytest.fixture(scope="session")
def keyed_server(model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    log_path = tmp_path_factory.mktemp("logs") / "keyed_server.log"
    with run_server(model_dir, log_path, "--api-key", API_KEY) as handle:
        yield handle


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as session:
        yield session


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def image_server(tmp_path_factory) -> Iterator[str]:
    """A local HTTP server on 127.0.0.1 serving test images and videos; yields its base
    URL."""
    root = tmp_path_factory.mktemp("images")
    (root / "picture.png").write_bytes(png_bytes(picture(112, 84, 1)))
    (root / "clip.mp4").write_bytes(video_bytes(moving_pictures(160, 120, 12, salt=1), fps=4))
    (root / "not_an_image.png").write_bytes(b"hello, this is text")
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
