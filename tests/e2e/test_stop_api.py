"""How a choice ends, over HTTP (vLLM's fields): `stop_reason` names the stop string or
stop token id that ended it (null for EOS and the length limit),
`include_stop_str_in_output` keeps the stop string at the end of the text, and
`stream_options.continuous_usage_stats` puts the usage so far in every chunk."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL_NAME

GREEDY = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Describe a dog in the park."}]


def chat(http, **fields) -> dict:
    response = http.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def completion(http, **fields) -> dict:
    response = http.post("/v1/completions", json={**GREEDY, "prompt": "A dog in", **fields})
    assert response.status_code == 200, response.text
    return response.json()


def events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    import json

    return [json.loads(line) for line in lines[:-1]]


def a_stop_inside(text: str) -> str:
    """Three characters from the middle of `text`, where they first occur."""
    for start in range(len(text) // 3, len(text) - 3):
        stop = text[start : start + 3]
        if stop.strip() and text.index(stop) == start:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_is_the_stop_reason_and_can_be_kept(http, include):
    full = chat(http)["choices"][0]
    assert full["finish_reason"] == "length" and full["stop_reason"] is None
    text = full["message"]["content"]
    stop = a_stop_inside(text)
    end = text.index(stop) + (len(stop) if include else 0)
    fields = {"stop": [stop, "never-seen"], "include_stop_str_in_output": include}
    choice = chat(http, **fields)["choices"][0]
    assert choice["message"]["content"] == text[:end]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    chunks = events(http, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, **fields})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == text[:end]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    prompt_text = completion(http)["choices"][0]["text"]
    stop = a_stop_inside(prompt_text)
    end = prompt_text.index(stop) + (len(stop) if include else 0)
    choice = completion(http, stop=stop, include_stop_str_in_output=include)["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == (prompt_text[:end], stop)


def generated_ids(choice: dict) -> list[int]:
    """The token ids of a choice asked with `return_tokens_as_token_ids`."""
    tokens = choice["logprobs"]["tokens"]
    assert all(token.startswith("token_id:") for token in tokens)
    return [int(token.removeprefix("token_id:")) for token in tokens]


def test_a_stop_token_is_the_stop_reason(http):
    full = completion(http, logprobs=0, return_tokens_as_token_ids=True)["choices"][0]
    assert full["stop_reason"] is None
    tokens = generated_ids(full)
    stop_id = tokens[3]
    assert stop_id not in tokens[:3]
    choice = completion(http, stop_token_ids=[stop_id])["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    body = {**GREEDY, "prompt": "A dog in", "stop_token_ids": [stop_id]}
    chunks = events(http, "/v1/completions", body)
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_id)
    # Its text is left out, as vLLM leaves it (unless include_stop_str_in_output); it is
    # counted, with its logprob. The text was kept.
    before = detokenized(http, tokens[:3])
    assert choice["text"] == before == "".join(c["choices"][0]["text"] for c in chunks)
    kept = completion(http, stop_token_ids=[stop_id], include_stop_str_in_output=True,
                      logprobs=0, return_tokens_as_token_ids=True)["choices"][0]  # fmt: skip
    assert kept["text"] == detokenized(http, tokens[:4]) and generated_ids(kept) == tokens[:4]
    assert completion(http, stop_token_ids=[stop_id])["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_eos_text_is_left_out_even_with_special_tokens_shown(http, path):
    """EOS ends an answer as a stop token does: vLLM leaves its text out unless
    include_stop_str_in_output, whatever skip_special_tokens says. '<|im_end|>' was kept."""
    eos = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "<|im_end|>"}).json()
    (eos_id,) = eos["tokens"]
    fields = {"ignore_eos": False, "logit_bias": {str(eos_id): 100}, "skip_special_tokens": False}
    body = {**GREEDY, **fields}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "A dog in"})

    def text(**extra) -> str:
        response = http.post(path, json={**body, **extra})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
        assert response.json()["usage"]["completion_tokens"] == 1
        return choice["message"]["content"] if "chat" in path else choice["text"]

    assert text() == ""
    assert text(include_stop_str_in_output=True) == "<|im_end|>"
    chunks = events(http, path, body)
    pieces = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
              for c in chunks if c["choices"]]  # fmt: skip
    assert "".join(p or "" for p in pieces) == ""


def test_eos_stop_reasons_are_vllms(http):
    """vLLM's stop_reason for EOS (fuzz103, fuzz113): None for the tokenizer's EOS, even when
    stop_token_ids list it; the id for generation_config.json's other EOS, which vLLM adds
    to the stop tokens. Both were the other way round."""

    def token_id(text: str) -> int:
        body = {"model": MODEL_NAME, "prompt": text}
        (found,) = http.post("/tokenize", json=body).json()["tokens"]
        return found

    im_end, endoftext = token_id("<|im_end|>"), token_id("<|endoftext|>")
    for forced, listed, expected in ((im_end, [im_end], None), (endoftext, [], endoftext)):
        fields = {"ignore_eos": False, "stop_token_ids": listed, "logit_bias": {str(forced): 100}}
        body = {**GREEDY, "prompt": "A dog in", **fields}
        choice = completion(http, **fields)["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", expected), forced
        assert events(http, "/v1/completions", body)[-1]["choices"][0]["stop_reason"] == expected


def detokenized(http, token_ids: list[int]) -> str:
    response = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": token_ids})
    return response.json()["prompt"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_count_as_the_stream_goes(http, path):
    body = {**GREEDY, "n": 2, "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}}  # fmt: skip
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "A dog in"})
    chunks = events(http, path, body)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 32
    prompt_tokens = final["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    assert all(c["usage"]["total_tokens"] == prompt_tokens + n
               for c, n in zip(chunks, counts, strict=False))  # fmt: skip
    assert counts == sorted(counts) and counts[-1] == 32 and counts[0] < 32
    plain = events(http, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in plain)  # as vLLM: only with include_usage


def test_logprobs_can_name_tokens_by_id(http):
    named = chat(http, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    fields = {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    by_id = chat(http, **fields)["choices"][0]["logprobs"]["content"]
    assert len(by_id) == len(named) == 16
    for plain, entry in zip(named, by_id, strict=True):
        assert entry["token"].startswith("token_id:")
        assert (entry["bytes"], entry["logprob"]) == (plain["bytes"], plain["logprob"])
        assert all(top["token"].startswith("token_id:") for top in entry["top_logprobs"])
    ids = [int(entry["token"].removeprefix("token_id:")) for entry in by_id]
    decoded = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert decoded == "".join(bytes(e["bytes"]).decode("utf-8", "replace") for e in named)
    stream = events(http, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, **fields})
    streamed = [e for c in stream for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in by_id]
    echoed = completion(http, echo=True, logprobs=1, return_tokens_as_token_ids=True)
    logprobs = echoed["choices"][0]["logprobs"]
    prompt_ids = http.post("/tokenize", json={"prompt": "A dog in"}).json()["tokens"]
    assert generated_ids(echoed["choices"][0])[: len(prompt_ids)] == prompt_ids
    assert logprobs["text_offset"][len(prompt_ids)] == len("A dog in")
