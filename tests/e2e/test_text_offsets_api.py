"""The legacy completions `logprobs.text_offset`, over HTTP: each token's offset is where
its text starts in the returned `text` (OpenAI's meaning), streamed or not, through
special tokens that `skip_special_tokens` leaves out, characters split across tokens, text
held back for a possible stop string, and an echoed prompt."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import MODEL_NAME


def token_id(http, text: str) -> int:
    body = {"model": MODEL_NAME, "prompt": text}
    (only,) = http.post("/tokenize", json=body).json()["tokens"]
    return only


def answer(http, body: dict) -> tuple[str, list[str], list[int]]:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]


def streamed(http, body: dict) -> tuple[str, list[str], list[int]]:
    text, tokens, offsets = "", [], []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices:
                text += choices[0]["text"]
                if choices[0]["logprobs"]:
                    tokens += choices[0]["logprobs"]["tokens"]
                    offsets += choices[0]["logprobs"]["text_offset"]
    return text, tokens, offsets


def check_offsets_index(text: str, tokens: list[str], offsets: list[int], plain: set[str]):
    """Offsets never go back nor past the text, and a `plain` token (whole characters, not
    special) is found at its offset."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), offsets
    for token, offset in zip(tokens, offsets, strict=True):
        if token in plain:
            assert text[offset : offset + len(token)] == token, (token, offset, text)


@pytest.mark.parametrize("echo", [False, True])
def test_text_offsets_index_the_text_streamed_or_not(http, echo):
    """The sampled tokens mix plain words, a special token (left out of the text), the two
    bytes of 'é' (one character over two tokens) and a word that starts a stop string that
    never matches (its text is held back). Before, the non-streamed offsets counted the
    special token's name, and the streamed ones restarted each chunk at the text sent so
    far, so both pointed past the tokens' text and disagreed."""
    plain = [" the", " dog", "a"]
    ids = [token_id(http, word) for word in plain] + [token_id(http, "<|vision_pad|>")]
    e_acute = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "é"}).json()["tokens"]
    body = {"model": MODEL_NAME, "prompt": "Say:", "max_tokens": 40, "temperature": 1.0,
            "seed": 7, "ignore_eos": True, "logprobs": 0, "echo": echo,
            "allowed_token_ids": ids + e_acute, "stop": ["a\x07never"]}  # fmt: skip
    whole = answer(http, body)
    assert streamed(http, body) == whole
    text, tokens, offsets = whole
    assert "<|vision_pad|>" in tokens and "<|vision_pad|>" not in text and "é" in text
    check_offsets_index(text, tokens, offsets, set(plain))
    if echo:
        prompt = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Say:"}).json()
        assert text.startswith("Say:") and offsets[0] == 0
        assert offsets[prompt["count"]] == len("Say:")  # the first generated token's
