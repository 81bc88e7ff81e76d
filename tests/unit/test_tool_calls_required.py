"""tool_choice "required" when its grammar did not hold (fuzz70). The engine starts the
grammar once the output token ids spell </think>, and the reasoning splitter ends the
thinking at </think> in the text: a model that spelled it with other tokens answered
unconstrained, and anything but an array of calls was a 500 (and a stream sent a bare
object as a call before failing)."""

from __future__ import annotations

import json

import pytest

from server import tool_calls
from server.tool_calls import ToolPlan

REQUIRED = ToolPlan("required", [{"type": "function", "function": {"name": "f"}}])
NOT_CALLS = ["5", '"abc"', "true", '{"name": "f", "parameters": {}}', "[1]",
             '[{"name": "f"}]', '[{"name": "f", "arguments": {}}]', '{"x": 1}']  # fmt: skip


@pytest.mark.parametrize("text", NOT_CALLS)
def test_an_answer_that_is_not_an_array_of_calls_is_content(text):
    assert REQUIRED.split(text) == (text, [])


@pytest.mark.parametrize("text", NOT_CALLS)
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_a_stream_sends_it_as_content_too(text, chunk):
    extractor = REQUIRED.extractor()
    deltas = []
    for start in range(0, len(text), chunk):
        content, calls = extractor.feed_stream(text[start : start + chunk])
        assert content == ""
        deltas += calls
    content, calls, all_calls = extractor.finish_stream()
    assert (deltas, content, calls, all_calls) == ([], text, [], [])


def test_a_string_parameter_is_json_text_as_a_named_functions_is():
    """A tool whose parameters are a string went out as the bare text (`or통`), not JSON."""
    text = '[{"name": "f", "parameters": "or통"}]'
    _, (call,) = REQUIRED.split(text)
    assert json.loads(call.arguments) == "or통"
    extractor = REQUIRED.extractor()
    (delta,) = extractor.feed_stream(text)[1]
    assert json.loads(delta["function"]["arguments"]) == "or통"


@pytest.mark.parametrize("plan", [REQUIRED, ToolPlan("auto", REQUIRED.tools,
                                                      format="llama3_json")])  # fmt: skip
def test_a_long_call_is_decoded_when_a_brace_closes_not_at_every_token(monkeypatch, plan):
    """The open call was decoded again at every streamed piece: an 80,000-character call
    cost ~4 s of the API process's event loop."""
    decoded = []

    class Counting:
        def raw_decode(self, text, position):
            decoded.append(position)
            return json.JSONDecoder().raw_decode(text, position)

    monkeypatch.setattr(tool_calls, "_DECODER", Counting())
    arguments = {"text": "x" * 4000, "more": {"n": 1}}
    call = {"name": "f", "parameters": arguments}
    text = json.dumps([call] if plan.mode == "required" else call)
    extractor = plan.extractor()
    sent = [delta for start in range(0, len(text), 4)
            for delta in extractor.feed_stream(text[start : start + 4])[1]]  # fmt: skip
    assert [json.loads(d["function"]["arguments"]) for d in sent] == [arguments]
    assert len(decoded) <= text.count("}")
