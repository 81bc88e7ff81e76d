"""The Responses items as a tool-call stream and a reasoning parser drive them: text, then
Hermes calls whole as their blocks close, text after a call in a message of its own; items
one after another; a non-streamed answer the same items as the stream; a text part's
logprobs those of its own tokens. Every event validates against the openai package's
types."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from engine.protocol import SamplingParams, TokenLogprob
from engine.tiny_model import SIZES, train_tokenizer
from server.generation import GenerationJob, GenerationTotals, PreparedPrompt
from server.response_events import ResponseShaper, _EventWriter
from server.response_items import Assembler
from server.responses import ResponsesRequest
from server.streaming import ChoiceResult
from server.tool_calls import ToolPlan

TOOLS = [{"type": "function", "function": {"name": "get_time"}}]
PLAN = ToolPlan("auto", TOOLS)
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SIZES["tiny"].bpe_vocab_size)


def shaper_for(tokenizer=None, *, tools=PLAN, thinking: bool | None = None) -> ResponseShaper:
    job = GenerationJob("resp_1", "m", PreparedPrompt([1]), SamplingParams(), 1, [],
                        tools=tools, thinking_opened=thinking)  # fmt: skip
    body = ResponsesRequest(model="m", input="x")
    return ResponseShaper(job, body, tokenizer, logprobs=tokenizer is not None)


def entries_for(feeds: list[str]) -> list[TokenLogprob]:
    """One entry per feed, its token id the feed's index (its logprob names it too)."""
    return [TokenLogprob(i, -float(i)) for i in range(len(feeds))]


def events_of(feeds: list[str], shaper: ResponseShaper | None = None):
    shaper = shaper or shaper_for()
    assembler = Assembler(shaper, _EventWriter())
    chunks = []
    for i, (text, entry) in enumerate(zip(feeds, entries_for(feeds), strict=True)):
        chunks += assembler.feed(text, [entry], "stop" if i == len(feeds) - 1 else None)
    events = [json.loads(chunk.split(b"\ndata: ", 1)[1]) for chunk in chunks]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    return events, assembler.items.output


def final_of(feeds: list[str], shaper: ResponseShaper | None = None) -> list[dict]:
    """The non-streamed answer of the same tokens."""
    offsets = [sum(map(len, feeds[:i])) for i in range(len(feeds))]
    result = ChoiceResult(text="".join(feeds), finish_reason="stop", logprobs=entries_for(feeds),
                          text_offsets=offsets, token_ids=list(range(len(feeds))))  # fmt: skip
    return (shaper or shaper_for()).final(result, GenerationTotals())["output"]


def assert_items_one_after_another(events: list[dict]) -> None:
    """OpenAI's order: an item's output_item.done before the next one's added."""
    open_items = []
    for event in events:
        if event["type"] == "response.output_item.added":
            assert not open_items, f"item {event['output_index']} opened inside {open_items}"
            open_items.append(event["output_index"])
        elif event["type"] == "response.output_item.done":
            assert open_items == [event["output_index"]]
            open_items.pop()


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


@pytest.mark.parametrize(
    "feeds",
    [
        ["Let me ", "look.\n" + CALL[:20], CALL[20:] + "\n", CALL],  # two calls
        [CALL, "\n" + CALL],
        ["Sure.\n", CALL, '\n<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>'],
        ["Just text."],
    ],
)
def test_items_come_one_after_another_and_the_answer_has_them_in_the_same_order(feeds):
    """Each call's item stayed open until the generation ended (two parallel calls were
    open at once), and a non-streamed answer put its text before its calls, where a stream
    had a call before the text that followed it."""
    events, streamed = events_of(feeds)
    assert_items_one_after_another(events)
    final = final_of(feeds)
    assert [item["type"] for item in final] == [item["type"] for item in streamed]
    assert without_ids(final) == without_ids(streamed)


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def logprob_ids(item: dict) -> list[float]:
    return [-entry["logprob"] for entry in item["content"][0]["logprobs"]]


