"""Run one OpenAI request (n choices) against the engine and turn token ids into text.

Shared by chat and completions, streaming and not. A request with `n` choices becomes
`n` engine requests `{id}-{i}`; their outputs are merged into one stream of `ChoiceDelta`s.
Leaving the iteration early (client gone, stop string hit, error) cancels the per-choice
tasks, which stops their `engine.generate` iterations and so aborts them in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tokenizers import Tokenizer

from engine.choices import answer_step, fan_out
from engine.detokenizer import IncrementalDetokenizer, SequenceDetokenizer
from engine.errors import EngineDeadError, InvalidRequest, TesseraError
from engine.protocol import (
    EngineRequest,
    MediaInput,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from server.errors import error_info_to_exception
from server.reasoning import ReasoningSplitter, count_reasoning_tokens
from server.tool_calls import ToolPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedPrompt:
    """A tokenised prompt with its media, ready to become engine requests."""

    token_ids: list[int]
    media: list[MediaInput] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)  # torch tensors for the extra frames
    cache_salt: str | None = None  # shares prefix-cache blocks only with the same salt
    # The request field of each `media` item (messages[0].content[1]): an engine error
    # names an item as media[i], which the client never wrote.
    media_params: tuple[str, ...] = ()

    def keep_last(self, num_tokens: int) -> PreparedPrompt:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `num_tokens` tokens. Cutting
        away media (or part of one) is refused rather than done silently."""
        cut = len(self.token_ids) - num_tokens
        if cut <= 0:
            return self
        for item in reversed(self.media):  # the last item the cut reaches: the one it splits
            if item.offset < cut:
                modality = item.modality.value
                article = "an" if modality[0] in "aeiou" else "a"
                raise InvalidRequest(
                    f"keeping the last {num_tokens} of the prompt's {len(self.token_ids)} "
                    f"tokens would cut away {article} {modality} (tokens {item.offset}-"
                    f"{item.offset + item.num_tokens - 1})",
                    param="truncate_prompt_tokens",
                )
        media = [msgspec.structs.replace(item, offset=item.offset - cut) for item in self.media]
        return dataclasses.replace(self, token_ids=self.token_ids[cut:], media=media)


