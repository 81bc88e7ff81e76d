"""Server-sent events for chat and text completions, plus the non-streaming collector.

A stream is `data: {chunk}\\n\\n` events ending with `data: [DONE]\\n\\n`. The first chat
chunk of every choice carries `delta.role`; a stop string is never emitted even in part
(engine.detokenizer holds back candidates). An error after the stream started becomes a
`data: {"error": {...}}` event followed by `data: [DONE]`, never a hang. When the client
goes away Starlette cancels the response; `EventStreamResponse` then closes the generator
chain at once, which cancels the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse
from starlette.types import Send
from tokenizers import Tokenizer

from engine.errors import TesseraError
from engine.protocol import TokenLogprob
from server.errors import error_body, tessera_error_body
from server.generation import GenerationJob, GenerationTotals, generate_choices, interleave
from server.logprobs import (
    chat_logprobs,
    prompt_logprobs,
    prompt_logprobs_json,
)
from server.openai_replies import CompletionTokensDetails, PromptTokensDetails, UsageInfo, dump
from server.prompt_echo import PromptEcho

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_JSON = msgspec.json.Encoder()


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # GenerationJob.text_offsets
    token_ids: list[int] = field(default_factory=list)


OnFinished = Callable[[GenerationTotals], None]


@contextlib.contextmanager
def counted_if_left(totals: GenerationTotals, n: int, on_finished: OnFinished) -> Iterator[None]:
    """Around a stream's body, up to its last event before [DONE]: a client that leaves
    first (the response closes the stream at a yield) still has its request counted, the
    tokens so far and each unfinished choice as aborted (vLLM's finished_reason "abort").
    A stream that ends calls `on_finished` itself, one that fails too, its totals'
    `error_code` set."""
    try:
        yield
    except (GeneratorExit, asyncio.CancelledError):
        totals.abort_unfinished(n)
        on_finished(totals)
        raise


class EventStreamResponse(StreamingResponse):
    """An SSE response that closes its body iterator however it ends.

    Starlette cancels `stream_response` when the client disconnects. If that lands while a
    chunk is being sent (not while waiting for the next one), Starlette leaves the body
    iterator suspended and unclosed; its engine requests then run on until the garbage
    collector finds the abandoned generators, seconds later. A client that stops reading
    is disconnected by the protocol (server/http_protocol.py, `--write-timeout-s`).
    """

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(data: dict[str, Any]) -> bytes:
    """One SSE event. Chunks are plain dicts encoded by msgspec (UTF-8, compact): a
    pydantic model per chunk cost ~30 us against ~1 us, on every token of every stream
    (tests/unit/fake_engine.py validates chunks against the pydantic models)."""
    return b"data: " + _JSON.encode(data) + b"\n\n"


class _ChunkWriter:
    """Builds the SSE chunks of one response: `writer(choices, usage=None)`. With
    `continuous_usage_stats` every chunk carries the usage so far, read from `totals` (a
    batch's: one a prompt). `request_id`: the answer's id, where it is not the job's."""

    def __init__(
        self,
        job: GenerationJob,
        object_name: str,
        *totals: GenerationTotals,
        request_id: str | None = None,
    ) -> None:
        self.header = {
            "id": request_id or job.request_id,
            "object": object_name,
            "created": job.created,
            "model": job.model_name,
        }
        self.totals = totals if job.continuous_usage else None

    def __call__(
        self, choices: list[dict[str, Any]], usage: UsageInfo | None = None, **extra: Any
    ) -> bytes:
        body = {**self.header, "choices": choices, **extra}
        if usage is None and self.totals is not None:
            usage = usage_of(*self.totals)
        if usage is not None:
            body["usage"] = dump(usage)
        return sse(body)


def usage_of(*totals: GenerationTotals) -> UsageInfo:
    """A response's usage: its one job's, or the sum over a batch's prompts."""
    prompt = sum(figures.num_prompt_tokens for figures in totals)
    generated = sum(figures.num_generated_tokens for figures in totals)
    cached = sum(figures.num_cached_tokens for figures in totals)
    reasoning = [f.num_reasoning_tokens for f in totals if f.num_reasoning_tokens is not None]
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=generated,
        total_tokens=prompt + generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=(
            CompletionTokensDetails(reasoning_tokens=sum(reasoning)) if reasoning else None
        ),
    )


async def collect(
    jobs: Sequence[GenerationJob],
    engine: Any,
    tokenizer: Tokenizer,
    totals: Sequence[GenerationTotals],
) -> list[list[ChoiceResult]]:
    """Run the jobs (one, or a batch's prompts) together to completion and return every
    choice's full text, job by job (non-streaming responses). The first error raises."""
    results = [[ChoiceResult() for _ in range(job.n)] for job in jobs]
    runs = [
        generate_choices(engine, tokenizer, job, figures)
        for job, figures in zip(jobs, totals, strict=True)
    ]
    async with contextlib.aclosing(interleave(runs)) as deltas:
        async for part, delta in deltas:
            if isinstance(delta, BaseException):
                raise delta
            _add(results[part][delta.index], delta)
    return results


def _add(result: ChoiceResult, delta: Any) -> None:
    result.text += delta.text
    result.logprobs.extend(delta.logprobs)
    result.text_offsets.extend(delta.text_offsets)
    result.token_ids += delta.token_ids
    if delta.finish_reason is not None:
        result.finish_reason = delta.finish_reason
        result.stop_reason = delta.stop_reason


async def stream_chat(
    job: GenerationJob,
    engine: Any,
    tokenizer: Tokenizer,
    *,
    with_logprobs: bool,
    on_finished: OnFinished,
) -> AsyncIterator[bytes]:
    totals = GenerationTotals(num_prompt_tokens=len(job.prompt.token_ids))
    chunk = _ChunkWriter(job, "chat.completion.chunk", totals)

    def choice(index: int, delta: dict, logprobs: Any = None, finish: str | None = None):
        # OpenAI's deltas carry only the fields they set; logprobs and finish_reason are
        # always there (null when unset).
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    # A forced tool call's answer has no content: null in every chunk, as OpenAI's (fuzz120,
    # fuzz121: the openai SDK's stream helper ended with content "" where parse() gave None).
    forced_calls = job.tools is not None and job.tools.mode != "auto"
    role = {"role": "assistant", "content": None if forced_calls else ""}

    def roles() -> bytes:
        # Before any text: no completion tokens yet, though the engine's first output,
        # which they may wait for, has counted one (fuzz115).
        usage = None
        if job.continuous_usage:
            usage = usage_of(GenerationTotals(totals.num_prompt_tokens, totals.num_cached_tokens))
        return b"".join(chunk([choice(index, role)], usage) for index in range(job.n))

    with counted_if_left(totals, job.n, on_finished):
        # The role chunks open the stream at once, unless each chunk carries the usage so
        # far: then they wait for the engine's first output, which says how many prompt
        # tokens the cache served (fuzz108: they said `cached_tokens: 0`), as vLLM's do.
        roles_due = job.continuous_usage
        if not roles_due:
            yield roles()
        extractors = [job.tools.extractor() for _ in range(job.n)] if job.tools else None
        splitters = [job.reasoning_splitter() for _ in range(job.n)]
        token_ids: list[list[int]] = [[] for _ in range(job.n)]  # for the reasoning count
        wants_prompt_logprobs = job.sampling.prompt_logprobs is not None
        deltas = guarded(generate_choices(engine, tokenizer, job, totals), totals)
        async with contextlib.aclosing(deltas) as pieces:
            async for piece in pieces:
                if roles_due:
                    yield roles()
                    roles_due = False
                if isinstance(piece, bytes):
                    yield piece
                    on_finished(totals)  # failed: counted as a stream error
                    return
                text, finish, call_deltas, reasoning = piece.text, piece.finish_reason, [], ""
                splitter = splitters[piece.index]
                if splitter is not None:  # the thinking first, then the answer
                    reasoning, text = splitter.feed(text, last=finish is not None)
                    token_ids[piece.index] += piece.token_ids
                    if finish is not None:
                        totals.add_reasoning(job.count_reasoning(tokenizer, token_ids[piece.index]))
                    if not job.include_reasoning:  # dropped: no empty chunk in its place
                        reasoning = ""
                if extractors is not None:  # content up to a tool call now, the calls at the end
                    extractor = extractors[piece.index]
                    text, call_deltas = extractor.feed_stream(text)
                    if finish is not None:
                        rest, last_deltas, calls = extractor.finish_stream()
                        text, call_deltas = text + rest, call_deltas + last_deltas
                        finish = job.tools.finish_reason(finish, calls)  # type: ignore[union-attr]
                extra = {}
                if wants_prompt_logprobs and totals.prompt_logprobs is not None:
                    wants_prompt_logprobs = False  # vLLM's field, once, in the first chunk after
                    scores = prompt_logprobs(tokenizer, totals.prompt_logprobs)
                    extra["prompt_logprobs"] = prompt_logprobs_json(scores)
                if (
                    not text
                    and not reasoning
                    and not call_deltas
                    and finish is None
                    and not (with_logprobs and piece.logprobs)
                    and not extra
                ):
                    continue
                logprobs = None
                if with_logprobs:
                    entries = chat_logprobs(tokenizer, piece.logprobs, as_ids=job.tokens_as_ids)
                    logprobs = dump(entries)
                no_content = None if call_deltas or forced_calls else ""
                delta: dict[str, Any] = {"content": text or no_content}
                if reasoning:
                    delta["reasoning"] = delta["reasoning_content"] = reasoning
                if call_deltas:
                    delta["tool_calls"] = call_deltas
                if call_deltas and finish is not None:
                    # The calls, then the finish in a chunk of its own, as OpenAI sends them:
                    # the openai SDK's stream helper takes a call's arguments as done only
                    # once a later chunk comes, and missed the last call's.
                    yield chunk([choice(piece.index, delta, logprobs, None)], **extra)
                    delta, logprobs, extra = {}, None, {}
                body = choice(piece.index, delta, logprobs, finish)
                if finish is not None:
                    body["stop_reason"] = piece.stop_reason
                yield chunk([body], **extra)
        if job.include_usage:
            yield chunk([], usage_of(totals))
    on_finished(totals)
    yield DONE


async def stream_completion(
    jobs: Sequence[GenerationJob],
    engine: Any,
    tokenizer: Tokenizer,
    *,
    echoes: Sequence[PromptEcho],
    on_finished: OnFinished,
    request_id: str | None = None,
) -> AsyncIterator[bytes]:
    """One job's stream, or a batch's (a job a prompt, run together; prompt `p`'s choice
    `i` is choice `p * n + i`; `request_id` the answer's id). Each choice's first chunk
    carries what its prompt's `echo` shows of the prompt."""
    totals = [GenerationTotals(num_prompt_tokens=len(job.prompt.token_ids)) for job in jobs]
    n = jobs[0].n
    started = [False] * (n * len(jobs))  # whether a choice's first chunk (the echo) went out
    chunk = _ChunkWriter(jobs[0], "text_completion", *totals, request_id=request_id)

    with contextlib.ExitStack() as counted:
        for job, figures in zip(jobs, totals, strict=True):
            counted.enter_context(counted_if_left(figures, job.n, on_finished))
        runs = [
            guarded(
                generate_choices(engine, tokenizer, job, figures, score_prompt_once=False), figures
            )
            for job, figures in zip(jobs, totals, strict=True)
        ]
        async with contextlib.aclosing(interleave(runs)) as pieces:
            async for part, piece in pieces:
                if isinstance(piece, bytes):
                    yield piece
                    on_finished(totals[part])  # failed: counted as a stream error
                    return
                job, echo, index = jobs[part], echoes[part], part * n + piece.index
                # A piece with no text may still carry logprobs (its text is held back).
                has_logprobs = echo.num_logprobs is not None and piece.logprobs
                is_first = not started[index]
                if not (piece.text or piece.finish_reason or is_first or has_logprobs):
                    continue
                choice: dict[str, Any] = {"index": index, "text": piece.text}
                if is_first:
                    echoed, logprobs, scores = echo.first(tokenizer, job.prompt.token_ids,
                                                          totals[part].prompt_logprobs,
                                                          piece.logprobs,
                                                          piece.text_offsets)  # fmt: skip
                    choice["text"] = echoed + piece.text
                    started[index] = True
                    if scores is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(scores)
                elif echo.num_logprobs is not None:
                    logprobs = echo.logprobs(tokenizer, piece.logprobs, piece.text_offsets)
                else:
                    logprobs = None
                choice["logprobs"] = None if logprobs is None else dump(logprobs)
                choice["finish_reason"] = piece.finish_reason
                if piece.finish_reason is not None:
                    choice["stop_reason"] = piece.stop_reason
                yield chunk([choice])
        if jobs[0].include_usage:
            yield chunk([], usage_of(*totals))
    for figures in totals:
        on_finished(figures)
    yield DONE


async def guarded(
    deltas: AsyncIterator[Any], totals: GenerationTotals | None = None
) -> AsyncIterator[Any]:
    """Pass deltas through; turn an error into the SSE error event + [DONE] (as bytes),
    its code noted in `totals`. Around a job's deltas, and around a whole response stream
    (server/app.py), so an error in building a chunk ends the stream as cleanly as one in
    the engine."""
    try:
        async for delta in deltas:
            yield delta
    except TesseraError as exc:
        if totals is not None:
            totals.error_code = exc.code or exc.type
        yield sse(tessera_error_body(exc)) + DONE
    except Exception:  # noqa: BLE001 - the stream must end cleanly whatever happened
        logger.exception("stream failed")
        if totals is not None:
            totals.error_code = "internal_error"
        body = error_body("internal server error", type="server_error", code="internal_error")
        yield sse(body) + DONE
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
