"""PromptProcessor: chat rendering, tokenisation, placeholder expansion and its errors."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, models

from engine.errors import InvalidRequest, MediaError, ModelLoadError
from engine.multimodal.prompt import PlaceholderSpan, PromptProcessor
from engine.tiny_model import make_tiny_model

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, size="tiny")


@pytest.fixture(scope="module")
def processor(model_dir):
    return PromptProcessor.from_model_dir(model_dir)


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


IMAGE_URL = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def test_special_token_ids_match_config(processor, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert processor.image_token_id == config["image_token_id"]
    assert processor.video_token_id == config["video_token_id"]
    assert processor.vision_start_token_id == config["vision_start_token_id"]
    assert processor.vision_end_token_id == config["vision_end_token_id"]
    im_end = processor.tokenizer.token_to_id("<|im_end|>")
    endoftext = processor.tokenizer.token_to_id("<|endoftext|>")
    assert set(processor.eos_token_ids) == {im_end, endoftext}
    assert processor.pad_token_id == endoftext
    assert processor.image_token_id in processor.special_token_ids


def test_render_text_adds_default_system_message(processor):
    text = processor.render_chat([{"role": "user", "content": "Hello there"}])
    assert (
        text == DEFAULT_SYSTEM + "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_explicit_system_and_no_generation_prompt(processor):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello!"},
    ]
    text = processor.render_chat(messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_render_media_parts_become_placeholders(processor):
    messages = _user(
        IMAGE_URL,
        {"type": "text", "text": "and"},
        {"type": "image_features", "image_features": {"url": "s3://b/k"}},
        {"type": "video", "video": "x"},
        {"type": "video_features", "video_features": {"url": "s3://b/v"}},
    )
    text = processor.render_chat(messages)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    video = "<|vision_start|><|video_pad|><|vision_end|>"
    assert f"user\n{image}and{image}{video}{video}<|im_end|>" in text


def test_normalisation_does_not_touch_caller_messages(processor):
    messages = _user(IMAGE_URL)
    processor.render_chat(messages)
    assert messages[0]["content"][0] is IMAGE_URL and IMAGE_URL["type"] == "image_url"


def test_encode_recognises_special_tokens_and_decode_skips_them(processor):
    ids = processor.encode("<|im_start|>user\nhello world<|im_end|>")
    assert ids[0] == processor.tokenizer.token_to_id("<|im_start|>")
    assert ids[-1] == processor.tokenizer.token_to_id("<|im_end|>")
    assert processor.decode(ids) == "user\nhello world"
    assert (
        processor.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\nhello world<|im_end|>"
    )
    assert processor.encode("hello") == processor.encode("hello")  # no BOS/EOS added


def test_expand_placeholders_spans(processor):
    image, video = processor.image_token_id, processor.video_token_id
    token_ids = [1, 2, image, 3, video, image, 4]
    result = processor.expand_placeholders(token_ids, [("image", 3), ("video", 2), ("image", 1)])
    assert result.token_ids == [1, 2, image, image, image, 3, video, video, image, 4]
    assert result.spans == [
        PlaceholderSpan("image", 2, 3, item=0),
        PlaceholderSpan("video", 6, 2, item=1),
        PlaceholderSpan("image", 8, 1, item=2),
    ]
    for span in result.spans:
        expected = image if span.modality == "image" else video
        assert (
            result.token_ids[span.offset : span.offset + span.num_tokens]
            == [expected] * span.num_tokens
        )


def test_expand_without_media_is_identity(processor):
    result = processor.expand_placeholders([5, 6, 7], [])
    assert result.token_ids == [5, 6, 7] and result.spans == []


def test_count_mismatch_messages(processor):
    image = processor.image_token_id
    with pytest.raises(MediaError) as info:
        processor.expand_placeholders([image, 1, image], [("image", 4)])
    assert info.value.message == "the prompt has 2 image placeholders but 1 image was given"
    with pytest.raises(MediaError, match="has 1 image placeholder but 2 images were given"):
        processor.expand_placeholders([image], [("image", 4), ("image", 4)])
    with pytest.raises(MediaError, match="has 0 video placeholders but 1 video was given"):
        processor.expand_placeholders([image], [("image", 4), ("video", 4)])


def test_media_the_template_left_out_are_named_as_such(processor):
    """An image in a tool message: Qwen2-VL's template writes no placeholder there, and the
    400 said only "0 image placeholders but 1 image was given"."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "image"}]},
    ]  # fmt: skip
    token_ids = processor.encode(processor.render_chat(messages))
    with pytest.raises(MediaError, match="writes no placeholder for media in some messages"):
        processor.expand_placeholders(token_ids, [("image", 4)])


