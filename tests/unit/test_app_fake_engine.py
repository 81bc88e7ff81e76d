"""The HTTP app against a scripted fake engine: shapes, streaming, stop strings, errors."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.protocol import ErrorInfo, FinishReason, Modality, Ready, RequestOutput, TokenLogprob
from engine.tiny_model import make_tiny_model
from server.app import build_app
from server.openai_replies import ChatCompletionChunk
from server.openai_replies import CompletionResponse as Completion
from server.settings import ServerSettings

SCRIPT = "The cat sat on the mat. 🎉 Done and done again and again."


class FakeEngine:
    """Emits the tokens of SCRIPT one per step; records requests and aborts."""

    def __init__(self, tokenizer_path: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.script = self.tokenizer.encode(SCRIPT, add_special_tokens=False).ids
        self.ready = Ready(
            model_name="tiny",
            max_model_len=256,
            vocab_size=1600,
            hidden_size=128,
            block_size=16,
            num_kv_blocks=64,
            eos_token_ids=[],
            modalities=[Modality.IMAGE],
            dtype="float32",
            device="cpu",
        )
        self.is_alive = True
        self.requests = []
        self.tensors = []
        self.aborted = []
        self.die_after: int | None = None
        self.fail_with: ErrorInfo | None = None  # refuse every request, as the engine does

    def add_stats_listener(self, callback) -> None:
        pass

    async def abort(self, request_ids) -> None:
        self.aborted.extend(request_ids)

    async def generate(self, request, tensors=(), *, tokens_per_wake=1):
        self.requests.append(request)
        self.tensors.append(list(tensors))
        if self.fail_with is not None:
            yield RequestOutput(request_id=request.request_id, finish_reason=FinishReason.ERROR,
                                error=self.fail_with)  # fmt: skip
            return
        finished = False
        try:
            for step in range(request.sampling.max_tokens):
                await asyncio.sleep(0)
                if self.die_after is not None and step >= self.die_after:
                    raise EngineDeadError("the engine died")
                token_id = self.script[step % len(self.script)]
                is_last = step == request.sampling.max_tokens - 1
                logprobs = None
                if request.sampling.logprobs is not None:
                    top = [(token_id, -0.5)] * request.sampling.logprobs
                    logprobs = [TokenLogprob(token_id, -0.5, top)]
                finished = is_last
                yield RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[token_id],
                    logprobs=logprobs,
                    finish_reason=FinishReason.LENGTH if is_last else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                )
        finally:
            if not finished:
                self.aborted.append(request.request_id)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _client(model_dir, **settings):
    engine = FakeEngine(str(model_dir / "tokenizer.json"))
    config = ServerSettings(
        engine=EngineConfig(model=str(model_dir), served_model_name="tiny"),
        allow_private_media_urls=True,
        **settings,
    )
    return TestClient(build_app(config, engine)), engine


@pytest.fixture(scope="module")
def app(model_dir):
    client, engine = _client(model_dir)
    with client:
        yield client, engine


def chat(client, **body):
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return client.post("/v1/chat/completions", json=payload)


def sse_events(response):
    """The JSON events of an SSE response; each one must also be a valid instance of its
    OpenAI model (the chunks are encoded from plain dicts, so this keeps them honest)."""
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    for event in parsed:
        model = {"chat.completion.chunk": ChatCompletionChunk, "text_completion": Completion}
        if "error" not in event:
            model[event["object"]].model_validate(event)
    return parsed


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


def test_api_key(model_dir):
    client, _ = _client(model_dir)
    client.app  # noqa: B018
    config_key = "sekrit"
    client, _ = _client(model_dir, api_key=config_key)
    with client:
        assert chat(client).status_code == 401
        assert chat(client).json()["error"]["code"] == "invalid_api_key"
        headers = {"Authorization": f"Bearer {config_key}"}
        ok = client.post(
            "/v1/chat/completions",
            headers=headers,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            },
        )
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.get("/openapi.json").status_code == 401  # like the routes it lists
        assert client.get("/openapi.json", headers=headers).status_code == 200


def _http_requests_total(client) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "tessera:http_requests_total":
                counts[sample.labels["route"], sample.labels["status"]] = sample.value
    return counts


def test_http_requests_are_counted_by_route_template_and_status(model_dir):
    client, _ = _client(model_dir, max_request_body_bytes=4096)
    with client:
        assert chat(client, max_tokens=2).status_code == 200
        assert chat(client, max_tokens=3, stream=True).status_code == 200
        assert chat(client, temperature=-1).status_code == 400
        assert client.get("/v1/nope/secret-path").status_code == 404
        declared = client.post(
            "/v1/chat/completions",
            content=b"x" * 5000,
            headers={"content-type": "application/json"},
        )
        assert declared.status_code == 413
        assert declared.json()["error"]["code"] == "request_too_large"

        def chunks():
            yield b"x" * 3000
            yield b"x" * 3000

        chunked = client.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert chunked.status_code == 413
        huge_header = {"x-padding": "x" * (1 << 20)}
        assert client.get("/v1/models", headers=huge_header).status_code == 431
        counts = _http_requests_total(client)
    assert counts[("/v1/chat/completions", "200")] == 2  # the streamed one included
    assert counts[("/v1/chat/completions", "400")] == 1
    assert counts[("unmatched", "404")] == 1  # the template, never the raw path
    # one cut off while streaming in, one refused before routing (it was "unmatched")
    assert counts[("/v1/chat/completions", "413")] == 2
    assert ("unmatched", "413") not in counts
    assert counts[("/v1/models", "431")] == 1


def test_a_grammar_waits_for_the_thinking_a_template_opens(model_dir):
    """With a template that leaves <think> open, a format's grammar holds only after the
    model's </think> (engine: structured_output_after); otherwise from the first token."""
    opening = ("{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_start|>assistant\n"
               "{% if think %}<think>\n{% endif %}")  # fmt: skip
    client, engine = _client(model_dir, trust_request_chat_template=True)
    end = tuple(engine.tokenizer.encode("</think>", add_special_tokens=False).ids)
    with client:
        for think, expected in ((True, end), (False, ())):
            response = chat(client, max_tokens=2, chat_template=opening,
                            chat_template_kwargs={"think": think},
                            response_format={"type": "json_object"})  # fmt: skip
            assert response.status_code == 200, response.text
            assert engine.requests[-1].sampling.structured_output_after == expected
        assert chat(client, max_tokens=2, chat_template=opening,
                    chat_template_kwargs={"think": True}).status_code == 200  # fmt: skip
        assert engine.requests[-1].sampling.structured_output_after == ()  # no grammar


