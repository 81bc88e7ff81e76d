"""The HTTP app against a scripted fake engine: shapes, streaming, stop strings, errors."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from engine.protocol import ErrorInfo
from tests.unit.fake_engine import chat, sse_events


def test_chat_shape_and_usage(app):
    client, engine = app
    response = chat(client, max_tokens=5, temperature=0)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    expected = engine.tokenizer.decode(engine.script[:5])
    assert choice["message"] == {"role": "assistant", "content": expected}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_len = len(engine.requests[-1].prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 5,
        "total_tokens": prompt_len + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert engine.requests[-1].sampling.temperature == 0.0


def test_default_max_tokens_is_rest_of_context(app):
    client, engine = app
    chat(client, stop=["mat"])
    request = engine.requests[-1]
    assert request.sampling.max_tokens == 256 - len(request.prompt_token_ids)


def test_stop_string_cut_and_aborted(app):
    client, engine = app
    body = chat(client, max_tokens=30, stop=["on the m"]).json()
    assert body["choices"][0]["message"]["content"] == "The cat sat "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.requests[-1].request_id in engine.aborted


def test_stream_role_first_no_partial_stop_and_usage(app):
    client, _ = app
    response = chat(
        client, max_tokens=30, stream=True, stop=["mat."], stream_options={"include_usage": True}
    )
    events = sse_events(response)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == "The cat sat on the "
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["stop"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 6


def test_stream_multibyte_never_replacement_char(app):
    client, engine = app
    events = sse_events(chat(client, max_tokens=len(engine.script), stream=True))
    contents = [c["delta"].get("content", "") for e in events for c in e["choices"]]
    assert all("\ufffd" not in c for c in contents)
    assert "🎉" in "".join(contents)


def test_n2_ids_and_usage(app):
    client, engine = app
    body = chat(client, max_tokens=3, n=2, seed=5).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    ids = [r.request_id for r in engine.requests[-2:]]
    assert ids[0].endswith("-0") and ids[1].endswith("-1")
    prompt_len = len(engine.requests[-1].prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == prompt_len
    assert body["usage"]["completion_tokens"] == 6


def test_n3_scores_the_prompt_once_unless_each_first_chunk_shows_it(app):
    client, engine = app
    assert chat(client, max_tokens=2, n=3, prompt_logprobs=1).status_code == 200
    assert [r.sampling.prompt_logprobs for r in engine.requests[-3:]] == [1, None, None]
    assert chat(client, max_tokens=2, n=3, prompt_logprobs=1, stream=True).status_code == 200
    assert [r.sampling.prompt_logprobs for r in engine.requests[-3:]] == [1, None, None]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2, "prompt_logprobs": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert [r.sampling.prompt_logprobs for r in engine.requests[-2:]] == [1, None]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200 and list(response.iter_lines())
    assert [r.sampling.prompt_logprobs for r in engine.requests[-2:]] == [1, 1]


def test_logprobs_shape(app):
    client, engine = app
    body = chat(client, max_tokens=2, logprobs=True, top_logprobs=2).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    first = engine.tokenizer.decode(engine.script[:1])
    assert content[0]["token"] == first and content[0]["bytes"] == list(first.encode())
    assert len(content[0]["top_logprobs"]) == 2


def test_streamed_logprobs_chat_and_completions(app):
    client, engine = app
    events = sse_events(chat(client, max_tokens=3, stream=True, logprobs=True, top_logprobs=2))
    content = [e["choices"][0]["logprobs"] for e in events[1:] if e["choices"]]
    tokens = [entry["token"] for part in content for entry in part["content"]]
    assert tokens == [engine.tokenizer.decode([t]) for t in engine.script[:3]]
    assert all(len(entry["top_logprobs"]) == 2 for part in content for entry in part["content"])
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True, "logprobs": 1}
    events = sse_events(client.post("/v1/completions", json=body))
    logprobs = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    assert [t for part in logprobs for t in part["tokens"]] == tokens
    offsets = [o for part in logprobs for o in part["text_offset"]]
    assert offsets == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


def test_completions_prompt_ids_and_string(app):
    client, engine = app
    body = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3}
    ).json()
    expected = engine.tokenizer.decode(engine.script[:3])
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected
    body = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    ).json()
    assert engine.requests[-1].prompt_token_ids == [5, 6, 7]


def test_image_data_url_becomes_media(app):
    client, engine = app
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]
    response = chat(client, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert response.status_code == 200, response.text
    request, tensors = engine.requests[-1], engine.tensors[-1]
    (media,) = request.media
    assert media.pixel_values.frame == 0 and tuple(tensors[0].shape) == media.pixel_values.shape
    span = request.prompt_token_ids[media.offset : media.offset + media.num_tokens]
    assert len(set(span)) == 1 and len(span) == media.num_tokens


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "nope"}, 404, "model_not_found", "model"),
        ({"temperature": 9}, 400, "invalid_value", "temperature"),
        ({"messages": "x"}, 400, "invalid_value", "messages"),
        ({"max_tokens": 1000}, 400, "context_length_exceeded", "max_tokens"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            },
                        ],
                    }
                ]
            },
            400,
            "invalid_media",
            "messages[0].content[1]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}],
                    }
                ]
            },
            400,
            "invalid_media",
            "messages[0].content[0]",
        ),
    ],
)
def test_errors(app, body, status, code, param):
    client, _ = app
    response = chat(client, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)


def test_context_message_has_both_numbers(app):
    client, _ = app
    message = chat(client, max_tokens=1000).json()["error"]["message"]
    assert "256" in message and "1000" in message


def test_unknown_route_and_bad_json(app):
    client, _ = app
    response = client.get("/nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "error" in response.json()


@pytest.mark.parametrize("kind", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_as_another_content_type_is_read_as_json(app, kind):
    """`curl -d` sends form-urlencoded: the body got "Input should be a valid dictionary
    or object to extract fields from" (fuzz75)."""
    client, _ = app
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = client.post("/v1/chat/completions", content=json.dumps(body).encode(),
                           headers={"content-type": kind})  # fmt: skip
    assert response.status_code == 200, response.text
    bad = client.post("/v1/chat/completions", content=b"model=tiny", headers={"content-type": kind})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"], bad.text


