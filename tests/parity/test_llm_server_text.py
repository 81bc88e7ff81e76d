"""The offline LLM against the server for the same request: `n` choices (seeded choice `i`
samples with `seed + i`), stop strings (`include_stop_str_in_output`, `stop_reason`) and
stop tokens (their text left out) give the same text, tokens and endings on both paths.

The server is the real app (server/app.py) over the LLM's own EngineCore, stepped on the
app's event loop by `CoreEngine`: one model, the HTTP path's rendering, sampling and
detokenisation against the offline one's."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.tiny_model import make_tiny_model
from tests.e2e.test_stop_api import a_stop_inside  # the e2e stop tests pick theirs so

MODEL = "tiny"
PROMPT = "the quick brown fox jumps over"
MESSAGES = [{"role": "user", "content": "Describe a dog in the park."}]


class CoreEngine:
    """The server's engine client over an in-process EngineCore: each `generate` adds its
    request and steps the core until its own outputs come (another's go to their queues)."""

    def __init__(self, core) -> None:
        self.core = core
        self.ready = core.ready
        self.is_alive = True
        self._queues: dict[str, list] = {}

    async def abort(self, request_ids) -> None:
        self.core.abort_requests(list(request_ids))

    async def generate(self, request, tensors=(), *, tokens_per_wake=1):
        queue = self._queues[request.request_id] = []
        self.core.add_request(request, tensors)
        try:
            while True:
                await asyncio.sleep(0)  # the other choices add their requests first
                if not queue:
                    assert self.core.has_unfinished_requests()
                    for output in self.core.step().outputs:
                        if output.request_id in self._queues:
                            self._queues[output.request_id].append(output)
                    continue
                output = queue.pop(0)
                yield output
                if output.finish_reason is not None:
                    return
        finally:
            del self._queues[request.request_id]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("llm_server_text"), seed=0)
    with LLM(str(model_dir), num_kv_blocks=128, generation_config="none") as llm:
        yield llm


@pytest.fixture(scope="module")
def http(llm):
    from fastapi.testclient import TestClient

    from server.app import build_app
    from server.settings import ServerSettings

    model = str(llm.engine.config.model)
    settings = ServerSettings(engine=EngineConfig(model=model, served_model_name=MODEL),
                              generation_config="none")  # fmt: skip
    with TestClient(build_app(settings, CoreEngine(llm.engine))) as client:
        yield client


def completion(http, **fields) -> list[dict]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def chat(http, **fields) -> list[dict]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def offline(result) -> list[tuple]:
    return [(o.text, o.finish_reason, o.stop_reason) for o in result.outputs]


def served(choices: list[dict], key: str = "text") -> list[tuple]:
    return [
        (c["message"]["content"] if key == "message" else c["text"], c["finish_reason"],
         c["stop_reason"])
        for c in choices
    ]  # fmt: skip


def test_n_seeded_choices_are_the_servers(llm, http):
    fields = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
    [result] = llm.generate(PROMPT, SamplingParams(n=3, **fields))
    assert len(result.outputs) == 3 and [o.index for o in result.outputs] == [0, 1, 2]
    assert len({o.text for o in result.outputs}) == 3  # seed + i: three different choices
    assert offline(result) == served(completion(http, n=3, **fields))
    # The flat fields stay the first choice's, as before n existed.
    first = result.outputs[0]
    assert (result.text, result.token_ids, result.finish_reason) == (
        first.text, first.token_ids, first.finish_reason)  # fmt: skip
    # One choice of a seeded request is the request with n 1 (no seed + i).
    [alone] = llm.generate(PROMPT, SamplingParams(n=1, **fields))
    assert alone.text == first.text


def test_n_chat_choices_are_the_servers(llm, http):
    fields = {"temperature": 0.8, "seed": 11}
    [result] = llm.chat(MESSAGES, SamplingParams(n=2, max_tokens=16, **fields))
    assert offline(result) == served(chat(http, n=2, **fields), "message")


