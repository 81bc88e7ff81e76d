"""Every error is `{"error": {message, type, param, code}}` with the right status; bad
input never gets a 5xx. (An engine death, a 503 and an SSE error event: test_faults.py.)"""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, run_server

TEXT = [{"role": "user", "content": "hi"}]


def post(http, body, path="/v1/chat/completions"):
    return http.post(path, json=body)


def assert_error(response, status, code=None, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def chat(**fields):
    return {"model": MODEL_NAME, "messages": TEXT, "max_tokens": 2, **fields}


def image(url):
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def test_unknown_model(http):
    assert_error(post(http, chat(model="gpt-17")), 404, "model_not_found", "model")
    body = {"model": "gpt-17", "prompt": "x"}
    assert_error(post(http, body, "/v1/completions"), 404, "model_not_found", "model")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "messages[0].content[0]",
        ),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"stop": ["", "zz"]}, "stop"),  # it was dropped silently; vLLM refuses it
        ({"stop": ""}, "stop"),
        ({"mm_processor_kwargs": {"fps": 0}}, "mm_processor_kwargs.fps"),
        ({"mm_processor_kwargs": {"max_frames": 0}}, "mm_processor_kwargs.max_frames"),
        ({"mm_processor_kwargs": {"num_frames": 8}}, "mm_processor_kwargs"),
        ({"mm_processor_kwargs": {"min_pixels": 9000, "max_pixels": 3000}}, "mm_processor_kwargs"),
        ({"mm_processor_kwargs": "fast"}, "mm_processor_kwargs"),
        ({"priority": 1}, "priority"),  # the default policy is fcfs
    ],
)
def test_invalid_values_are_400_with_param(http, fields, param):
    assert_error(post(http, chat(**fields)), 400, param=param)


@pytest.mark.parametrize("route, field, value, reason", [
    ("/v1/completions", "repetition_penalty", b"1e400", "the number 1e400 is past a float's range"),
    ("/v1/completions", "temperature", b"NaN", "NaN is not a JSON number"),
    ("/v1/completions", "top_p", b"-Infinity", "-Infinity is not a JSON number"),
    # a free-form field the answer echoes: the answer failed to encode, a 500 (fuzz85)
    ("/v1/responses", "text", b'{"format": {"type": "text"}, "verbosity": NaN}', "NaN"),
])  # fmt: skip
def test_numbers_json_does_not_have_are_invalid_json(http, route, field, value, reason):
    """Python's parser reads NaN, Infinity and 1e400 (as inf); JSON has none of them. The
    messages said "in (0.0, inf]" or, for NaN, "less than or equal to 2" (fuzz82)."""
    body = b'{"model": "%s", "prompt": "x", "input": "x", "max_tokens": 1, "%s": %s}'
    response = http.post(route, content=body % (MODEL_NAME.encode(), field.encode(), value),
                         headers={"content-type": "application/json"})  # fmt: skip
    error = assert_error(response, 400)
    assert error["code"] == "invalid_json" and reason in error["message"], error


def test_a_float_field_read_from_a_string_must_be_finite(http):
    """Pydantic reads the string "nan" as a float: the bound's message did not say why."""
    response = post(http, {"model": MODEL_NAME, "messages": TEXT, "temperature": "nan"})
    error = assert_error(response, 400, param="temperature")
    assert error["message"] == "invalid value for 'temperature': Input should be a finite number"


def test_missing_model_field_and_bad_json(http):
    assert_error(post(http, {"messages": TEXT}), 400, param="model")
    response = http.post(
        "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert_error(response, 400)


def test_context_length_exceeded(http):
    error = assert_error(post(http, chat(max_tokens=5000)), 400, "context_length_exceeded")
    assert "2048" in error["message"] and "5000" in error["message"]
    long_prompt = "word " * 3000
    error = assert_error(
        post(
            http, {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 10}, "/v1/completions"
        ),
        400,
        "context_length_exceeded",
    )
    assert "2048" in error["message"]


def test_bad_images_name_the_part(http, image_server):
    cases = [
        "data:image/png;base64," + base64.b64encode(b"not a png").decode(),
        "data:image/png;base64,!!!!",
        image_server + "/missing.png",
        image_server + "/not_an_image.png",
        "ftp://127.0.0.1/x.png",
        "http://127.0.0.1:1/unreachable.png",
    ]
    for url in cases:
        assert_error(
            post(http, chat(messages=image(url))), 400, "invalid_media", "messages[0].content[1]"
        )


def test_bad_videos_name_the_part(http, image_server):
    def video(url):
        return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]

    cases = [
        "data:video/mp4;base64," + base64.b64encode(b"not a video").decode(),
        "data:video/mp4;base64," + base64.b64encode(b"#EXTM3U\nfile:///etc/passwd\n").decode(),
        image_server + "/missing.mp4",
        image_server + "/picture.png",  # an image is not a video
        image_server + "/clip.mp4?ignored",  # fine: the control case below
    ]
    for url in cases[:-1]:
        assert_error(
            post(http, chat(messages=video(url))), 400, "invalid_media", "messages[0].content[0]"
        )
    assert post(http, chat(messages=video(cases[-1]))).status_code == 200