def test_order_mismatch_and_empty_item(processor):
    image, video = processor.image_token_id, processor.video_token_id
    with pytest.raises(MediaError, match="not in the order"):
        processor.expand_placeholders([video, image], [("image", 1), ("video", 1)])
    with pytest.raises(MediaError, match="at least one token"):
        processor.expand_placeholders([image], [("image", 0)])


def test_placeholder_typed_into_text_prompt_is_rejected(processor):
    messages = [{"role": "user", "content": "look: <|image_pad|> ok"}]
    with pytest.raises(MediaError, match="1 image placeholder but 0 images were given"):
        processor.process_chat(messages, [])


def test_process_chat_end_to_end(processor):
    messages = _user({"type": "text", "text": "Describe"}, IMAGE_URL)
    result = processor.process_chat(messages, [("image", 5)])
    (span,) = result.spans
    assert span == PlaceholderSpan("image", span.offset, 5)
    assert result.token_ids[span.offset - 1] == processor.vision_start_token_id
    assert result.token_ids[span.offset + 5] == processor.vision_end_token_id
    rendered = processor.encode(processor.render_chat(messages))
    assert len(result.token_ids) == len(rendered) + 4


def test_the_model_template_compiles_once_before_concurrent_first_requests(monkeypatch):
    """Threads that all miss the template cache at once would each compile it (~10 ms of
    held GIL apiece for this small one) in the server's first burst of requests."""
    source = "{% for m in messages %}<{{ m['role'] }}>{% endfor %}{# compiles-once #}"
    processor = PromptProcessor(Tokenizer(models.WordLevel({"x": 0}, unk_token="x")), source)
    compiles = []
    real = ImmutableSandboxedEnvironment.from_string
    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string",
                        lambda self, *a, **k: compiles.append(1) or real(self, *a, **k))  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: processor.render_chat([{"role": "user", "content": "x"}]),
                              range(16)))  # fmt: skip
    assert texts == ["<user>"] * 16 and compiles == []
    broken = PromptProcessor(processor.tokenizer, "{% for %}")  # still a per-request error
    with pytest.raises(InvalidRequest, match="syntax error"):
        broken.render_chat([{"role": "user", "content": "x"}])


def test_custom_template_and_template_errors(processor):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    text = processor.render_chat([{"role": "user", "content": "x"}], chat_template=template)
    assert text == "[user]x"
    with pytest.raises(InvalidRequest) as info:
        processor.render_chat([{"role": "user", "content": "x"}], chat_template="{% for %}")
    assert info.value.param == "chat_template"
    strict = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system') }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match="need a system"):
        processor.render_chat([{"role": "user", "content": "x"}], chat_template=strict)


def test_sandbox_blocks_attribute_escapes(processor):
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidRequest):
        processor.render_chat([{"role": "user", "content": "x"}], chat_template=escape)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"content": "no role"}], "messages[0]"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": ["bare string"]}], "messages[0].content[0]"),
    ],
)
def test_bad_messages(processor, messages, param):
    with pytest.raises(InvalidRequest) as info:
        processor.render_chat(messages)
    assert info.value.param == param