def test_engine_death_mid_stream(app):
    client, engine = app
    engine.die_after = 2
    try:
        events = sse_events(chat(client, max_tokens=10, stream=True))
        assert events[-1]["error"]["code"] == "engine_dead"
        response = chat(client, max_tokens=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    finally:
        engine.die_after = None


def test_a_failure_building_a_chunk_ends_the_stream_with_an_error_event(app, monkeypatch):
    """Not only the engine's deltas: an error in the stream's own code (here the logprobs
    of a chunk) ends the stream with the error event and [DONE]; it used to cut the
    connection mid-stream. The server serves on."""
    from server import streaming

    client, _ = app

    def broken(*args, **kwargs):
        raise RuntimeError("a bug while building a chunk")

    monkeypatch.setattr(streaming, "chat_logprobs", broken)
    events = sse_events(chat(client, max_tokens=4, stream=True, logprobs=True))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["error"]["code"] == "internal_error"
    monkeypatch.undo()
    assert chat(client, max_tokens=2, stream=True, logprobs=True).status_code == 200


def test_engine_errors_name_the_media_part_the_client_wrote(app, monkeypatch):
    """The engine names a media item media[i] (its index among the request's items); the
    error the client gets names the message part it came from."""
    client, engine = app
    picture = Image.new("RGB", (56, 56), (10, 200, 30))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "and"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "again"}, image]}]  # fmt: skip
    monkeypatch.setattr(engine, "fail_with", ErrorInfo("gone", code="unknown_media_uuid",
                                                       param="media[1]"))  # fmt: skip
    response = chat(client, messages=messages, max_tokens=2)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[2].content[1]"


def test_health_metrics_tokenize(app):
    client, engine = app
    assert client.get("/health").status_code == 200
    assert chat(client).status_code == 200  # counted by route, whatever ran before
    metrics = client.get("/metrics").text
    assert 'route="/v1/chat/completions"' in metrics and "tessera:kv_cache_usage_perc" in metrics
    tokens = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"])
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "hello world"
    engine.is_alive = False
    try:
        assert client.get("/health").status_code == 503
    finally:
        engine.is_alive = True
