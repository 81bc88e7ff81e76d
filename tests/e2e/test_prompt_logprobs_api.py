"""The prompt's scores over HTTP: OpenAI's `echo` on /v1/completions (the prompt's text,
and with `logprobs` its tokens' logprobs, first, the first one null) and vLLM's
`prompt_logprobs` on both endpoints, streamed or not. The numbers are the offline engine's,
which tests/parity/test_prompt_logprobs.py holds to transformers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from tests.e2e.conftest import MODEL_NAME
from tests.e2e.test_errors_api import assert_error

PROMPT = "the quick brown fox jumps over"
GREEDY = {"temperature": 0, "max_tokens": 3, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline engine's scores of PROMPT (2 alternatives) and its greedy tokens."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        [result] = llm.generate([ids], params)
    return ids, result


def complete(client, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY, **kwargs)


def test_echo_puts_the_prompt_first_streamed_or_not(client):
    plain = complete(client).choices[0]
    echoed = complete(client, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text
    chunks = list(complete(client, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.text


def test_echo_with_logprobs_scores_the_prompt_tokens_too(client, offline):
    ids, reference = offline
    choice = complete(client, echo=True, logprobs=2).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scores = [score.logprob for score in reference.prompt_logprobs]
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(scores, abs=1e-5)
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                                   logprobs.top_logprobs[1:], strict=True):  # fmt: skip
        assert len(top) <= 3 and top[token] == logprob  # the token, then its 2 alternatives
    assert "".join(logprobs.tokens[: len(ids)]) == PROMPT
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets[len(ids)] == len(PROMPT)  # the completion's first
    assert offsets == sorted(offsets)
    streamed = [c.choices[0] for c in complete(client, echo=True, logprobs=2, stream=True)]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.token_logprobs]
    assert tokens == logprobs.token_logprobs


def test_vllm_prompt_logprobs_on_both_endpoints(client, http, offline):
    ids, reference = offline

    def check(entries) -> None:
        assert entries[0] is None and len(entries) == len(ids)
        for position, (entry, score) in enumerate(zip(entries[1:], reference.prompt_logprobs,
                                                      strict=True), start=1):  # fmt: skip
            token = entry[str(ids[position])]
            assert token["logprob"] == pytest.approx(score.logprob, abs=1e-5)
            assert token["rank"] == score.rank
            assert len(entry) <= 3  # the prompt's token and 2 alternatives (or it among them)

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 2}  # fmt: skip
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    check(choice["prompt_logprobs"])
    chat_body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 0,
                 "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
    response = http.post("/v1/chat/completions", json=chat_body).json()
    entries = response["prompt_logprobs"]
    assert entries[0] is None and len(entries) == response["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in entries[1:])  # k = 0: the prompt's token alone
    with http.stream("POST", "/v1/chat/completions", json={**chat_body, "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if '"prompt_logprobs"' in line]
    assert len(chunks) == 1 and str(len(entries)) and '"prompt_logprobs":[null,' in chunks[0]
    plain = http.post("/v1/chat/completions", json={**chat_body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain


def test_logprobs_0_still_names_the_chosen_token_among_the_top_logprobs(client):
    """OpenAI's legacy API (and vLLM) give "up to logprobs+1 elements": the chosen token
    and its alternatives. `logprobs: 0` gave empty dicts."""
    whole = complete(client, logprobs=0).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in complete(client, logprobs=0, stream=True)
              if c.choices and c.choices[0].logprobs]  # fmt: skip
    for parts in ([whole], chunks):
        tops = [top for part in parts for top in part.top_logprobs]
        chosen = [pair for part in parts
                  for pair in zip(part.tokens, part.token_logprobs, strict=True)]  # fmt: skip
        assert len(tops) == 3 and tops == [{token: logprob} for token, logprob in chosen]


def test_too_many_prompt_alternatives_is_a_400(http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 21}
    assert_error(http.post("/v1/completions", json=body), 400, param="prompt_logprobs")


def test_a_streamed_completion_keeps_the_logprobs_of_tokens_whose_text_is_held_back(client):
    """A token that ends inside a UTF-8 character has no text yet; its logprob used to be
    dropped from the stream with its empty chunk."""
    kwargs = {"prompt": "x y", "max_tokens": 24, "temperature": 0, "logprobs": 1,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(model=MODEL_NAME, **kwargs).choices[0].logprobs
    chunks = list(client.completions.create(model=MODEL_NAME, stream=True, **kwargs))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert len(whole.token_logprobs) == 24 and streamed == whole.token_logprobs


def test_echo_with_no_tokens_scores_the_prompt_alone(client, http, offline):
    ids, reference = offline
    kwargs = {"echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **kwargs)
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    scores = [score.logprob for score in reference.prompt_logprobs]
    assert logprobs.token_logprobs[1:] == pytest.approx(scores, abs=1e-5)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **kwargs))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert streamed == logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 0
    for path, body in [("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:  # fmt: skip
        response = http.post(path, json={"model": MODEL_NAME, "max_tokens": 0, **body})
        assert_error(response, 400, param="max_tokens")


def test_echo_with_no_tokens_scores_a_prompt_that_fills_the_context(http):
    """Scoring needs no room to generate: a window of exactly the context was a 400 that
    said the request asked for 1 completion token (it asked for 0), as evaluation
    harnesses send rolling windows of the full length."""
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": MODEL_NAME, "echo": True, "logprobs": 0, "max_tokens": 0,
            "prompt": [5, 6, 7, 8] * (max_model_len // 4)}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (max_model_len, 0)
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == max_model_len
    over = http.post("/v1/completions", json={**body, "prompt": [5] * (max_model_len + 1)})
    assert_error(over, 400, param="prompt")
    full = http.post("/v1/completions", json={**body, "max_tokens": 1, "echo": False})
    assert_error(full, 400, param="max_tokens")


def test_every_choice_shows_the_prompt_scores_once_computed(http, offline):
    ids, reference = offline
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 1.0,
            "seed": 2, "n": 3, "prompt_logprobs": 1, "echo": True, "logprobs": 1}  # fmt: skip
    scores = [score.logprob for score in reference.prompt_logprobs]
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert len(choices) == 3
    for choice in choices:  # computed by the first choice's engine request alone
        assert [e[str(t)]["logprob"] for e, t in zip(choice["prompt_logprobs"][1:], ids[1:],
                                                      strict=True)] == pytest.approx(scores, abs=1e-5)  # fmt: skip
        assert choice["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(scores, abs=1e-5)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "n": 2,
            "max_tokens": 2, "prompt_logprobs": 0}  # fmt: skip
    single = http.post("/v1/chat/completions", json={**chat, "n": 1}).json()["prompt_logprobs"]
    assert http.post("/v1/chat/completions", json=chat).json()["prompt_logprobs"] == single


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_keep_their_own_count_beside_the_echos_logprobs(http, stream):
    """With `echo` and `logprobs: 4` the engine scores the prompt with 4 alternatives, and
    `prompt_logprobs: 1` went out with all 4 too (fuzz77); vLLM's field gives what it asks."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "echo": True, "logprobs": 4, "prompt_logprobs": 1, "stream": stream}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        choice = next(c["choices"][0] for c in chunks if c["choices"][0].get("prompt_logprobs"))
    else:
        choice = response.json()["choices"][0]
    entries = choice["prompt_logprobs"][1:]
    assert entries and all(1 <= len(entry) <= 2 for entry in entries)  # the token, its best
    assert all(len(top) >= 4 for top in choice["logprobs"]["top_logprobs"][1:])
