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


def test_every_continuous_usage_chunk_counts_the_cached_tokens(client):
    """fuzz108: the chat stream's role chunk went out before the engine said how many
    prompt tokens its cache served, so its usage said `cached_tokens: 0`."""
    messages = [{"role": "user", "content": a_long_prompt()}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    for _ in range(2):  # the second one from the cache
        chunks = list(client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=2, stream=True, n=2,
            stream_options=options))  # fmt: skip
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    cached = [c.usage.prompt_tokens_details.cached_tokens for c in chunks]
    assert cached[-1] >= 48 and set(cached) == {cached[-1]}, cached
    # and, before any text, no completion tokens (fuzz115: they said 1, the first's)
    assert [c.usage.completion_tokens for c in chunks[:2]] == [0, 0]


def test_an_empty_or_huge_cache_salt_is_a_400(http):
    for salt in ("", "x" * 257, 7):
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


def test_a_cache_salt_keeps_media_uuids_and_encodings_to_its_tenant(http):
    """The salt separated the KV cache only: a tenant could name another's image by its
    uuid and be answered from it, and an image another tenant sent was an encoder-cache
    hit (a time the sender could tell)."""
    from bench.local_inputs import picture
    from tests.e2e.test_chat_api import data_url
    from tests.e2e.test_metrics import scrape

    url = data_url(picture(84, 56, 11))
    tag = uuid.uuid4().hex

    def ask(salt: str, part: dict, before: str = "Look:"):  # text before: no prefix hit
        content = [{"type": "text", "text": before}, part]
        body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "cache_salt": salt,
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        return http.post("/v1/chat/completions", json=body)

    def encoder_hits() -> float:
        return scrape(http)[0]["tessera:encoder_cache_hits_total"]

    assert ask(f"a-{tag}", {"type": "image_url", "image_url": {"url": url}, "uuid": tag}).is_success
    assert ask(f"a-{tag}", {"type": "image_url", "uuid": tag}).is_success  # its own tenant
    other = ask(f"b-{tag}", {"type": "image_url", "uuid": tag})
    assert other.status_code == 400 and other.json()["error"]["code"] == "unknown_media_uuid"
    assert ask(f"a-{tag}", {"type": "image_url", "image_url": {"url": url}}).is_success
    hits = encoder_hits()
    assert ask(f"b-{tag}", {"type": "image_url", "image_url": {"url": url}}).is_success
    assert encoder_hits() == hits  # encoded again for tenant b
    assert ask(f"b-{tag}", {"type": "image_url", "image_url": {"url": url}}, "See:").is_success
    assert encoder_hits() == hits + 1  # and shared within it