def test_a_text_part_has_the_logprobs_of_its_own_tokens(tokenizer):
    """They held every token's: the thinking's, and a call's, and the stream sent the
    thinking's with the first text delta and a call's only with output_text.done."""
    thinking = shaper_for(tokenizer, tools=None, thinking=False)
    feeds = ["<think>", "hmm", "</think>", "\n\n", "Hello", " world"]  # the blank lines too
    events, output = events_of(feeds, thinking)
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert logprob_ids(output[1]) == [4, 5]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[-lp["logprob"] for lp in e["logprobs"]] for e in deltas] == [[4], [5]]
    assert logprob_ids(final_of(feeds, thinking)[1]) == [4, 5]

    calling = shaper_for(tokenizer)
    feeds = ["Hi ", "there\n", *CALL.partition("{")[::2][:1], "{" + CALL.partition("{")[2]]
    events, output = events_of(feeds, calling)
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert logprob_ids(output[0]) == [0, 1]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    sent = [-lp["logprob"] for e in events if e["type"] == "response.output_text.delta"
            for lp in e["logprobs"]]  # fmt: skip
    assert sent == [-lp["logprob"] for lp in done["logprobs"]] == [0, 1]
    assert logprob_ids(final_of(feeds, calling)[0]) == [0, 1]


def test_text_a_tool_parser_releases_takes_only_the_entries_that_wrote_it(tokenizer):
    """'<tool_c' held as a call's possible start, then '<': the parser releases '<tool_c'
    and holds the new '<', whose entry went out with the text, a call's token in the
    message's logprobs (fuzz54)."""
    feeds = ["<", "tool", "_c", "<", "tool_call>\n",
             '{"name": "get_time", "arguments": {}}\n</tool_call>']  # fmt: skip
    events, output = events_of(feeds, shaper_for(tokenizer))
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "<tool_c" and logprob_ids(output[0]) == [0, 1, 2]
    sent = [-lp["logprob"] for e in events if e["type"] == "response.output_text.delta"
            for lp in e["logprobs"]]  # fmt: skip
    assert sent == [0, 1, 2]
    assert logprob_ids(final_of(feeds, shaper_for(tokenizer))[0]) == [0, 1, 2]


def test_a_delta_of_several_tokens_gives_each_entry_to_its_own_tokens_text(tokenizer):
    """With --stream-interval 4 a delta brought several tokens, and all their entries went
    with its text: a call's opening tokens, </think>'s, a held stop string's."""
    feeds = ["<think>", "hm", "</th", "ink>", "Hi", " there\n", "<", "tool_call>\n",
             '{"name": "get_time", "arguments": {}}\n</tool_call>']  # fmt: skip
    entries = entries_for(feeds)
    offsets = [sum(map(len, feeds[:i])) for i in range(len(feeds))]
    one_by_one = Assembler(shaper_for(tokenizer, thinking=False), _EventWriter())
    for i, text in enumerate(feeds):
        list(one_by_one.feed(text, entries[i : i + 1], "stop" if i == len(feeds) - 1 else None))
    in_fours = Assembler(shaper_for(tokenizer, thinking=False), _EventWriter())
    for start in range(0, len(feeds), 4):
        chunk = slice(start, start + 4)
        last = start + 4 >= len(feeds)
        list(in_fours.feed_tokens("".join(feeds[chunk]), offsets[chunk], entries[chunk],
                                  "stop" if last else None, offsets[start]))  # fmt: skip
    expected = without_ids(one_by_one.items.output)
    assert [item["type"] for item in expected] == ["reasoning", "message", "function_call"]
    assert logprob_ids(expected[1]) == [4, 5]
    assert without_ids(in_fours.items.output) == expected


@pytest.mark.parametrize("feeds", [["<think>", "hmm", " still"], ["<think>", "hmm", "</think>"]])
def test_an_answer_that_is_all_thinking_is_its_reasoning_item_alone(tokenizer, feeds):
    """As OpenAI's answer cut off while it reasons; an empty message item followed it,
    streamed and not. An answer with nothing at all is still one empty message."""
    events, output = events_of(feeds, shaper_for(tokenizer, tools=None, thinking=False))
    assert [item["type"] for item in output] == ["reasoning"]
    final = final_of(feeds, shaper_for(tokenizer, tools=None, thinking=False))
    assert [item["type"] for item in final] == ["reasoning"]
    assert [item["type"] for item in events_of([""])[1]] == ["message"]


@pytest.mark.parametrize("text_format", [{"type": "json_schema", "schema": {"type": "object"}},
                                         {"type": "json_schema", "name": "n", "schema": {}}])  # fmt: skip
def test_a_json_schema_format_is_echoed_with_its_name(text_format):
    """fuzz100: a format sent without its (optional here) name came back without one, which
    the openai client's Response type refuses."""
    from openai.types.responses import Response

    job = GenerationJob("resp_1", "m", PreparedPrompt([1]), SamplingParams(), 1, [])
    body = ResponsesRequest(model="m", input="x", text={"format": text_format})
    response = ResponseShaper(job, body, None, logprobs=False).response("completed", [])
    Response.model_validate(response)
    assert response["text"]["format"]["name"] == text_format.get("name", "response")
