"""The outputs of one request on their way from the engine's socket to its `generate()`.

The engine sends one `RequestOutput` per request per step. When the event loop keeps up,
the consumer takes each one as it comes: one token, one SSE chunk. When it falls behind
(many streams, a fast GPU), outputs that arrive before the consumer comes back are
merged into the waiting one, so one chunk and one socket write carry several tokens.
The cost per token then falls exactly when the API process is the bottleneck, instead
of a backlog growing in the queue.

`tokens_per_wake` merges on purpose: the consumer is woken for the first output (time to
first token) and the last, and in between only once that many new tokens wait
(`--stream-interval`); None wakes it for nothing in between (an answer nobody reads
before it ends: not streamed, no stop strings to look for).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from engine.protocol import RequestOutput


def merge_outputs(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """`first` followed by `second`, as if the engine had produced both in one step."""
    logprobs = None
    if first.logprobs is not None or second.logprobs is not None:
        logprobs = [*(first.logprobs or ()), *(second.logprobs or ())]
    return msgspec.structs.replace(
        second,
        new_token_ids=[*first.new_token_ids, *second.new_token_ids],
        logprobs=logprobs,
        prompt_logprobs=_last(first.prompt_logprobs, second.prompt_logprobs),
        num_prompt_tokens=second.num_prompt_tokens or first.num_prompt_tokens,
        num_cached_tokens=max(first.num_cached_tokens, second.num_cached_tokens),
        queued_seconds=_last(first.queued_seconds, second.queued_seconds),
        prefill_seconds=_last(first.prefill_seconds, second.prefill_seconds),
        decode_seconds=_last(first.decode_seconds, second.decode_seconds),
    )


def _last(first: Any, second: Any) -> Any:
    return first if second is None else second


class OutputCollector:
    """At most one pending (merged) output, plus a failure to raise after it."""

    def __init__(self, tokens_per_wake: int | None = 1) -> None:
        self._output: RequestOutput | None = None
        self._failure: BaseException | None = None
        self._ready = asyncio.Event()  # set: `get()` has something to return or raise
        self._tokens_per_wake = tokens_per_wake
        self._has_given = False

    def put(self, output: RequestOutput) -> None:
        pending = self._output
        self._output = output if pending is None else merge_outputs(pending, output)
        if self._wakes_consumer(self._output):
            self._ready.set()

    def _wakes_consumer(self, pending: RequestOutput) -> bool:
        if not self._has_given or pending.finish_reason is not None:
            return True  # the first token (time to first token) and the end, at once
        wanted = self._tokens_per_wake
        return wanted is not None and len(pending.new_token_ids) >= wanted

    def fail(self, failure: BaseException) -> None:
        """`get()` raises `failure` once the output already waiting has been taken."""
        self._failure = failure
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        if self._output is None:
            raise self._failure
        output, self._output = self._output, None
        self._has_given = True
        if self._failure is None:
            self._ready.clear()
        return output
