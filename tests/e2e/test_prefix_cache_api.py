"""The prefix cache as a client sees it: `usage.prompt_tokens_details.cached_tokens`
(OpenAI's field) counts the prompt tokens served from it, and vLLM's `cache_salt` keeps
requests of different salts (tenants) from sharing them."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.conftest import MODEL_NAME


def a_long_prompt() -> str:
    """About 120 tokens that no other test sends (so the cache starts cold for it)."""
    return uuid.uuid4().hex + " " + " ".join(f"word{i}" for i in range(40))


def cached_tokens(http, path: str, prompt: str, **fields) -> int:
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, **fields}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 64
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_cached_tokens_and_cache_salt(http, path):
    # What unsalted prompts that differ share: a chat template's start (a whole block).
    cached_tokens(http, path, a_long_prompt())
    template_start = cached_tokens(http, path, a_long_prompt())
    assert template_start == (16 if "chat" in path else 0)
    prompt = a_long_prompt()
    assert cached_tokens(http, path, prompt, cache_salt="tenant-a") == 0
    assert cached_tokens(http, path, prompt, cache_salt="tenant-a") >= 48  # whole blocks
    assert cached_tokens(http, path, prompt, cache_salt="tenant-b") == 0
    assert cached_tokens(http, path, prompt) == template_start  # no salt: a tenant too
    assert cached_tokens(http, path, prompt) >= 48


def test_streamed_usage_counts_cached_tokens(client):
    prompt = a_long_prompt()
    for expect_cached in (False, True):
        chunks = list(client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, stream=True,
            stream_options={"include_usage": True}))  # fmt: skip
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) is expect_cached


def test_an_empty_or_huge_cache_salt_is_a_400(http):
    for salt in ("", "x" * 257, 7):
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
