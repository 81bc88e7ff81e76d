"""How a chat is rendered, over HTTP (vLLM's request fields): `continue_final_message`
leaves the last message open so the model carries it on, `add_generation_prompt: false`
ends the prompt after the last turn, and `chat_template_kwargs` reach the template. The
oracle is transformers' `apply_chat_template` with the same arguments; the answer must
equal /v1/completions on the prompt transformers renders."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL_NAME

transformers = pytest.importorskip("transformers")

PREFILLED = [
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Sure: red,"},
]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def hf_ids(hf_tokenizer, messages, **options) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def chat(http, messages, **fields):
    body = {"model": MODEL_NAME, "messages": messages, **GREEDY, **fields}
    return http.post("/v1/chat/completions", json=body)


def completion_text(http, prompt_ids) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt_ids, **GREEDY}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("explicit", [True, False])  # add_generation_prompt: false or left out
def test_continue_final_message_carries_on_the_assistant_turn(http, hf_tokenizer, explicit):
    expected = hf_ids(hf_tokenizer, PREFILLED, add_generation_prompt=False,
                      continue_final_message=True)  # fmt: skip
    fields = {"continue_final_message": True}
    if explicit:
        fields["add_generation_prompt"] = False
    response = chat(http, PREFILLED, **fields)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["choices"][0]["message"]["content"] == completion_text(http, expected)
    tokenized = http.post("/tokenize", json={"messages": PREFILLED, **fields}).json()
    assert tokenized["tokens"] == expected


def test_continue_final_message_streams_the_same_answer(client, http, hf_tokenizer):
    expected = hf_ids(hf_tokenizer, PREFILLED, add_generation_prompt=False,
                      continue_final_message=True)  # fmt: skip
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=PREFILLED, stream=True, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "ignore_eos": True},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == completion_text(http, expected)


def test_no_generation_prompt_ends_after_the_last_turn(http, hf_tokenizer):
    messages = [{"role": "user", "content": "Tell me a story."}]
    expected = hf_ids(hf_tokenizer, messages, add_generation_prompt=False)
    response = chat(http, messages, add_generation_prompt=False)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    assert response.json()["choices"][0]["message"]["content"] == completion_text(http, expected)


def test_chat_template_kwargs_reach_the_template(http, hf_tokenizer, image_server):
    image = {"type": "image_url", "image_url": {"url": f"{image_server}/picture.png"}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]
    hf_messages = [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": "What?"}]}]  # fmt: skip
    kwargs = {"add_vision_id": True}
    with_ids = hf_ids(hf_tokenizer, hf_messages, add_generation_prompt=True, **kwargs)
    without_ids = hf_ids(hf_tokenizer, hf_messages, add_generation_prompt=True)
    assert len(with_ids) > len(without_ids)  # "Picture 1: "
    tokenized = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": kwargs})
    tokens = tokenized.json()["tokens"]
    pad = hf_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    one_pad_each = [t for i, t in enumerate(tokens) if t != pad or tokens[i - 1] != pad]
    assert one_pad_each == with_ids and tokens.count(pad) > 1  # expanded to the image's size
    plain = chat(http, messages, max_tokens=1)
    labelled = chat(http, messages, max_tokens=1, chat_template_kwargs=kwargs)
    assert plain.status_code == labelled.status_code == 200, labelled.text
    added = labelled.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert added == len(with_ids) - len(without_ids)
    assert labelled.json()["usage"]["prompt_tokens"] == len(tokens)  # what the chat feeds


@pytest.mark.parametrize(
    ("messages", "fields", "param"),
    [
        (PREFILLED, {"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        ([PREFILLED[0], {"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
         {"continue_final_message": True}, "messages[1].content"),
        (PREFILLED, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        (PREFILLED, {"chat_template_kwargs": {"messages": [], "add_generation_prompt": 1}},
         "chat_template_kwargs"),
        (PREFILLED, {"chat_template_kwargs": {f"k{i}": i for i in range(65)}},
         "chat_template_kwargs"),
        (PREFILLED, {"chat_template_kwargs": ["add_vision_id"]}, "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_bad_rendering_fields_are_a_400_naming_the_field(http, messages, fields, param):
    response = chat(http, messages, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