def test_chat_template_sources(tmp_path, model_dir, processor):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").unlink()
    assert PromptProcessor.from_model_dir(folder).chat_template == processor.chat_template
    (folder / "chat_template.json").unlink()  # falls back to tokenizer_config.json
    assert PromptProcessor.from_model_dir(folder).chat_template == processor.chat_template
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "T"},
        {"name": "tool_use", "template": "U"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert PromptProcessor.from_model_dir(folder).chat_template == "T"
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    no_template = PromptProcessor.from_model_dir(folder)
    with pytest.raises(InvalidRequest, match="no chat template"):
        no_template.render_chat([{"role": "user", "content": "x"}])
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError):
        PromptProcessor.from_model_dir(folder)


def test_concurrent_use_is_consistent(processor):
    def run(index: int):
        messages = _user({"type": "text", "text": f"picture number {index}"}, IMAGE_URL)
        return processor.process_chat(messages, [("image", index % 7 + 1)])

    expected = [run(i) for i in range(64)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(run, range(64))) == expected


def test_continue_final_message_leaves_the_last_turn_open(processor):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    text = processor.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I")


@pytest.mark.parametrize(
    ("last", "flags", "param", "match"),
    [
        ("Go on", {"add_generation_prompt": True}, "continue_final_message", "cannot be combined"),
        ([{"type": "text", "text": "A"}, IMAGE_URL], {}, "messages[1].content", "text part"),
        (None, {}, "messages[1].content", "needs text"),
    ],
)
def test_continue_final_message_errors_name_the_field(processor, last, flags, param, match):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": last}]
    options = {"add_generation_prompt": False, "continue_final_message": True, **flags}
    with pytest.raises(InvalidRequest, match=match) as info:
        processor.render_chat(messages, **options)
    assert info.value.param == param


def test_continue_final_message_refuses_a_template_that_rewrites_the_text(processor):
    shouting = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    messages = [{"role": "assistant", "content": "quiet"}]
    with pytest.raises(InvalidRequest, match="cannot be continued"):
        processor.render_chat(
            messages, chat_template=shouting, add_generation_prompt=False,
            continue_final_message=True,
        )  # fmt: skip


def test_a_text_too_long_for_the_context_is_refused_before_tokenising(processor):
    """The bound (characters over the longest vocabulary entry, loosened for the NFC
    normalizer) never refuses a text that fits: every text has at least that many tokens."""
    from engine.errors import ContextLengthExceeded

    assert processor.tokenizer.normalizer is not None  # Qwen's NFC: the slack applies
    per_token = processor.max_chars_per_token
    texts = [
        "a " * 5000,
        "x" * 20000,  # one long word
        "e\u0301" * 3000 + "\u1100\u1161\u11a8" * 2000,  # NFC composes these: fewer characters
        "🎉 日本語 " * 1000,
        "<|im_start|>user\nhi<|im_end|>" * 200,
    ]
    for text in texts:
        ids = processor.encode(text)
        assert len(ids) >= len(text) / per_token
        assert processor.encode(text, max_tokens=len(ids)) == ids  # fits exactly: not refused
    with pytest.raises(ContextLengthExceeded, match="characters") as caught:
        processor.encode_prompt("a" * (100 * per_token + 1), max_tokens=100)
    assert caught.value.param == "prompt" and caught.value.status == 400
    processor.encode_prompt("a" * (100 * per_token), max_tokens=None)  # no bound asked: none


