"""The request log of a real server started with `--log-format json --api-key ...`: one JSON
line per request with id, route, status, tokens and latency; the id comes from a sane
`x-request-id` header (else a generated one) and is returned in the response header; no API
key ever reaches the log; uvicorn's own access line is gone."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, run_server

SECRET = "sk-very-secret-key-4711"
WRONG_SECRET = "sk-wrong-guess-0815"


@pytest.fixture(scope="module")
def logged(model_dir, tmp_path_factory):
    """(HTTP client with the API key, path of the server's captured stderr)."""
    log_path = tmp_path_factory.mktemp("logs") / "json_server.log"
    with run_server(model_dir, log_path, "--log-format", "json", "--api-key", SECRET) as handle:
        headers = {"Authorization": f"Bearer {SECRET}"}
        with httpx.Client(base_url=handle.base_url, headers=headers, timeout=60) as http:
            yield http, log_path


def json_lines(log_path) -> list[dict]:
    """The complete JSON lines of the log so far (the server may be mid-way through one)."""
    text = log_path.read_text(errors="replace")
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.startswith("{")]


def request_entries(log_path, request_id: str, timeout_s: float = 10.0) -> list[dict]:
    """The request-log entries for `request_id` (the line is written once the response ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [
            e
            for e in json_lines(log_path)
            if e.get("logger") == "tessera.request" and e.get("request_id") == request_id
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def completion_body(**extra) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": "log me",
        "max_tokens": 3,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


def test_one_json_line_with_the_given_request_id(logged):
    http, log_path = logged
    response = http.post(
        "/v1/completions", json=completion_body(), headers={"x-request-id": "client-id-0001"}
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-id-0001"
    [entry] = request_entries(log_path, "client-id-0001")
    assert entry["route"] == "/v1/completions" and entry["method"] == "POST"
    assert entry["status"] == 200 and entry["level"] == "info"
    assert entry["prompt_tokens"] == response.json()["usage"]["prompt_tokens"]
    assert entry["completion_tokens"] == 3
    assert 0 < entry["latency_s"] < 60


def test_streamed_request_is_logged_when_the_stream_ends(logged):
    http, log_path = logged
    body = completion_body(stream=True, max_tokens=4)
    with http.stream(
        "POST", "/v1/completions", json=body, headers={"x-request-id": "stream-7"}
    ) as response:
        assert response.headers["x-request-id"] == "stream-7"
        chunks = [line for line in response.iter_lines() if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]"
    [entry] = request_entries(log_path, "stream-7")
    assert entry["status"] == 200 and entry["completion_tokens"] == 4
    assert "aborted" not in entry


def test_a_stream_the_client_leaves_is_logged_as_aborted(logged):
    """It was logged like a finished one, status=200 and nothing more (fuzz82)."""
    http, log_path = logged
    body = completion_body(stream=True, max_tokens=2000)
    with http.stream(
        "POST", "/v1/completions", json=body, headers={"x-request-id": "left-early-1"}
    ) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data:"))
    # Leaving the block closes the connection mid-stream.
    [entry] = request_entries(log_path, "left-early-1", timeout_s=30)
    assert entry["status"] == 200 and entry["aborted"] is True


@pytest.mark.parametrize("bad_id", ["x" * 129, "has space", "tab\there", ""])
def test_unusable_request_id_is_replaced(logged, bad_id):
    http, log_path = logged
    response = http.get("/v1/models", headers={"x-request-id": bad_id})
    assert response.status_code == 200
    generated = response.headers["x-request-id"]
    assert generated != bad_id and len(generated) == 32 and int(generated, 16) >= 0
    [entry] = request_entries(log_path, generated)
    assert entry["route"] == "/v1/models"


def test_refusals_are_logged_and_api_keys_never_are(logged):
    http, log_path = logged
    response = http.post(
        "/v1/completions",
        json=completion_body(),
        headers={"Authorization": f"Bearer {WRONG_SECRET}", "x-request-id": "unauthorised-1"},
    )
    assert response.status_code == 401
    assert response.headers["x-request-id"] == "unauthorised-1"
    [entry] = request_entries(log_path, "unauthorised-1")
    assert entry["status"] == 401 and "prompt_tokens" not in entry
    missing = http.get("/no/such/page", headers={"x-request-id": "missing-1"})
    assert missing.status_code == 404
    [entry] = request_entries(log_path, "missing-1")
    assert entry["route"] == "unmatched"  # never the raw path
    text = log_path.read_text(errors="replace")
    assert SECRET not in text and WRONG_SECRET not in text
    assert "/no/such/page" not in text
    assert not any(e.get("logger") == "uvicorn.access" for e in json_lines(log_path))