def test_media_processing_over_the_server_bounds(http, image_server):
    # A request may narrow the preprocessing, never widen it (one request, one bound).
    clip = [{"type": "video_url", "video_url": {"url": image_server + "/clip.mp4"}}]
    messages = [{"role": "user", "content": clip}]
    for options, param in [
        ({"max_frames": 33}, "mm_processor_kwargs.max_frames"),  # --max-video-frames 32
        ({"max_pixels": 10**12}, "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": 10**12}, "mm_processor_kwargs.min_pixels"),
    ]:
        error = assert_error(
            post(http, chat(messages=messages, mm_processor_kwargs=options)), 400, param=param
        )
        assert "over" in error["message"]
    ok = post(http, chat(messages=messages, mm_processor_kwargs={"max_frames": 32}))
    assert ok.status_code == 200, ok.text


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics", "/v1/models",
                                  f"/v1/models/{MODEL_NAME}"])  # fmt: skip
def test_head_answers_as_get_without_a_body(http, path):
    """Load balancers and `curl -I` probe with HEAD; it was a 405 on every route (fuzz82)."""
    got, head = http.get(path), http.head(path)
    assert got.status_code == head.status_code == 200, head.text
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]


def test_a_huge_prompt_leaves_the_server_answering(server, capsys):
    """bench/long_prompts.py against the real server: a prompt that cannot fit is refused
    before it is tokenised, and a long /tokenize runs off the event loop (before, /health
    waited 2.1 s and 17.4 s for them, 2026-11-27)."""
    from bench import long_prompts

    argv = ["--base-url", server.base_url, "--tokenize-words", "600000",
            "--completion-words", "3000000", "--delay", "0.2"]  # fmt: skip
    assert long_prompts.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    tokenize, completion = ([cell.strip() for cell in line.split("|")[2:5]] for line in lines)
    assert tokenize[0] == "200" and float(tokenize[2]) < float(tokenize[1]) / 2
    assert completion[0] == "400" and float(completion[1]) < 2.0


@pytest.fixture(scope="module")
def short_cache_http(model_dir, tmp_path_factory):
    """A KV cache of 8 blocks of 16 tokens (128 slots) under a context of 512 tokens."""
    log_path = tmp_path_factory.mktemp("logs") / "short_cache_server.log"
    extra = ("--num-kv-blocks", "8", "--max-model-len", "512")
    with run_server(model_dir, log_path, *extra) as handle:
        with httpx.Client(base_url=handle.base_url, timeout=120) as session:
            yield session


def test_a_kv_cache_shorter_than_the_context_bounds_requests_before_they_start(short_cache_http):
    """Every request that left max_tokens out was refused (its default, the context's room,
    could not fit the cache) naming max_tokens, which it never sent; and a stream that
    asked for too much got a 200 and then an error event."""
    http = short_cache_http
    body = chat()
    del body["max_tokens"]
    answer = post(http, body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 128
    for fields, path in (({"max_completion_tokens": 400}, "/v1/chat/completions"),
                         ({"max_completion_tokens": 400, "stream": True}, "/v1/chat/completions"),
                         ({"max_tokens": 400, "stream": True}, "/v1/completions")):  # fmt: skip
        body = chat(**fields)
        if path == "/v1/completions":
            body = {"model": MODEL_NAME, "prompt": "hi", **fields}
        param = next(iter(fields))
        error = assert_error(post(http, body, path), 400, "context_length_exceeded", param)
        assert "KV cache holds 128" in error["message"]


def test_the_context_error_names_the_field_that_asked(http):
    body = chat(max_completion_tokens=5000)
    del body["max_tokens"]
    assert_error(post(http, body), 400, "context_length_exceeded", "max_completion_tokens")
