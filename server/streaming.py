"""Server-sent events for chat and text completions, plus the non-streaming collector.

A stream is `data: {chunk}\\n\\n` events ending with `data: [DONE]\\n\\n`. The first chat
chunk of every choice carries `delta.role`; a stop string is never emitted even in part
(server.detokenizer holds back candidates). An error after the stream started becomes a
`data: {"error": {...}}` event followed by `data: [DONE]`, never a hang. When the client
goes away Starlette cancels the response; `EventStreamResponse` then closes the generator
chain at once, which cancels the engine requests.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Send
from tokenizers import Tokenizer

from engine.errors import TesseraError
from engine.protocol import SamplingParams, TokenLogprob
from server.errors import error_body, tessera_error_body
from server.generation import GenerationTotals, PreparedPrompt, generate_choices
from server.logprobs import chat_logprobs, completion_logprobs
from server.openai_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
    dump,
)

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class GenerationJob:
    """Everything needed to run one validated OpenAI request against the engine."""

    request_id: str
    model_name: str
    prompt: PreparedPrompt
    sampling: SamplingParams
    n: int
    stop: list[str]
    skip_special_tokens: bool = True
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0


OnFinished = Callable[[GenerationTotals], None]


class EventStreamResponse(StreamingResponse):
    """An SSE response that closes its body iterator however it ends.

    Starlette cancels `stream_response` when the client disconnects. If that lands while a
    chunk is being sent (not while waiting for the next one), Starlette leaves the body
    iterator suspended and unclosed; its engine requests then run on until the garbage
    collector finds the abandoned generators, seconds later.
    """

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_of(totals: GenerationTotals) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=totals.num_prompt_tokens,
        completion_tokens=totals.num_generated_tokens,
        total_tokens=totals.num_prompt_tokens + totals.num_generated_tokens,
    )


def _run(job: GenerationJob, engine: Any, tokenizer: Tokenizer, totals: GenerationTotals):
    return generate_choices(
        engine,
        tokenizer,
        job.request_id,
        job.prompt,
        job.sampling,
        n=job.n,
        stop=job.stop,
        skip_special_tokens=job.skip_special_tokens,
        totals=totals,
    )


async def collect(
    job: GenerationJob, engine: Any, tokenizer: Tokenizer, totals: GenerationTotals
) -> list[ChoiceResult]:
    """Run to completion and return every choice's full text (non-streaming responses)."""
    results = [ChoiceResult() for _ in range(job.n)]
    async for delta in _run(job, engine, tokenizer, totals):
        result = results[delta.index]
        result.text += delta.text
        result.logprobs.extend(delta.logprobs)
        result.num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            result.finish_reason = delta.finish_reason
    return results


async def stream_chat(
    job: GenerationJob,
    engine: Any,
    tokenizer: Tokenizer,
    *,
    with_logprobs: bool,
    on_finished: OnFinished,
) -> AsyncIterator[str]:
    totals = GenerationTotals()

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(
            id=job.request_id,
            created=job.created,
            model=job.model_name,
            choices=choices,
            usage=usage,
        )
        data = dump(body, exclude={"usage"} if usage is None else set())
        for choice in data["choices"]:  # OpenAI's deltas carry only the fields they set
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(data)

    started = [False] * job.n
    for index in range(job.n):
        role = DeltaMessage(role="assistant", content="")
        yield chunk([ChatChunkChoice(index=index, delta=role)])
        started[index] = True
    async with contextlib.aclosing(_guarded(_run(job, engine, tokenizer, totals))) as pieces:
        async for piece in pieces:
            if isinstance(piece, str):
                yield piece
                return
            if (
                not piece.text
                and piece.finish_reason is None
                and not (with_logprobs and piece.logprobs)
            ):
                continue
            logprobs = chat_logprobs(tokenizer, piece.logprobs) if with_logprobs else None
            choice = ChatChunkChoice(
                index=piece.index,
                delta=DeltaMessage(content=piece.text),
                logprobs=logprobs,
                finish_reason=piece.finish_reason,
            )
            yield chunk([choice])
    if job.include_usage:
        yield chunk([], usage_of(totals))
    on_finished(totals)
    yield DONE


async def stream_completion(
    job: GenerationJob,
    engine: Any,
    tokenizer: Tokenizer,
    *,
    with_logprobs: bool,
    on_finished: OnFinished,
) -> AsyncIterator[str]:
    totals = GenerationTotals()
    offsets = [0] * job.n

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        body = CompletionResponse(
            id=job.request_id,
            created=job.created,
            model=job.model_name,
            choices=choices,
            usage=usage,
        )
        return sse(dump(body, exclude={"usage"} if usage is None else set()))

    async with contextlib.aclosing(_guarded(_run(job, engine, tokenizer, totals))) as pieces:
        async for piece in pieces:
            if isinstance(piece, str):
                yield piece
                return
            if not piece.text and piece.finish_reason is None:
                continue
            logprobs = None
            if with_logprobs:
                logprobs = completion_logprobs(tokenizer, piece.logprobs, offsets[piece.index])
            offsets[piece.index] += len(piece.text)
            choice = CompletionChoice(
                index=piece.index,
                text=piece.text,
                logprobs=logprobs,
                finish_reason=piece.finish_reason,
            )
            yield chunk([choice])
    if job.include_usage:
        yield chunk([], usage_of(totals))
    on_finished(totals)
    yield DONE


async def _guarded(deltas: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Pass deltas through; turn an error into the SSE error event + [DONE] (as strings)."""
    try:
        async for delta in deltas:
            yield delta
    except TesseraError as exc:
        yield sse(tessera_error_body(exc)) + DONE
    except Exception:  # noqa: BLE001 - the stream must end cleanly whatever happened
        logger.exception("stream failed")
        body = error_body("internal server error", type="server_error", code="internal_error")
        yield sse(body) + DONE
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
