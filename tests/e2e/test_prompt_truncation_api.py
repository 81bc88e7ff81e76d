"""vLLM's `truncate_prompt_tokens` over HTTP: only the prompt's last k tokens are run (the
answer is that of the shorter prompt), -1 keeps what leaves room for `max_tokens`, and a
cut through an image is a 400 rather than a silent loss."""

from __future__ import annotations

from tests.e2e.conftest import MODEL_NAME
from tests.e2e.test_errors_api import assert_error

GREEDY = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
MAX_MODEL_LEN = 2048  # bench.servers.TINY_SERVER_FLAGS


def post(http, path: str, **body) -> dict:
    response = http.post(path, json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_keep_the_last_tokens(http):
    ids = http.post("/tokenize", json={"prompt": "one two three " * 12}).json()["tokens"]
    truncated = post(http, "/v1/completions", prompt=ids, truncate_prompt_tokens=10, echo=True)
    short = post(http, "/v1/completions", prompt=ids[-10:])
    assert truncated["usage"]["prompt_tokens"] == 10
    text = truncated["choices"][0]["text"]
    echoed = http.post("/detokenize", json={"tokens": ids[-10:]}).json()["prompt"]
    assert text == echoed + short["choices"][0]["text"]  # the echo is what was kept
    whole = post(http, "/v1/completions", prompt=ids, truncate_prompt_tokens=len(ids) + 5)
    assert whole["usage"]["prompt_tokens"] == len(ids)


def test_chat_keeps_the_end_of_the_rendered_conversation(http):
    messages = [{"role": "user", "content": "Tell me about the sea and the wind today."}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    truncated = post(http, "/v1/chat/completions", messages=messages, truncate_prompt_tokens=12)
    short = post(http, "/v1/completions", prompt=ids[-12:])
    assert truncated["usage"]["prompt_tokens"] == 12
    assert truncated["choices"][0]["message"]["content"] == short["choices"][0]["text"]


def test_minus_one_keeps_what_leaves_room_to_generate(http):
    prompt = "word " * (MAX_MODEL_LEN + 100)
    too_long = http.post("/v1/completions", json={**GREEDY, "prompt": prompt})
    assert too_long.status_code == 400
    fitted = post(http, "/v1/completions", prompt=prompt, truncate_prompt_tokens=-1)
    assert fitted["usage"]["prompt_tokens"] == MAX_MODEL_LEN - GREEDY["max_tokens"]
    assert fitted["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_a_cut_through_an_image_is_refused(http, image_server):
    image = {"type": "image_url", "image_url": {"url": f"{image_server}/picture.png"}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
    whole = post(http, "/v1/chat/completions", messages=messages)
    num_tokens = whole["usage"]["prompt_tokens"]
    kept = post(
        http, "/v1/chat/completions", messages=messages, truncate_prompt_tokens=num_tokens - 3
    )
    assert kept["usage"]["prompt_tokens"] == num_tokens - 3  # the system turn's start goes
    cut = http.post("/v1/chat/completions", json={**GREEDY, "messages": messages,
                                                  "truncate_prompt_tokens": 20})  # fmt: skip
    error = assert_error(cut, 400, param="truncate_prompt_tokens")
    assert "would cut away an image (tokens " in error["message"]  # was "a image"
    for bad in (0, -2):
        response = http.post("/v1/completions", json={**GREEDY, "prompt": "hi",
                                                      "truncate_prompt_tokens": bad})  # fmt: skip
        assert_error(response, 400, param="truncate_prompt_tokens")
