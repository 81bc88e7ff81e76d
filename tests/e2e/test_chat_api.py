"""The OpenAI API of a real `tessera serve` process, through the `openai` client and httpx."""

from __future__ import annotations

import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from bench.local_inputs import picture, png_bytes
from tests.e2e.conftest import API_KEY, MODEL_NAME

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_message(url: str, text: str = "What is in this picture?") -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


TEXT_PART = {"type": "text", "text": "What happens in this clip?"}


def video_message(url: str, text: str = "What happens in this clip?") -> list[dict]:
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def fetch(url: str) -> bytes:
    return httpx.get(url).content


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def stream_text(client, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_and_version(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME  # was a 404
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("some/other-model")
    assert caught.value.body["code"] == "model_not_found"
    assert "version" in http.get("/version").json()


def test_chat_text_nonstream_and_stream_agree(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=user("Tell me about the sea."), max_tokens=12, **GREEDY
    )
    choice = response.choices[0]
    assert response.object == "chat.completion" and choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12
    text, chunks = stream_text(client, messages=user("Tell me about the sea."), max_tokens=12,
                               stream_options={"include_usage": True}, **GREEDY)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_data_image_and_http_image_agree(client, image_server):
    kwargs = {"model": MODEL_NAME, "max_tokens": 8, **GREEDY}
    by_data = client.chat.completions.create(
        messages=image_message(data_url(picture(112, 84, 1))), **kwargs)
    by_http = client.chat.completions.create(
        messages=image_message(image_server + "/picture.png"), **kwargs)
    text_only = client.chat.completions.create(messages=user("What is in this picture?"), **kwargs)
    assert by_data.choices[0].message.content == by_http.choices[0].message.content
    assert by_data.usage.prompt_tokens == by_http.usage.prompt_tokens
    assert by_data.usage.prompt_tokens > text_only.usage.prompt_tokens + 4  # image tokens
    text, _ = stream_text(client, messages=image_message(image_server + "/picture.png"),
                          max_tokens=8, **GREEDY)
    assert text == by_http.choices[0].message.content


def test_n2_choices_and_usage(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=user("Pick a word."), max_tokens=6, n=2, temperature=1.0,
        seed=3, extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    single = client.chat.completions.create(
        model=MODEL_NAME, messages=user("Pick a word."), max_tokens=6, **GREEDY)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens
    assert response.usage.completion_tokens == 12


def test_stop_string_spanning_token_boundary(client, model_dir):
    messages = user("Describe a dog in the park.")
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24,
                                          logprobs=True, **GREEDY)
    tokens = [t.token for t in full.choices[0].logprobs.content]
    text = full.choices[0].message.content
    # Build a stop string from the end of token 3 and the start of token 4.
    boundary = len("".join(tokens[:4]))
    index = next(i for i in range(4, len(tokens) - 1)
                 if tokens[i] and tokens[i + 1] and "\ufffd" not in tokens[i] + tokens[i + 1])
    boundary = len("".join(tokens[: index + 1]))
    stop = text[boundary - 1 : boundary + 1]
    assert len(stop) == 2
    expected = text[: text.index(stop)]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                              max_tokens=24, stop=[stop], **GREEDY)
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    streamed, chunks = stream_text(client, messages=messages, max_tokens=24, stop=stop, **GREEDY)
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(stop not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_logprobs_shape(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=user("Hi"), max_tokens=5, logprobs=True, top_logprobs=3,
        **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        # greedy: the chosen token is the best alternative
        assert entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_logit_bias_forces_a_token_and_an_unknown_token_is_400(client, http):
    forced = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "hello"}).json()
    forced = forced["tokens"][0]
    expected = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": [forced] * 4})
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=user("Hi"), max_tokens=4, logit_bias={str(forced): 100},
        **GREEDY)
    assert response.choices[0].message.content == expected.json()["prompt"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=user("Hi"), max_tokens=2,
                                       logit_bias={"99999999": 5})  # fmt: skip
    assert info.value.status_code == 400 and info.value.body["param"] == "logit_bias"


