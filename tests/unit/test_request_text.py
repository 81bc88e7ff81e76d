"""Bodies that JSON can write but Unicode cannot hold, against the HTTP app (fake engine):
a lone UTF-16 surrogate escape gets 400 naming its field, on every route, before the
tokenizer or a response could fail on it (it was a 500, and a cut stream)."""

from __future__ import annotations

import pytest

from engine.unicode_text import lone_surrogate_path
from server.unicode_check import check_body
from tests.unit.fake_engine import client_for

LONE = "\\ud800"  # as sent: the six characters of the JSON escape


@pytest.fixture(scope="module")
def client(model_dir):
    client, _ = client_for(model_dir)
    with client:
        yield client


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def post(client, route: str, body: str, **headers):
    # surrogatepass: a surrogate in `body` goes out as its raw bytes (ED A0 80: CESU-8)
    return client.post(route, content=body.encode("utf-8", "surrogatepass"),
                       headers={"content-type": "application/json", **headers})  # fmt: skip


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/chat/completions",
         '{"model": "tiny", "messages": [{"role": "user", "content": "a%sb"}], "max_tokens": 2}',
         "messages[0].content"),
        ("/v1/chat/completions",
         '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "%s"}]}], "max_tokens": 2}', "messages[0].content[0].text"),
        ("/v1/completions", '{"model": "tiny", "prompt": "%s", "max_tokens": 2}', "prompt"),
        ("/tokenize", '{"model": "tiny", "prompt": "x%s"}', "prompt"),
        ("/v1/responses", '{"model": "tiny", "input": "hi", "max_output_tokens": 2, '
         '"metadata": {"k": "%s"}}', "metadata.k"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", '
         '"content": "hi"}], "max_tokens": 2, "user": "%s"}', "user"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("lone", [LONE, "\\udc00", "\ud800"], ids=["high", "low", "raw-bytes"])
def test_a_lone_surrogate_gets_400_naming_its_field(client, route, body, param, lone):
    """raw-bytes: the surrogate's own bytes, not an escape; Python's JSON decoder takes
    them (surrogatepass), and they were a 500 from the tokenizer."""
    response = post(client, route, body.replace("%s", lone))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "surrogate" in error["message"]
    # The connection is still good: a valid request on the same client answers.
    assert post(client, route, body.replace("%s", "ok")).status_code == 200


def test_pairs_and_escaped_backslashes_pass(client):
    pair = '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    assert post(client, "/v1/chat/completions", pair).status_code == 200
    text = (
        '{"model": "tiny", "prompt": "the text \\\\ud800", "max_tokens": 2}'  # \\ud800: no escape
    )
    assert post(client, "/v1/completions", text).status_code == 200


def test_the_api_key_is_checked_first(model_dir):
    client, _ = client_for(model_dir, api_key="secret")
    with client:
        body = '{"model": "tiny", "prompt": "%s", "max_tokens": 2}'.replace("%s", LONE)
        assert post(client, "/v1/completions", body).status_code == 401
        authorised = post(client, "/v1/completions", body, authorization="Bearer secret")
        assert authorised.status_code == 400


def test_paths_name_keys_values_and_items():
    assert lone_surrogate_path({"a": [1, {"b": "ok"}, "\ud800"]}) == "a[2]"
    assert lone_surrogate_path({"a": {"\udfff": 1}}) == "a"
    assert lone_surrogate_path(["ok", "\U0001f600"]) is None
    check_body(b'{"a": "\\ud800"')  # not JSON: left to the route's parser
    check_body(b'{"a": "' + b"x" * 10_000_000 + b'"}')  # no escape: the fast path


def test_a_prompt_too_long_for_the_context_is_refused_untokenised(client, model_dir):
    from engine.multimodal.prompt import PromptProcessor

    per_token = PromptProcessor.from_model_dir(model_dir).max_chars_per_token
    huge = "a" * (256 * per_token + 1)  # the fake engine's context: 256 tokens
    for route, body in [
        ("/v1/completions", {"model": "tiny", "prompt": huge, "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": huge}]}),
    ]:  # fmt: skip
        response = client.post(route, json=body)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert "characters" in response.json()["error"]["message"]
    # Truncating requests are tokenised whatever their length, then cut.
    kept = client.post("/v1/completions", json={"model": "tiny", "prompt": huge, "max_tokens": 2,
                                                "truncate_prompt_tokens": 10})  # fmt: skip
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 10


