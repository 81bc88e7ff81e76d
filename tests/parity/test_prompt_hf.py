"""PromptProcessor vs transformers' tokenizer: same rendered chat, same token ids."""

from __future__ import annotations

import json

import pytest

from engine.multimodal.prompt import PromptProcessor
from engine.tiny_model import make_tiny_model

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you today?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "Colour of the sky?"}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass? 123 !?"},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "What is in these?"},
                {"type": "image"},
                {"type": "video"},
            ],
        }
    ],
]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Today's weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Lyon."},
        {"role": "user", "content": "Thanks"},
    ],
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, size="tiny")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_encode_match_transformers(model_dir, messages, add_generation_prompt):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = PromptProcessor.from_model_dir(model_dir)
    expected_text = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    text = processor.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == expected_text
    expected_ids = hf_tokenizer(expected_text, add_special_tokens=False)["input_ids"]
    ids = processor.encode(text)
    assert ids == expected_ids
    assert processor.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert processor.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


@pytest.mark.parametrize("messages", TOOL_CONVERSATIONS)
def test_tools_render_as_in_transformers(model_dir, messages):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = PromptProcessor.from_model_dir(model_dir)
    expected = hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert processor.render_chat(messages, tools=TOOLS) == expected
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in expected


PREFILLED = [
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ],
    [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It shows  "}]},
    ],
    [{"role": "user", "content": "Count: one, two,"}],  # any role can be continued
    # Prefills the turn's end also holds: the cut was after their last place in the text,
    # inside `<|im_end|>` (fuzz79)
    *(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": prefill}]
        for prefill in ("e", "end", "<", "|>", "im")
    ),
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  so  "}],
    # blank prefills continue (they were refused: the text itself was looked for; fuzz79)
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " \n "}],
]


@pytest.mark.parametrize("messages", PREFILLED)
def test_continue_final_message_matches_transformers(model_dir, messages):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = PromptProcessor.from_model_dir(model_dir)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    text = processor.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == expected
    assert not text.endswith("<|im_end|>\n")


def test_template_kwargs_reach_the_template_as_in_transformers(model_dir):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = PromptProcessor.from_model_dir(model_dir)
    messages = CONVERSATIONS[2]  # two images and a video
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, add_vision_id=True
    )
    text = processor.render_chat(messages, template_kwargs={"add_vision_id": True})
    assert text == expected
    assert "Picture 2: " in text and "Video 1: " in text


def test_offline_chat_prompts_take_the_rendering_keys(model_dir):
    from engine import LLM, SamplingParams

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(str(model_dir), num_kv_blocks=64)
    try:
        messages = PREFILLED[0]
        prefilled, labelled, bad = llm.generate(
            [
                {"messages": messages, "continue_final_message": True},
                {"messages": CONVERSATIONS[0], "chat_template_kwargs": {"x": 1}},
                {"messages": messages, "chat_template_kwargs": {"tools": []}},
            ],
            SamplingParams(max_tokens=1, temperature=0.0),
        )
    finally:
        llm.close()
    text = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert prefilled.prompt_token_ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert labelled.error is None
    assert bad.error is not None and bad.error.param == "chat_template_kwargs"
