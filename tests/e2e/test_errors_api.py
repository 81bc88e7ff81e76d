"""Every error is `{"error": {message, type, param, code}}` with the right status; bad
input never gets a 5xx; an engine death is a 503 and an error event, never a hang."""

from __future__ import annotations

import base64
import os
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, run_server

TEXT = [{"role": "user", "content": "hi"}]


def post(http, body, path="/v1/chat/completions"):
    return http.post(path, json=body)


def assert_error(response, status, code=None, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def chat(**fields):
    return {"model": MODEL_NAME, "messages": TEXT, "max_tokens": 2, **fields}


def image(url):
    return [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]


def test_unknown_model(http):
    assert_error(post(http, chat(model="gpt-17")), 404, "model_not_found", "model")
    body = {"model": "gpt-17", "prompt": "x"}
    assert_error(post(http, body, "/v1/completions"), 404, "model_not_found", "model")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
         "messages[0].content[0]"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ],
)
def test_invalid_values_are_400_with_param(http, fields, param):
    assert_error(post(http, chat(**fields)), 400, param=param)


def test_missing_model_field_and_bad_json(http):
    assert_error(post(http, {"messages": TEXT}), 400, param="model")
    response = http.post("/v1/chat/completions", content=b"{oops",
                         headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_context_length_exceeded(http):
    error = assert_error(post(http, chat(max_tokens=5000)), 400, "context_length_exceeded")
    assert "2048" in error["message"] and "5000" in error["message"]
    long_prompt = "word " * 3000
    error = assert_error(
        post(http, {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 10},
             "/v1/completions"), 400, "context_length_exceeded")
    assert "2048" in error["message"]


def test_bad_images_name_the_part(http, image_server):
    cases = [
        "data:image/png;base64," + base64.b64encode(b"not a png").decode(),
        "data:image/png;base64,!!!!",
        image_server + "/missing.png",
        image_server + "/not_an_image.png",
        "ftp://127.0.0.1/x.png",
        "http://127.0.0.1:1/unreachable.png",
    ]
    for url in cases:
        assert_error(post(http, chat(messages=image(url))), 400, "invalid_media",
                     "messages[0].content[1]")


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_engine_death(model_dir, tmp_path):
    """Kill the engine process mid-stream: the stream ends with an error event, /health is
    503 (or the server is gone, as the CLI exits non-zero on engine death)."""
    with run_server(model_dir, tmp_path / "dying.log") as server:
        body = {**chat(max_tokens=1900, ignore_eos=True, temperature=0), "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=30) as session:
            engine_pid = _engine_pid(server.process.pid)
            with session.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                for _ in range(4):
                    next(lines)
                os.kill(engine_pid, signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert '"error"' in rest[-2] and "engine_dead" in rest[-2]
            try:
                health = session.get("/health")
                assert health.status_code == 503
            except httpx.TransportError:
                pass  # already exited, as it should
        deadline = time.monotonic() + 20
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.process.returncode not in (None, 0)


def _engine_pid(server_pid: int) -> int:
    children = open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()
    for child in children:
        cmdline = open(f"/proc/{child}/cmdline", "rb").read()
        if b"spawn_main" in cmdline:  # not the resource tracker
            return int(child)
    raise AssertionError(f"no engine child process among {children}")