def test_tokenising_a_long_text_leaves_the_server_answering(client):
    """A million tokens take ~1.5 s to tokenise. They used to hold the event loop (and the
    GIL) all along: /health waited for them."""
    import threading
    import time

    finished = {}

    def tokenize_long_text():
        response = client.post("/tokenize", json={"model": "tiny", "prompt": "a " * 1_000_000})
        finished["at"] = time.monotonic()
        finished["count"] = response.json()["count"]

    worker = threading.Thread(target=tokenize_long_text)
    worker.start()
    time.sleep(0.3)  # the tokenising is under way
    assert client.get("/health").status_code == 200
    answered = time.monotonic()
    worker.join()
    assert finished["count"] >= 1_000_000
    assert answered < finished["at"], "/health waited for the tokenizer"


def test_odd_bodies_and_ids_get_errors_that_name_them(client):
    """What the fuzzing found: messages naming `None`, ids the model can write that
    /detokenize refused, and a completions prompt blamed on `messages`."""
    empty = client.post(
        "/v1/completions", content=b"", headers={"content-type": "application/json"}
    )
    assert empty.status_code == 400
    assert empty.json()["error"]["message"] == "the request needs a JSON object as its body"
    listed = client.post("/v1/completions", json=[1, 2])
    assert listed.status_code == 400 and "None" not in listed.json()["error"]["message"]
    # The fake engine's vocabulary is 1600, its tokenizer's 1544: the rest decode to nothing.
    assert client.post("/detokenize", json={"tokens": [1599]}).json() == {"prompt": ""}
    assert client.post("/detokenize", json={"tokens": [1600]}).status_code == 400
    placeholder = client.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                                       "prompt": "a <|image_pad|> b"})  # fmt: skip
    assert placeholder.status_code == 400 and placeholder.json()["error"]["param"] == "prompt"
    as_ids = client.post("/tokenize", json={"prompt": "<|image_pad|>"}).json()["tokens"]
    by_id = client.post(
        "/v1/completions", json={"model": "tiny", "max_tokens": 2, "prompt": as_ids}
    )
    assert by_id.status_code == 400 and by_id.json()["error"]["param"] == "prompt"


def test_an_image_the_processor_refuses_names_its_part(client):
    """The aspect-ratio check lives in the image processor, which knows no part: its error
    had param null."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (1, 300)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    response = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                           "messages": [{"role": "user", "content": content}]})  # fmt: skip
    assert response.status_code == 400 and "aspect ratio" in response.json()["error"]["message"]
    assert response.json()["error"]["param"].startswith("messages[0].content[1]")


def test_a_body_of_too_many_json_containers_is_refused_before_it_is_parsed(client):
    """5 M `[0]` prompts in 25 MB held the event loop 3 s to parse (and 10 s to validate),
    while every other stream waited; now they are counted first (C speed): 413."""
    body = '{"model": "tiny", "max_tokens": 2, "prompt": [' + ",".join(["[0]"] * 600_000) + "]}"
    response = post(client, "/v1/completions", body)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert "600002 JSON objects and arrays" in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    '{"model": "tiny", "max_tokens": ' + "9" * 100_000 + ', "prompt": "x"}',
    '{"model": "tiny", "prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}",
], ids=["huge-number", "deep-nesting"])  # fmt: skip
def test_json_the_parser_gives_up_on_is_the_invalid_json_error(client, body):
    """They were 400 "There was an error parsing the body", without a code."""
    response = post(client, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"