def test_a_chat_template_setting_is_a_file_first_then_the_template(tmp_path):
    """As vLLM's `load_chat_template`: a path holding a `{` was taken as the template
    itself (every prompt became the path's text), and an inline template's `\\n`, typed in
    a shell, stayed two characters."""
    from engine.multimodal.chat_template import ChatTemplateError, chat_template_from_setting

    folder = tmp_path / "templates{v2}"
    folder.mkdir()
    (folder / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template_from_setting(str(folder / "t.jinja")) == "{{ messages[0]['content'] }}"
    inline = "{% for m in messages %}{{ m.content }}\\n{% endfor %}é"
    assert chat_template_from_setting(inline) == inline.replace("\\n", "\n")
    with pytest.raises(ChatTemplateError, match="no file"):
        chat_template_from_setting(str(tmp_path / "missing.jinja"))


def test_named_templates_take_tool_use_when_tools_are_given(model_dir, tmp_path):
    """transformers' `get_chat_template` (and vLLM) render a chat with tools through the
    "tool_use" template where the checkpoint names one; Tessera always took "default"."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "named"
    shutil.copytree(model_dir, folder)
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use",
         "template": "T{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    ours = PromptProcessor.from_model_dir(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for given in (tools, None):
        expected = hf.apply_chat_template(messages, tools=given, tokenize=False)
        assert ours.render_chat(messages, tools=given, add_generation_prompt=False) == expected
    assert ours.render_chat(messages, tools=tools).startswith("T1")


# Content as one string, as Qwen3's and Llama 3's templates take it (no loop over it).
STRING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                   "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
                   "{% if m.content.startswith('x') %}!{% endif %}</>{% endfor %}")  # fmt: skip
SUNNY = [{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}]


def test_a_template_that_takes_a_string_gets_the_text_parts_joined(processor):
    """As vLLM joins them. The template wrote the list's Python repr ("[{'type': 'text',
    ...") into the prompt, or failed on it (`.startswith`: a 400)."""
    messages = [{"role": "tool", "content": SUNNY}, {"role": "user", "content": []}]
    text = processor.render_chat(messages, chat_template=STRING_TEMPLATE,
                                 add_generation_prompt=False)  # fmt: skip
    assert text == "<tool>sun\nny</><user></>"
    looping = processor.render_chat([{"role": "user", "content": SUNNY}])  # the built-in one
    assert "sunny" in looping  # its parts, written one after the other


@pytest.mark.parametrize(("source", "takes_parts"), [
    (STRING_TEMPLATE, False),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% set parts = m.content %}{% for p in parts %}{{ p }}{% endfor %}"
     "{% endfor %}", True),
    ("{% for m in messages %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for line in m.content.split('\\n') %}{{ line }}{% endfor %}"
     "{% endfor %}", False),
    ("{% macro show(c, n) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"  # Qwen3-VL's
     "{% for m in messages %}{{ show(m.content, 1) }}{% endfor %}", True),
])  # fmt: skip
def test_which_templates_take_content_as_parts(source, takes_parts):
    from engine.multimodal.chat_template import takes_content_parts

    assert takes_content_parts(source) is takes_parts


def test_a_null_content_and_earlier_thinking_reach_the_template_as_in_vllm(processor):
    """The openai client sends an assistant turn of tool calls back with `content: null`:
    the key was dropped and Qwen3's template failed on it. `reasoning_content` (or vLLM's
    `reasoning`) was dropped too: Qwen3 writes an earlier turn's thinking back."""
    from server.chat import messages_as_dicts
    from server.chat_messages import ChatMessage

    messages = [ChatMessage(role="assistant", content=None, reasoning="plan"),
                ChatMessage(role="assistant", content="x", reasoning_content="more")]  # fmt: skip
    text = processor.render_chat(messages_as_dicts(messages), chat_template=STRING_TEMPLATE,
                                 add_generation_prompt=False)  # fmt: skip
    assert text == "<assistant>[plan]</><assistant>x[more]!</>"


def test_a_developer_message_is_a_system_one_for_a_template_that_never_names_the_role(
    processor,
):
    """Qwen3's template renders system, user, assistant and tool only: a developer message
    (OpenAI's instructions role) vanished from the prompt. A template that names the role
    still gets it."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    only_known = ("{% for m in messages %}{% if m.role in ['system', 'user'] %}<{{ m.role }}>"
                  "{{ m.content }}{% endif %}{% endfor %}")  # fmt: skip
    text = processor.render_chat(messages, chat_template=only_known, add_generation_prompt=False)
    assert text == "<system>Be brief.<user>hi"
    knows_it = only_known.replace("'user']", "'user', 'developer']")
    text = processor.render_chat(messages, chat_template=knows_it, add_generation_prompt=False)
    assert text == "<developer>Be brief.<user>hi"
