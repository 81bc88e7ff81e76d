"""The HTTP app against a scripted fake engine: its settings (API key, limits, templates),
its own metrics, admission across API processes and the protocol of its errors."""

from __future__ import annotations

import asyncio
import re

import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from server.app import build_app
from server.settings import ServerSettings
from tests.unit.fake_engine import FakeEngine, chat, client_for


def test_api_key(model_dir):
    client, _ = client_for(model_dir)
    client.app  # noqa: B018
    config_key = "sekrit"
    client, _ = client_for(model_dir, api_key=config_key)
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


def _served_routes(routes) -> list:
    """Every route of `routes`, those of included routers too (FastAPI keeps an included
    router whole, as `original_router`)."""
    found = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        found += _served_routes(inner.routes) if inner is not None else [route]
    return found


def test_every_protected_route_checks_the_api_key(model_dir):
    """The key is checked in the API router's route class, so a protected path registered
    anywhere else would be open (fuzz85): every operation the app serves under a protected
    prefix, in the OpenAPI document or not (fuzz102), must answer 401 without the key."""
    from server.auth import is_protected

    client, _ = client_for(model_dir, api_key="sekrit")
    with client:
        headers = {"Authorization": "Bearer sekrit"}
        document = client.get("/openapi.json", headers=headers).json()
        documented = {
            (method.upper(), path) for path, item in document["paths"].items() for method in item
        }
        served = {
            (method, route.path.replace(":path", ""))
            for route in _served_routes(client.app.routes)
            for method in getattr(route, "methods", None) or ()
        }
        assert documented <= served, documented - served  # the walk sees every route
        assert ("GET", "/openapi.json") in served and ("HEAD", "/v1/models") in served
        operations = sorted((method, re.sub(r"\{[^}]+\}", "x", path)) for method, path in served)
        protected = [(method, path) for method, path in operations if is_protected(path)]
        assert {path for _, path in operations if not is_protected(path)} == {
            "/health",
            "/metrics",
            "/version",
        }
        for method, path in protected:
            response = client.request(method, path, json={})
            assert response.status_code == 401, (method, path, response.text)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[" * 600_001, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'],
    ids=["malformed", "too-many-containers", "lone-surrogate"],
)
def test_api_key_is_checked_before_the_body_is_parsed(model_dir, body):
    """Without the key, the answer is the 401 whatever the body: the server must not
    parse (nor refuse on its contents) a body from a client it will not serve (fuzz84:
    the key was a dependency, run after FastAPI's parse, so this got a 400 or 413)."""
    client, _ = client_for(model_dir, api_key="sekrit")
    with client:
        response = client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_openapi_document_names_each_operation_once(model_dir):
    """HEAD on the GET routes shared their route and so their operationId, which OpenAPI
    requires unique (client generators fail); which of the two GET got followed
    PYTHONHASHSEED (fuzz85). HEAD stays out of the document."""
    import collections
    import warnings

    client, _ = client_for(model_dir)
    with client, warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id
        document = client.get("/openapi.json").json()
        assert client.head("/openapi.json").status_code == 200
    operations = [op for path in document["paths"].values() for op in path.items()]
    assert "head" not in {method for method, _ in operations}
    ids = collections.Counter(op["operationId"] for _, op in operations)
    assert ids.most_common(1)[0][1] == 1, ids
    assert document["paths"]["/v1/models"]["get"]["operationId"].endswith("_get")


def _http_requests_total(client) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "tessera:http_requests_total":
                counts[sample.labels["route"], sample.labels["status"]] = sample.value
    return counts


def test_http_requests_are_counted_by_route_template_and_status(model_dir):
    client, _ = client_for(model_dir, max_request_body_bytes=4096)
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
        for probe in ("/health", "/metrics", "/version"):
            assert client.get(probe).status_code == 200
        counts = _http_requests_total(client)
    assert counts[("/v1/chat/completions", "200")] == 2  # the streamed one included
    # probes and scrapes are not traffic (they outnumbered it on a quiet server)
    assert not {route for route, _ in counts} & {"/health", "/metrics", "/version"}
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
    client, engine = client_for(model_dir, trust_request_chat_template=True)
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


