"""Text-only models served over HTTP (a Qwen2 language model, and Llama with its BOS and
llama3 rotary scaling): chat and completions answer as transformers does, /tokenize counts
what /v1/completions will run, and an image part is a clear 400 that leaves the server
serving."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from bench.datasets import data_url  # noqa: E402
from bench.local_inputs import picture, png_bytes  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.e2e.conftest import MODEL_NAME, run_server  # noqa: E402

NUM_NEW = 12
GREEDY = {"temperature": 0, "max_tokens": NUM_NEW, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), size=request.param, seed=6)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("text_http_log") / "server.log"
    with run_server(model_dir, log) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_and_completions_match_transformers(client, model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None

    def expected(ids: list[int]) -> str:
        inputs = torch.tensor([ids])
        with torch.no_grad():  # the mask given: without it a BOS that is the pad id is masked
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                 max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                 do_sample=False)  # fmt: skip
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    messages = [{"role": "user", "content": "Name three rivers."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == expected(ids)
    prompt = "Once upon a time"
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    prompt_ids = tokenizer(prompt)["input_ids"]  # with a Llama tokenizer's BOS
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.choices[0].text == expected(prompt_ids)


def test_tokenize_counts_what_completions_run(server, model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    url = server.base_url + "/tokenize"
    body = {"model": MODEL_NAME, "prompt": "Once upon a time"}
    with_special = httpx.post(url, json=body, timeout=30).json()["tokens"]
    without = httpx.post(url, json={**body, "add_special_tokens": False}, timeout=30).json()
    assert with_special == tokenizer("Once upon a time")["input_ids"]
    assert without["tokens"] == tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]


def test_echoed_text_offsets_index_the_echo_past_a_bos(client, model_dir):
    """A Llama tokenizer adds a BOS the prompt string lacks: its offset is the echo's start
    and it takes no room. Before, the prompt's offsets counted the BOS's name (13 past
    their text) and the completion's went back to the echo's end."""
    prompt = "Once upon a time"
    choice = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, logprobs=0,
                                       **GREEDY).choices[0]  # fmt: skip
    text, tokens = choice.text, choice.logprobs.tokens
    offsets = choice.logprobs.text_offset
    assert text.startswith(prompt) and offsets == sorted(offsets) and offsets[0] == 0
    words = [(token, offset) for token, offset in zip(tokens, offsets, strict=True)
             if token.strip() and token.isascii()
             and not token.startswith(("<|", "bytes:"))]  # fmt: skip
    assert len(words) > 3
    assert all(text[offset : offset + len(token)] == token for token, offset in words)


def test_a_batchs_echo_is_each_prompt_as_given(client):
    """fuzz103: with two prompts or more, each echo was its ids decoded, a Llama BOS's name
    in front ("<|endoftext|>Once upon"), where one prompt echoed as given."""
    prompts = ["Once upon a time", "The cat sat"]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, echo=True, **GREEDY)
    for prompt, choice in zip(prompts, batch.choices, strict=True):
        alone = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, **GREEDY)
        assert choice.text.startswith(prompt) and choice.text == alone.choices[0].text


def test_an_image_part_is_a_400_and_the_server_goes_on(server, client):
    image = {"type": "image_url", "image_url": {"url": data_url(png_bytes(picture(56, 56, 2)),
                                                                "image/png")}}  # fmt: skip
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}],
        "max_tokens": 4,
    }
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "image" in error["message"]
    after = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert after.choices[0].finish_reason == "length"