@pytest.mark.parametrize("arguments", ['{"x": 1}', "", None])
def test_a_replayed_tool_call_renders_as_on_the_server(llm, http, arguments):
    """A call's arguments come back as a JSON string (the openai client's), or empty: the
    server hands the template objects, and offline the string went in as it came, a
    prompt of other tokens and another answer (fuzz87)."""
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]  # fmt: skip
    [result] = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))
    assert result.error is None, result.error
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert result.prompt_token_ids == tokenized.json()["tokens"]
    [choice] = chat(http, messages=messages, max_tokens=8, temperature=0.0)
    assert result.text == choice["message"]["content"]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_cuts_the_text_as_the_server_does(llm, http, include):
    greedy = {"temperature": 0.0, "ignore_eos": True}
    [full] = llm.generate(PROMPT, SamplingParams(max_tokens=16, **greedy))
    stop = a_stop_inside(full.text)
    params = SamplingParams(max_tokens=16, stop=[stop, "never-seen"],
                            include_stop_str_in_output=include, **greedy)  # fmt: skip
    [result] = llm.generate(PROMPT, params)
    # The engine request was aborted at the stop string, and nothing of it is left.
    assert not llm.engine.has_unfinished_requests()
    end = full.text.index(stop) + (len(stop) if include else 0)
    assert (result.text, result.finish_reason, result.stop_reason) == (
        full.text[:end], "stop", stop)  # fmt: skip
    assert result.token_ids == full.token_ids[: len(result.token_ids)]
    assert len(result.token_ids) < len(full.token_ids)  # the tokens after it are dropped
    choices = completion(http, stop=[stop, "never-seen"], include_stop_str_in_output=include,
                         **greedy)  # fmt: skip
    assert offline(result) == served(choices)


def test_stop_strings_with_n_end_each_choice_alone(llm, http):
    fields = {"temperature": 1.0, "seed": 3, "max_tokens": 16}
    [free] = llm.generate(PROMPT, SamplingParams(n=4, **fields))
    stop = a_stop_inside(free.outputs[1].text)
    [result] = llm.generate(PROMPT, SamplingParams(n=4, stop=stop, **fields))
    assert result.outputs[1].stop_reason == stop
    assert offline(result) == served(completion(http, n=4, stop=stop, **fields))


def test_a_stop_token_leaves_its_text_out_as_the_server_does(llm, http):
    """A stop token ends the answer and counts, but its text is no part of it (vLLM's
    rule, the server's): the offline text was the decoded tokens, stop token included."""
    stop_token = 77
    fields = {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": [stop_token],
              "logit_bias": {str(stop_token): 100.0}}  # fmt: skip
    params = SamplingParams(max_tokens=12, min_tokens=3, temperature=0.0,
                            stop_token_ids=(stop_token,), logit_bias=((stop_token, 100.0),))  # fmt: skip
    [result] = llm.generate(PROMPT, params)
    assert result.token_ids[-1] == stop_token and len(result.token_ids) == 4
    assert (result.finish_reason, result.stop_reason) == ("stop", stop_token)
    assert result.text == llm.prompt_processor.decode(result.token_ids[:-1])
    assert offline(result) == served(completion(http, max_tokens=12, **fields))


def test_bad_n_and_stop_fail_their_prompt_alone(llm):
    good = SamplingParams(max_tokens=4, temperature=0.0)
    results = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [SamplingParams(n=0), SamplingParams(stop=["", "x"]), good],
    )
    assert [r.error.param if r.error else None for r in results] == ["n", "stop", None]
    assert results[2].finish_reason == "length" and len(results[2].token_ids) == 4


def test_logprobs_end_with_the_choice_as_on_the_server(llm, http):
    """Each choice's logprobs are its tokens', the stop string's last token the last: the
    tokens after it are no part of the answer (buffered or not, n 1 or n 2)."""
    fields = {"temperature": 1.0, "seed": 5, "max_tokens": 16, "logprobs": 1}
    [free] = llm.generate(PROMPT, SamplingParams(n=2, **fields))
    stop = a_stop_inside(free.outputs[0].text)
    for extra in ({}, {"stop": [stop]}):
        [result] = llm.generate(PROMPT, SamplingParams(n=2, **fields, **extra))
        choices = completion(http, n=2, **fields, **extra)
        for output, choice in zip(result.outputs, choices, strict=True):
            assert [lp.token_id for lp in output.logprobs] == output.token_ids
            assert [lp.logprob for lp in output.logprobs] == pytest.approx(
                choice["logprobs"]["token_logprobs"], abs=1e-5)  # fmt: skip
            # vLLM's cumulative_logprob: the sum of the answer's token logprobs
            assert output.cumulative_logprob == pytest.approx(
                sum(choice["logprobs"]["token_logprobs"]), abs=1e-4)  # fmt: skip
    assert result.outputs[0].stop_reason == stop
    assert free.outputs[0].cumulative_logprob is not None
    [plain] = llm.generate(PROMPT, SamplingParams(max_tokens=2))
    assert plain.outputs[0].cumulative_logprob is None  # as vLLM's, without logprobs