def test_tokenize_renders_a_chat_off_the_event_loop(model_dir):
    """/tokenize rendered a text chat on the event loop: a slow (trusted) request template
    held /health for 12 s (fuzz79). It renders as a chat does, in a thread, with a chat's
    checks: a chat's literal image placeholder is refused there too."""
    import threading

    client, _ = client_for(model_dir)
    health_answered = threading.Event()
    waited: list[bool] = []
    with client:
        processor = client.app.state.tessera.processor
        render = processor.render_chat

        def render_after_health(*args, **kwargs):  # a render that lasts until /health answers
            waited.append(health_answered.wait(timeout=10))
            return render(*args, **kwargs)

        processor.render_chat = render_after_health
        body = {"messages": [{"role": "user", "content": "hi"}]}
        statuses: list[int] = []
        worker = threading.Thread(
            target=lambda: statuses.append(client.post("/tokenize", json=body).status_code)
        )
        worker.start()
        assert client.get("/health").status_code == 200
        health_answered.set()
        worker.join()
        assert statuses == [200] and waited == [True]
        processor.render_chat = render
        placeholder = {"messages": [{"role": "user", "content": "a <|image_pad|> b"}]}
        assert (
            client.post("/tokenize", json=placeholder).status_code
            == chat(client, messages=placeholder["messages"]).status_code
            == 400
        )


def api_processes(settings: ServerSettings, model_dir):
    """The apps of `settings.api_server_count` API processes over one fake engine, and the
    shared admission counts they admit against, as the launcher gives them."""
    import multiprocessing

    from server.admission import shared_counts_array

    engine = FakeEngine(str(model_dir / "tokenizer.json"))
    count = settings.api_server_count
    counts = shared_counts_array(multiprocessing.get_context("spawn"), count)
    apps = [build_app(settings, engine, api_server_index=index, admission_counts=counts)
            for index in range(count)]  # fmt: skip
    return counts, apps


def test_api_processes_admit_against_one_budget_together(model_dir):
    """Each process admitted a fixed share of every budget: when the kernel handed most
    connections to one of them (it often does), requests were refused at a fraction of the
    capacity while the others sat idle. The launcher's shared counts make the budgets
    bound the sum over all of them, whichever process a request reaches."""

    from engine.errors import ServerOverloaded

    settings = ServerSettings(
        engine=EngineConfig(model=str(model_dir), max_num_seqs=3),
        max_waiting_requests=2,
        max_waiting_tokens=1000,
        api_server_count=3,
    )
    counts, apps = api_processes(settings, model_dir)
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
    assert list(counts) == [3, 30, 0, 0, 0, 0, 1, 10, 0]
    for ticket in tickets:
        ticket.release()
    assert list(counts) == [0] * 9
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
    client, _ = client_for(model_dir, max_n=20)
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
    client, engine = client_for(model_dir, trust_request_chat_template=True)
    with client:
        tokens = client.post("/tokenize", json=body).json()["tokens"]
        assert tokens == engine.tokenizer.encode("hello world", add_special_tokens=False).ids
    client, _ = client_for(model_dir)
    with client:
        refused = client.post("/tokenize", json=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "chat_template"


def test_requests_downloading_features_never_hold_back_the_others(model_dir):
    """Requests waiting on a store counted in the one budget: a hung store filled it, and
    every request, text too, got 503 "too many requests waiting" while the engine's waiting
    gauge read 0 (fuzz61). They now count in a budget of their own, in every API process."""
    from types import SimpleNamespace

    from engine.errors import ServerOverloaded
    from engine.protocol import FeatureSource, MediaInput, Modality, SamplingParams
    from server.generation import GenerationJob, PreparedPrompt
    from server.request_lifecycle import admit

    settings = ServerSettings(
        engine=EngineConfig(model=str(model_dir), max_num_seqs=1),
        max_waiting_requests=0,
        max_feature_requests=2,
        api_server_count=2,
    )
    counts, apps = api_processes(settings, model_dir)

    def job(url: str | None) -> GenerationJob:
        media = [] if url is None else [
            MediaInput(modality=Modality.IMAGE, content_hash="h", offset=0, num_tokens=4,
                       grid_thw=(1, 4, 4), feature=FeatureSource(url))]  # fmt: skip
        return GenerationJob("r", "tiny", PreparedPrompt([1] * 4, media), SamplingParams(), 1, [])

    rejected: list[str] = []
    state = SimpleNamespace(metrics=SimpleNamespace(on_request_rejected=rejected.append))

    def ask(app, url: str | None):
        return admit(SimpleNamespace(app=app), state, job(url))

    hung = [ask(apps[0], "s3://feat/a"), ask(apps[1], "https://store.test/b")]
    with pytest.raises(ServerOverloaded, match="downloading features"):
        ask(apps[1], "s3://feat/c")
    text = ask(apps[1], None)  # the engine's one running slot: taken
    with pytest.raises(ServerOverloaded, match="too many requests waiting"):
        ask(apps[0], None)
    inline = "data:application/octet-stream;base64,AAAA"  # nothing to download
    with pytest.raises(ServerOverloaded, match="too many requests waiting"):
        ask(apps[0], inline)
    for ticket in [*hung, text]:
        ticket.release()
    assert list(counts) == [0] * 6
    # The client sees one 503 code; the metric tells the budgets apart.
    assert rejected == ["feature_overloaded", "server_overloaded", "server_overloaded"]