def test_allowed_token_ids_restrict_every_pick(http):
    allowed = [100, 200, 300, 400]
    body = {"model": MODEL_NAME, "messages": user("Hi"), "max_tokens": 12, "temperature": 1.0,
            "seed": 4, "logprobs": True, "return_tokens_as_token_ids": True,
            "allowed_token_ids": allowed, "ignore_eos": True}  # fmt: skip
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["logprobs"]["content"]
    picked = {int(entry["token"].removeprefix("token_id:")) for entry in entries}
    assert len(entries) == 12 and picked <= set(allowed) and len(picked) > 1
    for bad in ([], [99999999], [-1]):
        response = http.post("/v1/chat/completions", json={**body, "allowed_token_ids": bad})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith("allowed_token_ids")


def test_bad_words_are_never_written(http):
    body = {"model": MODEL_NAME, "messages": user("Hi"), "max_tokens": 12, "temperature": 0,
            "logprobs": True, "return_tokens_as_token_ids": True, "ignore_eos": True}  # fmt: skip

    def token_ids(**fields) -> list[int]:
        response = http.post("/v1/chat/completions", json={**body, **fields})
        assert response.status_code == 200, response.text
        entries = response.json()["choices"][0]["logprobs"]["content"]
        return [int(entry["token"].removeprefix("token_id:")) for entry in entries]

    free = token_ids()
    word = http.post("/detokenize", json={"tokens": free[2:4]}).json()["prompt"].strip()
    sequences = [http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
                 .json()["tokens"] for text in (word, " " + word)]  # fmt: skip
    assert any(free[i : i + len(s)] == s for s in sequences for i in range(len(free)))
    banned = token_ids(bad_words=[word])
    assert banned != free
    assert not any(banned[i : i + len(s)] == s for s in sequences for i in range(len(banned)))
    for bad in ([""], ["x"] * 129, "word"):
        response = http.post("/v1/chat/completions", json={**body, "bad_words": bad})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith("bad_words")


def test_min_tokens_holds_back_eos(client, model_dir):
    eos = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("<|im_end|>")
    kwargs = {"model": MODEL_NAME, "messages": user("Hi"), "max_tokens": 8, "temperature": 0,
              "logit_bias": {str(eos): 100}}  # fmt: skip
    at_once = client.chat.completions.create(**kwargs)
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(**kwargs, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    del kwargs["model"]
    streamed, _ = stream_text(client, **kwargs, extra_body={"min_tokens": 5})
    assert streamed == held.choices[0].message.content


def test_seed_reproducible(client):
    kwargs = {"model": MODEL_NAME, "messages": user("Say something."), "max_tokens": 16,
              "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    first = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    second = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    other = client.chat.completions.create(seed=99, **kwargs).choices[0].message.content
    assert first == second
    assert first != other


def test_n_choices_of_a_seed_at_the_top_of_its_range_are_answered(client):
    """Choice i draws with seed + i: 2**63 - 1 and n=2 gave choice 1 a seed of 2**63, which
    the engine refused (a 400 naming a seed the client never sent). It wraps now."""
    kwargs = {"model": MODEL_NAME, "messages": user("Say something."), "max_tokens": 4,
              "temperature": 1.0, "n": 3, "extra_body": {"ignore_eos": True}}  # fmt: skip
    top = client.chat.completions.create(seed=2**63 - 1, **kwargs)
    assert [len(c.message.content or "") > 0 for c in top.choices] == [True] * 3
    bottom = client.chat.completions.create(seed=-(2**63), **{**kwargs, "n": 2})
    # choice 1 of 2**63 - 1 draws with the seed choice 0 of -2**63 draws with
    assert top.choices[1].message.content == bottom.choices[0].message.content


def test_completions_endpoint(client, model_dir):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False).ids
    by_text = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox",
                                        max_tokens=8, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_ids.choices[0].text


def test_tokenize_detokenize(http):
    tokens = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]})
    assert back.json()["prompt"] == "hello world"
    # vLLM's `return_token_strs`: each token's own string (it was ignored).
    named = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert named.json()["token_strs"][-1] == "Ġworld" and "token_strs" not in tokens


