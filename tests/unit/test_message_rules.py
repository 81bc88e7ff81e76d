"""The rules every chat message keeps on the HTTP API and offline alike
(engine/multimodal/messages.py): fuzz102 found the offline `LLM.chat` rendering a user's
null content as an empty turn, a `function` message as a turn of its own, and refusing an
assistant's `refusal` part, all of which the server had just been taught."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from engine.multimodal.messages import normalize_messages


@pytest.mark.parametrize(
    ("message", "param", "words"),
    [
        ({"role": "user", "content": None}, "messages[1].content", "needs its content"),
        ({"role": "system"}, "messages[1].content", "needs its content"),
        ({"role": "function", "name": "f", "content": "4"}, "messages[1]", "'tool' message"),
    ],
)
def test_messages_openai_refuses_are_refused_offline_too(message, param, words):
    with pytest.raises(InvalidRequest, match=words) as refused:
        normalize_messages([{"role": "user", "content": "hi"}, message])
    assert refused.value.param == param


def test_an_assistants_refusal_is_its_text_and_tool_turns_may_be_empty():
    refusal = {"type": "refusal", "refusal": "I can't."}
    normalized = normalize_messages([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [refusal]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": None},
    ], join_text=True)  # fmt: skip
    assert normalized[1]["content"] == "I can't."
    with pytest.raises(InvalidRequest, match="unsupported content part type 'refusal'"):
        normalize_messages([{"role": "user", "content": [refusal]}])
