"""server/chat.py: a request's own chat template (admitted only when trusted) is the one used."""

from __future__ import annotations

import asyncio

import pytest

from engine.multimodal.prompt import PromptProcessor
from engine.tiny_model import make_tiny_model
from server.chat import prepare_chat_prompt
from server.openai_models import ChatCompletionRequest


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> PromptProcessor:
    return PromptProcessor.from_model_dir(make_tiny_model(tmp_path_factory.mktemp("m"), seed=0))


def _prompt_text(processor: PromptProcessor, **fields) -> str:
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hello"}], **fields
    )
    prompt = asyncio.run(prepare_chat_prompt(request, processor, None, max_images=4))
    return processor.decode(prompt.token_ids, skip_special_tokens=False)


def test_request_chat_template_is_rendered(processor):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    assert _prompt_text(processor, chat_template=template) == "[user]hello"


def test_model_template_without_request_template(processor):
    text = _prompt_text(processor)
    assert "<|im_start|>user\nhello<|im_end|>" in text


@pytest.mark.parametrize("name", ["namespace", "range", "raise_exception", "strftime_now"])
def test_template_kwargs_cannot_hide_the_templates_functions(processor, name):
    """{"namespace": 1} made the model's template call an int: a 500, now a 400."""
    from engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=f"cannot set {name}") as caught:
        _prompt_text(processor, chat_template_kwargs={name: 1})
    assert caught.value.param == "chat_template_kwargs"


def test_a_template_failing_in_python_is_a_request_error(processor):
    from engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="ZeroDivisionError") as caught:
        _prompt_text(processor, chat_template="{{ 1 / 0 }}")
    assert caught.value.param == "chat_template"
    with pytest.raises(InvalidRequest, match="TypeError") as caught:  # kwargs of a bad type
        _prompt_text(
            processor, chat_template="{{ count + 1 }}", chat_template_kwargs={"count": "x"}
        )
    assert caught.value.param == "chat_template"
