"""`/v1/completions` with a batch of prompts (a list of strings or of token-id lists), as
OpenAI's and vLLM's serve it: prompt `p`'s choice `i` at index `p * n + i`, each the same
as that prompt sent alone, streamed or not; usage summed over the prompts. A list of
several prompts was a 400 ("only one prompt per request")."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from server.field_limits import DEFAULT_FIELD_LIMITS
from tests.e2e.conftest import MODEL_NAME, run_server

PROMPTS = ["The cat sat on", "Once upon a time", "A red"]
BODY = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 2,
        "logprobs": 1, "ignore_eos": True}  # fmt: skip


def completion(http, **fields) -> dict:
    response = http.post("/v1/completions", json={**BODY, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def streamed(http, **fields) -> tuple[dict[int, str], dict]:
    texts: dict[int, str] = defaultdict(str)
    usage, ids = None, set()
    body = {**BODY, **fields, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                ids.add(chunk["id"])
                for choice in chunk["choices"]:
                    texts[choice["index"]] += choice["text"]
                usage = chunk.get("usage") or usage
    assert len(ids) == 1  # one answer id for the whole batch
    return dict(texts), usage


@pytest.mark.parametrize("echo", [False, True])
def test_a_batch_answers_each_prompt_as_if_sent_alone(http, echo):
    alone = [completion(http, prompt=prompt, echo=echo) for prompt in PROMPTS]
    batch = completion(http, prompt=PROMPTS, echo=echo)
    assert [choice["index"] for choice in batch["choices"]] == list(range(6))
    expected = [choice for answer in alone for choice in answer["choices"]]
    for got, want in zip(batch["choices"], expected, strict=True):
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
        got_logprobs, want_logprobs = got["logprobs"], want["logprobs"]
        for field in ("tokens", "text_offset"):
            assert got_logprobs[field] == want_logprobs[field]
        # A step of other rows runs other matrix shapes: the last bits may differ.
        values = [v for v in got_logprobs["token_logprobs"] if v is not None]
        wanted = [v for v in want_logprobs["token_logprobs"] if v is not None]
        assert values == pytest.approx(wanted, abs=1e-3)
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][field] == sum(answer["usage"][field] for answer in alone)
    texts, usage = streamed(http, prompt=PROMPTS, echo=echo)
    assert texts == {choice["index"]: choice["text"] for choice in batch["choices"]}
    assert usage == batch["usage"]


def test_a_batch_of_token_id_prompts_through_the_openai_client(client, http):
    ids = [http.post("/tokenize", json={"model": MODEL_NAME, "prompt": p}).json()["tokens"]
           for p in PROMPTS[:2]]  # fmt: skip
    answer = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5,
                                       temperature=0.0)  # fmt: skip
    assert [choice.index for choice in answer.choices] == [0, 1]
    for choice, prompt in zip(answer.choices, PROMPTS[:2], strict=True):
        alone = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                          temperature=0.0)  # fmt: skip
        assert choice.text == alone.choices[0].text


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (["fine", "x " * 5000], "prompt[1]"),  # past the context
        ([[1, 2], [1, 10**9]], "prompt[1]"),  # not a token id
        (["fine", ""], "prompt[1]"),
        (["a"] * (DEFAULT_FIELD_LIMITS.max_prompts_per_request + 1), "prompt"),
    ],
)
def test_a_bad_prompt_in_a_batch_is_a_400_naming_it(http, prompt, param):
    response = http.post("/v1/completions", json={**BODY, "prompt": prompt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("prompt", [["fine", 5], [[1, 2], "text"], ["fine", "ok", [3]]])
def test_a_batch_of_mixed_kinds_names_the_odd_prompt(http, prompt):
    """The union's error named prompt[0], whichever was wrong (fuzz37)."""
    response = http.post("/v1/completions", json={**BODY, "prompt": prompt})
    assert response.status_code == 400, response.text
    odd = next(i for i, p in enumerate(prompt) if type(p) is not type(prompt[0]))
    assert f"prompt[{odd}] is not a" in response.json()["error"]["message"]


def test_a_batch_prompt_too_long_for_its_max_tokens_is_named_in_the_message(http):
    response = http.post("/v1/completions", json={**BODY, "max_tokens": 1500,
                                                  "prompt": ["a", "x " * 1000]})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and error["message"].startswith("prompt[1]: ")


def test_leaving_a_batch_stream_aborts_every_prompts_choices(http):
    """Each prompt's choices are requests of their own in the metrics (as vLLM counts a
    batch); a client that hangs up aborts them all, none left running."""
    from tests.e2e.test_metrics import scrape, wait_for

    success = "tessera:request_success_total"
    before = scrape(http)[1][success].get("abort", 0)
    body = {**BODY, "prompt": PROMPTS, "max_tokens": 1500, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for number, _ in enumerate(response.iter_lines()):
            if number > 12:
                break  # closing the response hangs up mid-stream

    def settled(samples, by_reason):
        return (by_reason[success].get("abort", 0) - before >= 6
                and samples["tessera:num_requests_running"] == 0)  # fmt: skip

    samples, by_reason = wait_for(http, settled, timeout_s=30)
    assert by_reason[success].get("abort", 0) - before == 6
    assert samples["tessera:num_requests_running"] == 0


def test_a_batch_larger_than_the_servers_room_is_a_400(model_dir, tmp_path):
    """An idle server admits any one request: a batch of 1024 prompts x n=16 held 16384
    sequences, and every other request got 503 meanwhile (fuzz37). A batch must fit."""
    extra = ["--max-num-seqs", "2", "--max-waiting-requests", "2"]
    with run_server(model_dir, tmp_path / "server.log", *extra) as handle:
        body = {**BODY, "n": 2, "prompt": PROMPTS}  # 6 sequences, the room is 4
        response = httpx.post(handle.base_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt" and "smaller batches" in error["message"]
        fits = httpx.post(handle.base_url + "/v1/completions", timeout=60,
                          json={**body, "prompt": PROMPTS[:2]})  # fmt: skip
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 4