@dataclass
class ChoiceDelta:
    """What one choice produced in one engine step, after detokenisation and stop strings."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    # With `text_offsets`: where each token's text starts in the choice's text.
    text_offsets: list[int] = field(default_factory=list)
    # vLLM's: the stop string or stop token id that finished the choice (None for EOS,
    # a grammar's end or the length limit).
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class GenerationJob:
    """Everything needed to run one validated OpenAI request against the engine."""

    request_id: str
    model_name: str
    prompt: PreparedPrompt
    sampling: SamplingParams
    n: int
    stop: list[str]
    include_stop: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name "token_id:{id}"
    prompt_only: bool = False  # echo with max_tokens 0: the generated token is left out
    text_offsets: bool = False  # completions' logprobs: each token's place in the text
    tools: ToolPlan | None = None  # chat with tools: answers are parsed for tool calls
    # chat with a reasoning parser: None (plain answers), or whether the prompt opened the
    # thinking already (server/reasoning.py)
    thinking_opened: bool | None = None
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops the thinking
    priority: int = 0  # --scheduling-policy priority: lower runs first
    # Tokens a delta waits for after the first (--stream-interval); None: the answer is
    # read only once it has ended (not streamed, no stop strings to look for).
    tokens_per_wake: int | None = 1
    eos_token_ids: tuple[int, ...] = ()  # an answer ending on one leaves its text out
    tokenizer_eos_token_id: int | None = None  # the EOS whose stop_reason is None
    created: int = field(default_factory=lambda: int(time.time()))

    def reasoning_splitter(self) -> ReasoningSplitter | None:
        """A splitter for one choice's answer, when the job's answers carry reasoning."""
        if self.thinking_opened is None:
            return None
        return ReasoningSplitter(opened=self.thinking_opened)

    def count_reasoning(self, tokenizer: Tokenizer, token_ids: Sequence[int]) -> int | None:
        """How many of one choice's tokens are its thinking (usage's `reasoning_tokens`),
        as the reasoning parser reads their text (server/reasoning.py
        `count_reasoning_tokens`); None without a parser."""
        if self.thinking_opened is None:
            return None
        detokenizer = IncrementalDetokenizer(tokenizer, self.prompt.token_ids,
                                             skip_special_tokens=self.skip_special_tokens)  # fmt: skip
        return count_reasoning_tokens(tokenizer, detokenizer, token_ids,
                                      opened=self.thinking_opened)  # fmt: skip


@dataclass
class GenerationTotals:
    """Running totals for usage and metrics, filled while the generation runs."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Per choice, for the metrics (each choice counts as one request, as vLLM's children of
    # n > 1 do): what the client got of it and when; and the gaps between consecutive
    # tokens of a choice, all choices together.
    choices: dict[int, ChoiceFigures] = field(default_factory=dict)
    inter_token_seconds: list[float] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: the prompt's scores (the same for every choice).
    prompt_logprobs: list[TokenLogprob] | None = None
    # A stream that failed after its 200: the error's code (server/streaming.py `guarded`).
    error_code: str | None = None
    # Chat with a reasoning parser: the choices' thinking tokens (vLLM's and OpenAI's
    # usage.completion_tokens_details.reasoning_tokens); None without one.
    num_reasoning_tokens: int | None = None

    def add_reasoning(self, count: int | None) -> None:
        if count is not None:
            self.num_reasoning_tokens = (self.num_reasoning_tokens or 0) + count

    def choice(self, index: int) -> ChoiceFigures:
        if (figures := self.choices.get(index)) is None:
            figures = self.choices[index] = ChoiceFigures()
        return figures

    def abort_unfinished(self, n: int) -> None:
        """The client left: each of the `n` choices that has not finished counts as
        aborted (vLLM's finished_reason "abort")."""
        for index in range(n):
            if self.choice(index).finish_reason is None:
                self.finish(index, "abort")

    @property
    def num_generated_tokens(self) -> int:
        """What the choices got, all together (usage's `completion_tokens`)."""
        return sum(figures.num_tokens for figures in self.choices.values())

    def finish(self, index: int, reason: str) -> None:
        figures = self.choice(index)
        figures.finish_reason, figures.finish_time = reason, time.monotonic()

    def note_tokens(self, index: int, num_tokens: int) -> None:
        """`num_tokens` of choice `index` reached the client now (one output's, less
        those after a stop string): its token count and timing."""
        if not num_tokens:
            return
        figures = self.choice(index)
        now = time.monotonic()
        if figures.first_token_time is None:
            figures.first_token_time = now
            if num_tokens > 1:  # the first token came with others (a merged backlog)
                self.inter_token_seconds += [0.0] * (num_tokens - 1)
        else:  # several tokens in one output share the gap
            gap = (now - figures.last_token_time) / num_tokens
            self.inter_token_seconds += [gap] * num_tokens
        figures.last_token_time = now
        figures.num_tokens += num_tokens


@dataclass
class ChoiceFigures:
    """One choice as the client got it: tokens, first and last token times, its end."""

    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float = 0.0
    finish_reason: str | None = None
    finish_time: float | None = None


def build_engine_requests(
    request_id: str,
    prompt: PreparedPrompt,
    sampling: SamplingParams,
    n: int,
    priority: int = 0,
    *,
    score_prompt_once: bool = True,
) -> list[EngineRequest]:
    """The `n` engine requests of one OpenAI request. The prompt's scores are the same
    for every choice: with `score_prompt_once` only the first choice computes them (a
    completions stream shows them in every choice's first chunk, so there each does)."""
    request = EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt.token_ids,
        sampling=sampling,
        media=prompt.media,
        arrival_time=time.time(),
        priority=priority,
        cache_salt=prompt.cache_salt,
    )
    return fan_out(request, n, score_prompt_once=score_prompt_once)


def _merge(
    engine: Any, requests: list[EngineRequest], tensors: list[Any], tokens_per_wake: int | None
) -> AsyncIterator[tuple[int, RequestOutput | BaseException]]:
    """Run all engine requests concurrently; yield (choice index, output or exception)."""
    return interleave(
        [engine.generate(r, tensors, tokens_per_wake=tokens_per_wake) for r in requests]
    )


