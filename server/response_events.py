"""Answers of /v1/responses: the Response object, and the typed events of a stream.

An answer is a list of output items: a `reasoning` item with the thinking when the chat
has a reasoning parser and the model thought (server/reasoning.py; one `reasoning_text`
part), one `message` whose content is one `output_text` part (with `logprobs` when asked),
then one `function_call` item per tool call found in the text (server/tool_calls.py). A
choice that hit `max_output_tokens` makes the response `incomplete`
(`incomplete_details.reason` "max_output_tokens"), anything else `completed`.

A stream is `event: <type>` / `data: {...}` pairs (no [DONE]), numbered by
`sequence_number`:

    response.created, response.in_progress               status "in_progress"
    (reasoning: response.output_item.added, response.content_part.added,
     response.reasoning_text.delta ..., response.reasoning_text.done,
     response.content_part.done, response.output_item.done)
    response.output_item.added, response.content_part.added
    response.output_text.delta ...                       as the text comes
    response.output_text.done, response.content_part.done, response.output_item.done
    per call: response.output_item.added, response.function_call_arguments.delta ...,
              response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete            the whole response, with usage

Items go out one after another, in the order the model wrote them (each item's `done`
before the next one's `added`), and a non-streamed answer has the same items in the same
order (`ResponseShaper.final` replays its tokens through the same `_Assembler`). Calls go
out as server/tool_calls.py's stream gives them: a named function's arguments as they are
generated, any other call whole as soon as its text closes. A text part's logprobs are
those of its own tokens. An error after the stream started is an `error` event and then
`response.failed`, whose `error.code` is one of OpenAI's (`invalid_prompt` for a fault of
the request, else `server_error`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import msgspec
from tokenizers import Tokenizer

from engine.detokenizer import SequenceDetokenizer
from engine.errors import TesseraError
from engine.protocol import TokenLogprob
from server.generation import GenerationJob, GenerationTotals, generate_choices
from server.logprobs import chat_logprobs
from server.openai_replies import dump
from server.responses import ResponsesRequest
from server.streaming import ChoiceResult, OnFinished, counted_if_left
from server.tool_calls import ToolCall

logger = logging.getLogger(__name__)

_JSON = msgspec.json.Encoder()


class ResponseShaper:
    """Builds one request's Response objects and output items."""

    def __init__(
        self, job: GenerationJob, body: ResponsesRequest, tokenizer: Tokenizer, *, logprobs: bool
    ) -> None:
        self.job = job
        self.body = body
        self.tokenizer = tokenizer
        self.with_logprobs = logprobs
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_tokens = 0  # of the answer's, once `count_reasoning` has its tokens

    def count_reasoning(self, token_ids: Sequence[int]) -> None:
        """`usage.output_tokens_details.reasoning_tokens`: the answer's tokens, read one
        by one as the reasoning parser reads their text, up to the end of its thinking."""
        splitter = self.job.reasoning_splitter()
        if splitter is None:
            return
        detokenizer = SequenceDetokenizer(self.tokenizer, self.job.prompt.token_ids,
                                          skip_special_tokens=self.job.skip_special_tokens)  # fmt: skip
        texts = (detokenizer.step((token_id,)) for token_id in token_ids)
        self.reasoning_tokens = splitter.count_reasoning_tokens(texts)

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        totals: GenerationTotals | None = None,
        *,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.job.request_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.job.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None if totals is None else usage(totals, self.reasoning_tokens),
            "user": body.user,
        }

    def logprobs(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        if not self.with_logprobs or not entries:
            return []
        return dump(chat_logprobs(self.tokenizer, entries))["content"]

    def text_part(self, text: str, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        if self.with_logprobs:
            part["logprobs"] = self.logprobs(entries)
        return part

    def message(
        self, status: str, content: list[dict[str, Any]], message_id: str | None = None
    ) -> dict[str, Any]:
        return {"type": "message", "id": message_id or self.message_id, "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    def reasoning(self, status: str, text: str | None, reasoning_id: str) -> dict[str, Any]:
        """The `reasoning` item (None: still empty, as just opened)."""
        content = [] if text is None else [reasoning_part(text)]
        return {"type": "reasoning", "id": reasoning_id, "summary": [], "content": content,
                "status": status}  # fmt: skip

    def final(self, result: ChoiceResult, totals: GenerationTotals) -> dict[str, Any]:
        """The Response of a finished, non-streamed choice: its tokens fed one by one
        through the stream's assembly (`_Assembler`), so that both give the same items,
        in the same order, with the same logprobs."""
        self.count_reasoning(result.token_ids)
        assembler = _Assembler(self, _no_event)
        events = assembler.feed_tokens(result.text, result.text_offsets, result.logprobs,
                                       result.finish_reason)  # fmt: skip
        for _ in events:
            pass
        return self.response(response_status(result.finish_reason), assembler.items.output, totals)


def _no_event(kind: str, **fields: Any) -> bytes:
    return b""


def _token_pieces(
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


def usage(totals: GenerationTotals, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": totals.num_prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": totals.num_cached_tokens,
            "cache_write_tokens": 0,
        },
        "output_tokens": totals.num_generated_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": totals.num_prompt_tokens + totals.num_generated_tokens,
    }


class _EventWriter:
    """SSE events of one stream, numbered from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _JSON.encode(data) + b"\n\n"


class _Assembler:
    """One choice's output items as its text comes: the thinking (reasoning parser), then
    text and tool calls (tool parser). A token's logprob entry goes with the text it
    made, so that the text part's logprobs spell its text: the thinking's tokens and a
    call's tokens are left out (OpenAI: the logprobs "of the output text")."""

    def __init__(self, shaper: ResponseShaper, event: Callable[..., bytes]) -> None:
        self.items = _StreamedOutput(shaper, event)
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
        for piece in _token_pieces(text, offsets, entries, finish_reason, start):
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


class _StreamedOutput:
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


async def stream_response(
    job: GenerationJob,
    engine: Any,
    tokenizer: Tokenizer,
    shaper: ResponseShaper,
    *,
    on_finished: OnFinished,
    renamed: Callable[[TesseraError], TesseraError] = lambda exc: exc,
) -> AsyncIterator[bytes]:
    """`renamed`: an error of the chat pipeline, naming the Responses field instead."""
    totals = GenerationTotals(num_prompt_tokens=len(job.prompt.token_ids))
    event = _EventWriter()
    with counted_if_left(totals, job.n, on_finished):
        yield event("response.created", response=shaper.response("in_progress", []))
        yield event("response.in_progress", response=shaper.response("in_progress", []))
        assembler = _Assembler(shaper, event)
        token_ids: list[int] = []
        sent = 0  # characters of the answer's text fed so far
        try:
            async with contextlib.aclosing(
                generate_choices(engine, tokenizer, job, totals)
            ) as deltas:
                async for delta in deltas:
                    token_ids += delta.token_ids
                    # With logprobs (text_offsets), a delta of several tokens goes in token
                    # by token, as `final` feeds them.
                    for chunk in assembler.feed_tokens(delta.text, delta.text_offsets,
                                                       delta.logprobs, delta.finish_reason,
                                                       sent):  # fmt: skip
                        yield chunk
                    sent += len(delta.text)
                    if delta.finish_reason is None:
                        continue
                    shaper.count_reasoning(token_ids)
                    status = response_status(delta.finish_reason)
                    final = shaper.response(status, assembler.items.output, totals)
                    yield event(f"response.{status}", response=final)
        except TesseraError as error:
            exc = renamed(error)
            yield event("error", code=exc.code, message=exc.message, param=exc.param)
            code = "invalid_prompt" if exc.status < 500 else "server_error"  # OpenAI's list
            failure = {"code": code, "message": exc.message}
            yield event("response.failed",
                        response=shaper.response("failed", assembler.items.output, error=failure))  # fmt: skip
            totals.error_code = exc.code or exc.type
            on_finished(totals)  # failed: counted as a stream error
            return
        except Exception:  # noqa: BLE001 - the stream must end cleanly whatever happened
            logger.exception("response stream failed")
            failure = {"code": "server_error", "message": "internal server error"}
            yield event("error", code="internal_error", message=failure["message"], param=None)
            yield event("response.failed",
                        response=shaper.response("failed", assembler.items.output, error=failure))  # fmt: skip
            totals.error_code = "internal_error"
            on_finished(totals)  # failed: counted as a stream error
            return
    on_finished(totals)
