"""A real server with `--tensor-parallel-size 2` (CPU, gloo): the engine process starts one
`engine.shard_worker` rank, answers a picture question over HTTP as the one-rank server
does (same tokens, logprobs within 1e-4) and stops with the server. When the worker is
SIGKILLed the server fails as a whole (503 `engine_dead`, exit 1, no process left) for
its supervisor to restart, rather than serving errors with a broken group; when the
engine process is, the worker exits by itself."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import time

import httpx
import pytest

from bench.datasets import data_url
from bench.local_inputs import picture, png_bytes
from bench.servers import engine_pid
from engine.process_tree import child_pids
from tests.e2e.conftest import MODEL_NAME, is_gone, run_server, stream_in_background


def _question(max_tokens: int = 12) -> dict:
    image = data_url(png_bytes(picture(120, 90, 5)), "image/png")
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": "What is in this picture?"},
        ]}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logprobs": True,
    }  # fmt: skip


def _answer(base_url: str) -> tuple[list[str], list[float]]:
    response = httpx.post(base_url + "/v1/chat/completions", json=_question(), timeout=60)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [c["logprob"] for c in content]


def _shard_workers(engine: int) -> list[int]:
    return [
        pid for pid in child_pids(engine)
        if b"engine.shard_worker" in open(f"/proc/{pid}/cmdline", "rb").read()
    ]  # fmt: skip


def _wait_gone(pid: int, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not is_gone(pid):
        assert time.monotonic() < deadline, f"{what} outlived the server"
        time.sleep(0.05)


def test_two_ranks_answer_as_one_and_stop_together(server, model_dir, tmp_path):
    tokens, logprobs = _answer(server.base_url)  # the session's one-rank server
    with run_server(model_dir, tmp_path / "tp.log", "--tensor-parallel-size", "2") as handle:
        [worker] = _shard_workers(engine_pid(handle.process.pid))
        split_tokens, split_logprobs = _answer(handle.base_url)
    assert split_tokens == tokens
    assert max(abs(a - b) for a, b in zip(split_logprobs, logprobs, strict=True)) < 1e-4
    _wait_gone(worker, "the tensor-parallel worker")  # stopped with the server


def test_a_dead_worker_fails_the_idle_server_at_once(model_dir, tmp_path):
    """Nothing watched the workers: an idle server with a dead rank answered /health with
    200 until a request came and failed on it (fuzz33). The engine now checks them on
    every pass of its loop."""
    with run_server(model_dir, tmp_path / "tp.log", "--tensor-parallel-size", "2") as handle:
        engine = engine_pid(handle.process.pid)
        [worker] = _shard_workers(engine)
        os.kill(worker, signal.SIGKILL)
        assert handle.process.wait(30) == 1, handle.log_tail()
        assert "tensor-parallel rank 1 exited (code -9)" in handle.log_tail(20000)
        _wait_gone(engine, "the engine process")


def test_a_hung_worker_is_not_left_behind_by_the_step_watchdog(model_dir, tmp_path):
    """The watchdog ends the engine with os._exit, which skipped stopping the workers: a
    stopped worker never reaches its own parent check, and outlived the server."""
    args = ["--tensor-parallel-size", "2", "--engine-step-timeout-s", "2"]
    with run_server(model_dir, tmp_path / "tp.log", *args) as handle:
        [worker] = _shard_workers(engine_pid(handle.process.pid))
        os.kill(worker, signal.SIGSTOP)
        try:
            response = httpx.post(
                handle.base_url + "/v1/chat/completions", json=_question(), timeout=60
            )
            assert response.status_code == 503, response.text
            assert handle.process.wait(30) == 1, handle.log_tail()
            _wait_gone(worker, "the stopped tensor-parallel worker")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_a_hung_worker_is_not_left_behind_by_a_shutdown(model_dir, tmp_path):
    """SIGTERM drains, then the engine, stuck in a collective with a stopped worker, is
    killed: the worker was not, and outlived the server for good (fuzz47)."""
    args = ["--tensor-parallel-size", "2", "--shutdown-timeout-s", "1"]
    with run_server(model_dir, tmp_path / "tp.log", *args) as handle:
        [worker] = _shard_workers(engine_pid(handle.process.pid))
        try:
            body = {**_question(max_tokens=2000), "stream": True}
            thread, _, started = stream_in_background(handle.base_url, body)
            assert started.wait(60)
            os.kill(worker, signal.SIGSTOP)  # mid-forward: the engine waits on it
            handle.process.send_signal(signal.SIGTERM)
            handle.process.wait(60)
            thread.join(30)
            _wait_gone(worker, "the stopped tensor-parallel worker")
            assert "did not exit; sending SIGKILL" in handle.log_tail(20000)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-forward"])
def test_a_dead_engine_process_takes_its_worker_along(model_dir, tmp_path, busy, private_tmpdir):
    """Mid-forward, the worker's collective fails (exit 1), and it left the engine's
    private folder behind too (fuzz38)."""
    with run_server(model_dir, tmp_path / "tp.log", "--tensor-parallel-size", "2",
                    env={"TMPDIR": str(private_tmpdir)}) as handle:  # fmt: skip
        engine = engine_pid(handle.process.pid)
        [worker] = _shard_workers(engine)
        tp_dirs = set(glob.glob(f"{private_tmpdir}/tessera-tp-*"))
        assert tp_dirs  # this engine's
        if busy:
            body = {**_question(max_tokens=2000), "ignore_eos": True, "stream": True}
            thread, _, started = stream_in_background(handle.base_url, body)
            assert started.wait(60)
        os.kill(engine, signal.SIGKILL)
        assert handle.process.wait(30) == 1, handle.log_tail()
        if busy:
            thread.join(30)
    _wait_gone(worker, "the tensor-parallel worker")  # its parent is gone
    # and it removed the engine's private folder, which the engine could not (fuzz33)
    assert not glob.glob(f"{private_tmpdir}/tessera-tp-*")


def test_a_size_the_model_cannot_split_stops_the_server_with_the_reason(model_dir, tmp_path):
    with pytest.raises(pytest.fail.Exception, match="tensor_parallel_size 3"):
        with run_server(model_dir, tmp_path / "tp3.log", "--tensor-parallel-size", "3"):
            pass