def test_api_processes_admit_against_one_budget_together(model_dir):
    """Each process admitted a fixed share of every budget: when the kernel handed most
    connections to one of them (it often does), requests were refused at a fraction of the
    capacity while the others sat idle. The launcher's shared counts make the budgets
    bound the sum over all of them, whichever process a request reaches."""
    import multiprocessing

    from engine.errors import ServerOverloaded

    settings = ServerSettings(
        engine=EngineConfig(model=str(model_dir), max_num_seqs=3),
        max_waiting_requests=2,
        max_waiting_tokens=1000,
        api_server_count=3,
    )
    engine = FakeEngine(str(model_dir / "tokenizer.json"))
    counts = multiprocessing.get_context("spawn").Array("q", 2 * 3)
    apps = [build_app(settings, engine, api_server_index=index, admission_counts=counts)
            for index in range(3)]  # fmt: skip
    first, second, third = (app.state.admission for app in apps)
    tickets = [first.admit(num_sequences=1, num_tokens=10) for _ in range(5)]  # all at one
    with pytest.raises(ServerOverloaded):
        second.admit(num_sequences=1, num_tokens=10)  # 3 running + 2 waiting: full
    tickets[0].release()
    tickets.append(third.admit(num_sequences=1, num_tokens=10))
    tickets[1].release()
    with pytest.raises(ServerOverloaded, match="prompt tokens"):
        second.admit(num_sequences=1, num_tokens=1000)
    assert (first.num_sequences, third.num_sequences) == (3, 1)  # each drains its own
    assert list(counts) == [3, 30, 0, 0, 1, 10]
    for ticket in tickets:
        ticket.release()
    assert list(counts) == [0] * 6
    big = second.admit(num_sequences=2, num_tokens=10000)  # idle everywhere: any one
    with pytest.raises(ServerOverloaded):
        first.admit(num_sequences=1, num_tokens=1)
    big.release()


