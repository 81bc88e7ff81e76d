"""The Responses stream's items as a tool-call stream drives them: text, then Hermes calls
whole as their blocks close, and text after a call in a message of its own. Every event
validates against the openai package's types."""

from __future__ import annotations

import json

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from engine.protocol import SamplingParams
from server.generation import PreparedPrompt
from server.response_events import ResponseShaper, _EventWriter, _StreamedOutput
from server.responses import ResponsesRequest
from server.streaming import GenerationJob
from server.tool_calls import ToolPlan

TOOLS = [{"type": "function", "function": {"name": "get_time"}}]
PLAN = ToolPlan("auto", TOOLS)


def events_of(feeds: list[str]) -> tuple[list[dict], list[dict]]:
    job = GenerationJob("resp-1", "m", PreparedPrompt([1]), SamplingParams(), 1, [], tools=PLAN)
    shaper = ResponseShaper(job, ResponsesRequest(model="m", input="x"), None, logprobs=False)
    streamed, extractor = _StreamedOutput(shaper, _EventWriter()), PLAN.extractor()
    chunks = []
    for text in feeds:
        content, deltas = extractor.feed_stream(text)
        chunks += streamed.add_text(content, [])
        for delta in deltas:
            chunks += streamed.add_call(delta)
    rest, _, calls = extractor.finish_stream()
    chunks += streamed.add_text(rest, [])
    chunks += streamed.finish(calls, "completed")
    events = [json.loads(chunk.split(b"\ndata: ", 1)[1]) for chunk in chunks]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    return events, streamed.output


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_text_then_calls_as_their_blocks_close():
    events, output = events_of(["Let me ", "look.\n" + CALL[:20], CALL[20:] + "\n", CALL])
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me look.\n"
    assert [json.loads(item["arguments"]) for item in output[1:]] == [{"zone": "UTC"}] * 2
    kinds = [event["type"] for event in events]
    # The first call's item opens (and its arguments go out) before the second block is fed.
    first_call = kinds.index("response.function_call_arguments.delta")
    assert kinds[:first_call].count("response.output_item.added") == 2
    assert kinds.count("response.output_item.done") == 3
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len({item["id"] for item in output}) == 3


def test_text_after_a_call_is_a_message_of_its_own():
    bad = '\n<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>'
    events, output = events_of(["Sure.\n", CALL, bad])
    assert [item["type"] for item in output] == ["message", "function_call", "message"]
    assert output[2]["content"][0]["text"] == bad and output[0]["id"] != output[2]["id"]
    assert all(item["status"] == "completed" for item in output)