async def interleave(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Run async iterators concurrently; yield (which, item) as the items come. An
    exception a stream raises comes as its last item. Leaving early closes them all."""
    if len(streams) == 1:  # the common case: no task and queue hop per token
        stream = streams[0]
        try:
            while True:
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
                except Exception as exc:  # noqa: BLE001 - handed to the consumer
                    yield 0, exc
                    return
                yield 0, item  # outside the try: a close here must not be caught
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    ended = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
        await queue.put((index, ended))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is ended:
                num_open -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def generate_choices(
    engine: Any,
    tokenizer: Tokenizer,
    job: GenerationJob,
    totals: GenerationTotals,
    *,
    score_prompt_once: bool = True,
) -> AsyncIterator[ChoiceDelta]:
    """Yield the text deltas of all the job's choices, interleaved, until every choice has
    finished. A prompt-only job's generated tokens are dropped as they come (no text,
    logprobs or completion tokens). Between a choice's first and last delta, one comes once
    `job.tokens_per_wake` new tokens wait (None: none; EngineClient.generate).
    `score_prompt_once` False: every choice's first delta carries the prompt's scores.

    Raises the typed error of a failed choice (`EngineDeadError`, `InvalidRequest`, ...).
    """
    prompt, sampling, n = job.prompt, job.sampling, job.n
    requests = build_engine_requests(job.request_id, prompt, sampling, n, job.priority,
                                     score_prompt_once=score_prompt_once)  # fmt: skip
    detokenizers = [
        SequenceDetokenizer(
            tokenizer,
            prompt.token_ids,
            job.stop,
            skip_special_tokens=job.skip_special_tokens,
            min_tokens=sampling.min_tokens,
            include_stop=job.include_stop,
            track_offsets=job.text_offsets,
        )
        for _ in range(n)
    ]
    finished = [False] * n
    totals.num_prompt_tokens = len(prompt.token_ids)
    merged = _merge(engine, requests, prompt.tensors, job.tokens_per_wake)
    try:
        async for index, item in merged:
            if finished[index]:
                continue  # a stop string already ended this choice
            if isinstance(item, BaseException):
                if isinstance(item, TesseraError):
                    raise item
                raise EngineDeadError("the engine failed while serving the request") from item
            if job.prompt_only:
                item = msgspec.structs.replace(item, new_token_ids=[], logprobs=None)
            delta = _apply_output(detokenizers[index], index, item, totals, sampling, prompt,
                                  job.eos_token_ids, job.tokenizer_eos_token_id)  # fmt: skip
            if delta.finish_reason is not None:
                finished[index] = True
                totals.finish(index, delta.finish_reason)
                if delta.finish_reason == "stop" and item.finish_reason is None:
                    await _abort_quietly(engine, [requests[index].request_id])
            yield delta
            if all(finished):
                break
    finally:
        await merged.aclose()


def _apply_output(
    detokenizer: SequenceDetokenizer,
    index: int,
    output: RequestOutput,
    totals: GenerationTotals,
    sampling: SamplingParams,
    prompt: PreparedPrompt,
    eos_token_ids: Sequence[int],
    tokenizer_eos: int | None,
) -> ChoiceDelta:
    if output.error is not None:
        raise error_info_to_exception(output.error, prompt.media_params)
    if output.num_cached_tokens:
        totals.num_cached_tokens = max(totals.num_cached_tokens, output.num_cached_tokens)
    if output.prompt_logprobs is not None and totals.prompt_logprobs is None:
        totals.prompt_logprobs = output.prompt_logprobs
    step = answer_step(detokenizer, output, sampling, eos_token_ids, tokenizer_eos)
    totals.note_tokens(index, step.num_tokens)
    if step.finish_reason == "error":
        raise EngineDeadError("the engine failed while serving the request")
    if step.finish_reason == "abort":
        raise EngineDeadError("the request was aborted by the engine")
    return ChoiceDelta(
        index=index,
        text=step.text,
        token_ids=list(output.new_token_ids[: step.num_tokens]),
        logprobs=list(output.logprobs or [])[: step.num_tokens],
        finish_reason=step.finish_reason,
        stop_reason=step.stop_reason,
        text_offsets=step.text_offsets,
    )


async def _abort_quietly(engine: Any, request_ids: list[str]) -> None:
    try:
        await engine.abort(request_ids)
    except Exception:  # noqa: BLE001 - the request is ending anyway
        logger.debug("abort of %s failed", request_ids, exc_info=True)