def test_the_drains_stop_signal_lives_on_the_loop_that_asks_for_it():
    """Requests race `stopping()` (server/app.py); a future of another loop (a test client
    that runs each request on its own loop) could not be awaited there."""
    from server.admission import AdmissionController

    admission = AdmissionController(max_running=1, max_waiting_requests=0, max_waiting_tokens=1)

    async def current() -> tuple[bool, bool]:
        stopping = admission.stopping()
        return stopping.get_loop() is asyncio.get_running_loop(), stopping.done()

    assert asyncio.run(current()) == (True, False)
    assert asyncio.run(current()) == (True, False)

    async def stop() -> None:
        admission.stop_all()

    asyncio.run(stop())
    assert asyncio.run(current()) == (True, True)  # stopped stays stopped on a new loop


def test_protocol_details_of_errors(app):
    """stream_options without stream was taken silently (vLLM and OpenAI refuse it); a 405
    had no Allow header (RFC 9110 requires one); a trailing slash got a bare 307 to a URL
    built from the client's Host header; chat_template_kwargs {"self": 1} blamed the
    messages."""
    client, _ = app
    options = chat(client, stream_options={"include_usage": True})
    assert options.status_code == 400 and options.json()["error"]["param"] == "stream_options"
    wrong_method = client.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    slash = client.post("/v1/chat/completions/", json={}, headers={"host": "evil.example"},
                        follow_redirects=False)  # fmt: skip
    assert slash.status_code == 404 and slash.json()["error"]["code"] == "not_found"
    kwargs = chat(client, chat_template_kwargs={"self": 1})
    assert kwargs.status_code == 400
    assert kwargs.json()["error"]["param"] == "chat_template_kwargs"


def test_max_logprobs_is_a_setting_checked_on_every_route(model_dir):
    """--max-logprobs (vLLM's): 20 was fixed, as pydantic bounds, on every logprobs field."""
    engine = FakeEngine(str(model_dir / "tokenizer.json"))
    config = ServerSettings(engine=EngineConfig(model=str(model_dir), served_model_name="tiny",
                                                max_logprobs=30))  # fmt: skip
    with TestClient(build_app(config, engine)) as client:
        body = chat(client, max_tokens=1, logprobs=True, top_logprobs=30).json()
        assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 30
        assert engine.requests[-1].sampling.logprobs == 30
        messages = [{"role": "user", "content": "hi"}]
        for route, body, param in (
            ("/v1/chat/completions",
             {"messages": messages, "logprobs": True, "top_logprobs": 31}, "top_logprobs"),
            ("/v1/completions", {"prompt": "hi", "logprobs": 31}, "logprobs"),
            ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 31}, "prompt_logprobs"),
            ("/v1/responses", {"input": "hi", "top_logprobs": 31}, "top_logprobs"),
        ):  # fmt: skip
            response = client.post(route, json={"model": "tiny", **body})
            assert response.status_code == 400, (route, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "--max-logprobs" in error["message"], error


def test_max_n_is_a_setting(model_dir, app):
    """n was at most 16 by a pydantic bound: OpenAI's API takes up to 128."""
    default_client, _ = app
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    refused = default_client.post("/v1/completions", json={**body, "n": 17})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    client, _ = _client(model_dir, max_n=20)
    with client:
        assert len(client.post("/v1/completions", json={**body, "n": 20}).json()["choices"]) == 20
        error = client.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 1, "n": 21,
            "messages": [{"role": "user", "content": "hi"}]}).json()["error"]  # fmt: skip
    assert error["param"] == "n" and "--max-n" in error["message"]


def test_tokenize_renders_a_chat_through_the_requests_own_template(model_dir):
    """/tokenize ignored `chat_template`: it counted the model's template's tokens for a
    chat that would run on another (vLLM's /tokenize takes the field, as the chat does).
    Untrusted, it is refused as the chat refuses it."""
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hello world"}], "chat_template": plain}
    client, engine = _client(model_dir, trust_request_chat_template=True)
    with client:
        tokens = client.post("/tokenize", json=body).json()["tokens"]
        assert tokens == engine.tokenizer.encode("hello world", add_special_tokens=False).ids
    client, _ = _client(model_dir)
    with client:
        refused = client.post("/tokenize", json=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "chat_template"
