"""The output items of one /v1/responses choice as its text comes: a `reasoning` item,
`message` items and `function_call` items, opened, grown and closed in the order the model
wrote them, as the events server/response_events.py numbers and sends (a non-streamed
answer replays its tokens through the same `Assembler`, with events thrown away).
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from engine.protocol import TokenLogprob
from server.tool_calls import ToolCall

if TYPE_CHECKING:
    from server.response_events import ResponseShaper


def token_pieces(
    text: str,
    offsets: Sequence[int],
    entries: Sequence[TokenLogprob],
    finish_reason: str | None,
    start: int = 0,
) -> Iterator[tuple[str, Sequence[TokenLogprob], str | None]]:
    """`text` (at `start` in its choice's text) token by token, as a stream of one token
    a delta brings it: each token's text (from its `offsets` in the choice's text) and
    logprob entry, `finish_reason` with the last. Without offsets, one piece."""
    if not offsets:
        yield text, entries, finish_reason
        return
    cuts = [0, *(offset - start for offset in offsets[1:]), len(text)]
    bounds = list(itertools.accumulate(cuts, max))  # the pieces make up the whole text
    for i in range(len(offsets)):
        last = i == len(offsets) - 1
        yield text[bounds[i] : bounds[i + 1]], entries[i : i + 1], finish_reason if last else None


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def response_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def call_status(status: str, index: int, calls: list[ToolCall]) -> str:
    """A response cut by max_output_tokens was cut in its last item: a last call's
    arguments are incomplete (a named function's answer is nothing but them)."""
    return "incomplete" if status == "incomplete" and index == len(calls) - 1 else "completed"


def call_item(call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id(call),
            "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": status}  # fmt: skip


class Assembler:
    """One choice's output items as its text comes: the thinking (reasoning parser), then
    text and tool calls (tool parser). A token's logprob entry goes with the text it
    made, so that the text part's logprobs spell its text: the thinking's tokens and a
    call's tokens are left out (OpenAI: the logprobs "of the output text")."""

    def __init__(self, shaper: ResponseShaper, event: Callable[..., bytes]) -> None:
        self.items = StreamedOutput(shaper, event)
        self.extractor = shaper.job.tools.extractor() if shaper.job.tools is not None else None
        self.splitter = shaper.job.reasoning_splitter()

    def feed_tokens(
        self,
        text: str,
        offsets: Sequence[int],
        entries: Sequence[TokenLogprob],
        finish_reason: str | None,
        start: int = 0,
    ) -> Iterator[bytes]:
        """`feed` token by token where `offsets` say where each token's text begins (in
        the choice's text, where `text` begins at `start`): each entry then goes with its
        own token's text. Without offsets, `text` in one piece."""
        for piece in token_pieces(text, offsets, entries, finish_reason, start):
            yield from self.feed(*piece)

    def feed(
        self, text: str, entries: Sequence[TokenLogprob], finish_reason: str | None
    ) -> Iterator[bytes]:
        """A delta's text and its tokens' entries; `finish_reason` with the last."""
        last = finish_reason is not None
        if self.splitter is not None:  # the thinking first, then the answer
            before_answer = not self.splitter.in_answer
            reasoning, text = self.splitter.feed(text, last=last)
            yield from self.items.add_reasoning(reasoning)
            if before_answer and self.splitter.has_reasoning:
                # the thinking's tokens, its tags and the blank lines after it included
                self.items.pending = []
                if not text:
                    entries = ()
        call_deltas: list[dict[str, Any]] = []
        self.items.hold(entries, len(text))
        if self.extractor is not None:
            text, call_deltas = self.extractor.feed_stream(text)
        yield from self.items.add_text(text)
        for call_delta in call_deltas:
            yield from self.items.add_call(call_delta)
        if not last:
            return
        calls: list[ToolCall] = []
        if self.extractor is not None:
            rest, _, calls = self.extractor.finish_stream()
            yield from self.items.add_text(rest)
        yield from self.items.finish(calls, response_status(finish_reason))


class StreamedOutput:
    """The output items of a stream as they open, grow and close, as events."""

    def __init__(self, shaper: ResponseShaper, event: Callable[..., bytes]) -> None:
        self.shaper = shaper
        self.event = event
        self.output: list[dict[str, Any]] = []  # items in output_index order
        self.text = ""
        self.entries: list[TokenLogprob] = []  # the open message's logprobs so far
        # Entries not yet sent with a delta, each with how many characters of the answer's
        # text it wrote: the tool parser may hold text back, then release only part of it.
        self.pending: list[tuple[TokenLogprob, int]] = []
        self.message_index: int | None = None  # output_index of the open message
        self.message_id = shaper.message_id
        self.call_items: dict[int, tuple[int, str]] = {}  # call index -> (output_index, id)
        self.open_call: tuple[int, ToolCall] | None = None  # (call index, the call so far)
        self.reasoning = ""
        self.reasoning_index: int | None = None  # output_index of the open reasoning item
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"

    def add_reasoning(self, text: str) -> Iterator[bytes]:
        """Thinking: into the reasoning item, which opens first."""
        if not text:
            return
        if self.reasoning_index is None:
            self.reasoning_index = len(self.output)
            item = self.shaper.reasoning("in_progress", None, self.reasoning_id)
            self.output.append(item)
            yield self.event("response.output_item.added", output_index=self.reasoning_index,
                             item=item)  # fmt: skip
            yield self.event("response.content_part.added", item_id=self.reasoning_id,
                             output_index=self.reasoning_index, content_index=0,
                             part=reasoning_part(""))  # fmt: skip
        self.reasoning += text
        yield self.event("response.reasoning_text.delta", item_id=self.reasoning_id,
                         output_index=self.reasoning_index, content_index=0, delta=text)  # fmt: skip

    def _close_reasoning(self, status: str = "completed") -> Iterator[bytes]:
        index, self.reasoning_index = self.reasoning_index, None
        if index is None:
            return
        common = {"item_id": self.reasoning_id, "output_index": index, "content_index": 0}
        yield self.event("response.reasoning_text.done", **common, text=self.reasoning)
        yield self.event("response.content_part.done", **common,
                         part=reasoning_part(self.reasoning))  # fmt: skip
        item = self.shaper.reasoning(status, self.reasoning, self.reasoning_id)
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.output[index] = item

    def hold(self, entries: Sequence[TokenLogprob], num_chars: int) -> None:
        """A piece's entries, until the `num_chars` of text they wrote (counted on the
        last) is sent as the message's."""
        self.pending += [(entry, 0) for entry in entries[:-1]]
        self.pending += [(entry, num_chars) for entry in entries[-1:]]

    def add_text(self, text: str) -> Iterator[bytes]:
        """Text for the message, with the held entries that wrote it: a tool parser that
        held '<tool_c' and then saw '<' releases '<tool_c' alone, and that '<' token's
        entry stays held (it went out with the text, a call's token in the message's
        logprobs, fuzz54)."""
        if not text:
            return
        yield from self._close_reasoning()
        if self.message_index is None:
            yield from self._open_message()
        self.text += text
        count, covered = 0, 0
        for _, num_chars in self.pending:
            if covered + num_chars > len(text):
                break
            count, covered = count + 1, covered + num_chars
        sent = [entry for entry, _ in self.pending[:count]]
        del self.pending[:count]
        self.entries += sent
        yield self.event("response.output_text.delta", item_id=self.message_id,
                         output_index=self.message_index, content_index=0, delta=text,
                         logprobs=self.shaper.logprobs(sent))  # fmt: skip

    def add_call(self, delta: dict[str, Any]) -> Iterator[bytes]:
        """A chat tool-call delta: the first of a call (with its id and name) opens its
        item; its arguments, if any, go out as an arguments delta."""
        self.pending = []  # held-back text that became this call: not the message's
        index = delta["index"]
        if index not in self.call_items:
            yield from self._close_reasoning()
            yield from self._close_message()
            yield from self._close_call()
            call = ToolCall(delta["function"]["name"], "", delta["id"])
            output_index = len(self.output)
            self.call_items[index] = (output_index, item_id(call))
            self.open_call = (index, call)
            item = call_item(call, "in_progress", arguments="")
            self.output.append(item)
            yield self.event("response.output_item.added", output_index=output_index, item=item)
        output_index, call_item_id = self.call_items[index]
        arguments = delta["function"].get("arguments")
        if arguments:
            if self.open_call is not None and self.open_call[0] == index:
                call = self.open_call[1]
                grown = dataclasses.replace(call, arguments=call.arguments + arguments)
                self.open_call = (index, grown)
            yield self.event("response.function_call_arguments.delta", item_id=call_item_id,
                             output_index=output_index, delta=arguments)  # fmt: skip

    def _close_call(
        self, call: ToolCall | None = None, status: str = "completed"
    ) -> Iterator[bytes]:
        """Closes the open call item (OpenAI sends items one after another): when the next
        item opens, as its arguments stand (a call other than a named function's comes
        whole), or at the end as the parser finished it (`call`)."""
        if self.open_call is None:
            return
        index, so_far = self.open_call
        self.open_call = None
        call = call or so_far
        output_index, call_item_id = self.call_items[index]
        yield self.event("response.function_call_arguments.done", item_id=call_item_id,
                         output_index=output_index, name=call.name,
                         arguments=call.arguments)  # fmt: skip
        item = call_item(call, status)
        yield self.event("response.output_item.done", output_index=output_index, item=item)
        self.output[output_index] = item

    def finish(self, calls: list[ToolCall], status: str) -> Iterator[bytes]:
        yield from self._close_reasoning(status)
        if not self.output and not calls:
            # An empty answer is still a message; one that is all thinking is its reasoning
            # item alone, as OpenAI's answer cut off while it reasons.
            yield from self._open_message()
        yield from self._close_message(status)
        for index, call in enumerate(calls):
            if index not in self.call_items:
                yield from self.add_call(call.as_dict(index))
            if self.open_call is not None and self.open_call[0] == index:
                yield from self._close_call(call, call_status(status, index, calls))

    def _open_message(self) -> Iterator[bytes]:
        yield from self._close_call()
        if any(item["type"] != "reasoning" for item in self.output):
            # text after a call: a message item of its own
            self.message_id = f"msg_{uuid.uuid4().hex}"
        self.message_index = len(self.output)
        self.text, self.entries = "", []
        item = self.shaper.message("in_progress", [], self.message_id)
        self.output.append(item)
        yield self.event("response.output_item.added", output_index=self.message_index,
                         item=item)  # fmt: skip
        empty = self.shaper.text_part("", [])
        yield self.event("response.content_part.added", item_id=self.message_id,
                         output_index=self.message_index, content_index=0, part=empty)  # fmt: skip

    def _close_message(self, status: str = "completed") -> Iterator[bytes]:
        index, self.message_index = self.message_index, None
        if index is None:
            return
        self.pending = []  # entries of text that never came: a call's, or held back
        part = self.shaper.text_part(self.text, self.entries)
        common = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        yield self.event("response.output_text.done", **common, text=self.text,
                         logprobs=part.get("logprobs", []))  # fmt: skip
        yield self.event("response.content_part.done", **common, part=part)
        item = self.shaper.message(status, [part], self.message_id)
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.output[index] = item


def item_id(call: ToolCall) -> str:
    return "fc_" + call.id.removeprefix("call_")
