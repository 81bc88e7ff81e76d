"""`--stream-interval 4` against the real server: after the first chunk, chunks of at least
4 tokens, the same text as one token a chunk gives, and stop strings still cut answers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerHandle, run_server

NUM_TOKENS = 30


@pytest.fixture(scope="module")
def interval_server(model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    log_path = tmp_path_factory.mktemp("logs") / "stream_interval.log"
    with run_server(model_dir, log_path, "--stream-interval", "4") as handle:
        yield handle


def _stream(base_url: str, **fields) -> list[list[str]]:
    """Each content chunk's tokens (from its logprobs)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count with me"}],
            "max_tokens": NUM_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "logprobs": True, **fields}  # fmt: skip
    chunks = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("logprobs"):
                chunks.append([entry["token"] for entry in choice["logprobs"]["content"]])
    return chunks


def test_chunks_carry_at_least_the_interval_after_the_first_token(interval_server, server):
    chunks = _stream(interval_server.base_url)
    one_by_one = _stream(server.base_url)
    assert [token for chunk in chunks for token in chunk] == [t for c in one_by_one for t in c]
    # The first token is never held back for the interval (tests/unit/test_output_collector.py
    # shows it deterministically); here it may share its chunk with tokens that came while
    # the stream was busy, as at any interval.
    assert all(len(chunk) >= 4 for chunk in chunks[1:-1])
    assert 1 <= len(chunks[-1]) and len(chunks) <= 1 + -(-(NUM_TOKENS - 1) // 4)


def test_a_stop_string_still_cuts_the_answer(interval_server, server):
    def answer(base_url: str, **fields) -> dict:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count with me"}],
                "max_tokens": NUM_TOKENS, "temperature": 0, **fields}  # fmt: skip
        response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return {**response.json()["choices"][0], "usage": response.json()["usage"]}

    full = answer(server.base_url, ignore_eos=True)["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = answer(server.base_url, stop=[stop], ignore_eos=True)
    got = answer(interval_server.base_url, stop=[stop], ignore_eos=True)
    assert got["message"]["content"] == expected["message"]["content"]
    assert got["finish_reason"] == expected["finish_reason"] == "stop"
    # A non-streamed answer is read as it comes when it has stop strings, so the engine
    # stops soon after the stop string instead of running to max_tokens.
    assert got["usage"]["completion_tokens"] < NUM_TOKENS
