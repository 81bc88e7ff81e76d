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
