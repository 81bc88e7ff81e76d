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
order (`ResponseShaper.final` replays its tokens through the same `Assembler`, in
server/response_items.py). Calls go out as server/tool_calls.py's stream gives them: a
named function's arguments as they are generated, any other call whole as soon as its
text closes. A text part's logprobs are those of its own tokens. An error after the stream started is an `error` event and then
`response.failed`, whose `error.code` is one of OpenAI's (`invalid_prompt` for a fault of
the request, else `server_error`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
from tokenizers import Tokenizer

from engine.errors import TesseraError
from engine.protocol import TokenLogprob
from server.generation import GenerationJob, GenerationTotals, generate_choices
from server.logprobs import chat_logprobs
from server.openai_replies import dump
from server.response_items import Assembler, reasoning_part, response_status
from server.responses import ResponsesRequest
from server.streaming import ChoiceResult, OnFinished, counted_if_left

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
        """`usage.output_tokens_details.reasoning_tokens`: the answer's tokens up to the end
        of its thinking, as the reasoning parser reads their text
        (`GenerationJob.count_reasoning`)."""
        self.reasoning_tokens = self.job.count_reasoning(self.tokenizer, token_ids) or 0

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
            "reasoning": body.reasoning,  # as the request gave it, as vLLM echoes it
            "store": False,
            "temperature": body.temperature,
            "text": body.text_echo,
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
        through the stream's assembly (server/response_items.py), so that both give the same items,
        in the same order, with the same logprobs."""
        self.count_reasoning(result.token_ids)
        assembler = Assembler(self, _no_event)
        events = assembler.feed_tokens(result.text, result.text_offsets, result.logprobs,
                                       result.finish_reason)  # fmt: skip
        for _ in events:
            pass
        return self.response(response_status(result.finish_reason), assembler.items.output, totals)


def _no_event(kind: str, **fields: Any) -> bytes:
    return b""


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
        assembler = Assembler(shaper, event)
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