def test_tokenize_counts_a_chat_with_media_as_the_chat_feeds_it(http):
    """One placeholder an image: 32 tokens where the chat fed 35; and an image the chat
    refuses was a 200 (vLLM's /tokenize expands them too)."""
    messages = image_message(data_url(picture(64, 48, 3)), text="what?")
    tokenized = http.post("/tokenize", json={"messages": messages}).json()
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
    answered = http.post("/v1/chat/completions", json=body).json()
    assert tokenized["count"] == answered["usage"]["prompt_tokens"] == len(tokenized["tokens"])
    broken = image_message("data:image/png;base64,AAAA")
    refused = http.post("/tokenize", json={"messages": broken})
    assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("messages")
    narrowed = {"mm_processor_kwargs": {"max_pixels": 56 * 56}}  # sized as the chat sizes it
    big = image_message(data_url(picture(256, 256, 4)), text="what?")
    tokenized = http.post("/tokenize", json={"messages": big, **narrowed}).json()
    answered = http.post("/v1/chat/completions", json={**body, "messages": big, **narrowed})
    assert tokenized["count"] == answered.json()["usage"]["prompt_tokens"]


def test_tokenize_leaves_media_uuids_to_the_chats(http):
    """Counting an image under a uuid remembered it: a uuid-only chat then named a size
    the engine had never encoded, and failed (it answered before)."""
    sent = [{"type": "image_url", "image_url": {"url": data_url(picture(56, 56, 5))},
             "uuid": "counted-1"}, {"type": "text", "text": "what?"}]  # fmt: skip
    chat = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": sent}]}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    other_size = [{**sent[0], "image_url": {"url": data_url(picture(112, 84, 6))}}, sent[1]]
    counted = http.post("/tokenize", json={"messages": [{"role": "user", "content": other_size}]})
    assert counted.status_code == 200
    by_uuid = [{"type": "image_url", "uuid": "counted-1"}, sent[1]]
    again = http.post("/v1/chat/completions",
                      json={**chat, "messages": [{"role": "user", "content": by_uuid}]})  # fmt: skip
    assert again.status_code == 200, again.text


def test_concurrent_streams_match_offline_engine(client, model_dir):
    from engine.llm import LLM
    from engine.protocol import SamplingParams

    prompts = [f"Story number {i} about the {['sea', 'wind', 'rain', 'sun'][i % 4]}."
               for i in range(16)]

    def one(prompt: str) -> str:
        return stream_text(client, messages=user(prompt), max_tokens=10, **GREEDY)[0]

    with ThreadPoolExecutor(max_workers=16) as pool:
        served = list(pool.map(one, prompts))
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    offline = llm.generate([{"messages": user(p)} for p in prompts], params)
    assert served == [result.text for result in offline]


def _metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_idle(http, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (_metric(http, "tessera:num_requests_running") == 0
                and _metric(http, "tessera:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.1)
    raise AssertionError("the engine did not free the request's KV blocks")


def _wait_running(http, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(http, "tessera:num_requests_running") < 1:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.05)
    assert _metric(http, "tessera:kv_cache_usage_perc") > 0


LONG = {"model": MODEL_NAME, "messages": user("Talk forever."), "max_tokens": 1900,
        "temperature": 0, "ignore_eos": True}


def test_stream_disconnect_frees_kv(server, http):
    _wait_idle(http)
    with httpx.Client(base_url=server.base_url, timeout=60) as session:
        with session.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            _wait_running(http)
    _wait_idle(http)


def test_nonstream_disconnect_frees_kv(server, http):
    _wait_idle(http)

    def doomed() -> None:
        try:
            httpx.post(server.base_url + "/v1/chat/completions", json=LONG, timeout=1.5)
        except httpx.TimeoutException:
            pass

    thread = threading.Thread(target=doomed)
    thread.start()
    _wait_running(http)
    thread.join()
    _wait_idle(http)


def test_api_key_enforced(keyed_server):
    url = keyed_server.base_url
    body = {"model": MODEL_NAME, "messages": user("hi"), "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(url + "/v1/chat/completions", json=body, headers=good).status_code == 200
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL_NAME


def test_http_route_label_is_template(http):
    http.get("/v1/does-not-exist-12345")
    metrics = http.get("/metrics").text
    assert "does-not-exist-12345" not in metrics
    assert 'route="/v1/chat/completions"' in metrics
