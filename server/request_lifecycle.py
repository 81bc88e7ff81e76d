"""What every generation route does around its job: check the engine lives, admit the
job's sequences (or 503), stream it or collect it until the client leaves, count what the
client got in the metrics and the request log, and give the admission back however it
ends (server/app.py's routes)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from engine.errors import EngineDeadError, InvalidRequest, ServerOverloaded
from server.admission import ServerDraining, Ticket
from server.app_state import AppState
from server.disconnects import ClientDisconnected, unless_client_leaves
from server.generation import GenerationJob, GenerationTotals
from server.request_log import arrival_of, record_of
from server.streaming import ChoiceResult, EventStreamResponse, collect, guarded

logger = logging.getLogger(__name__)


def check_alive(state: AppState, request: Request) -> None:
    if not getattr(state.engine, "is_alive", True):
        raise EngineDeadError("the engine is not running")
    if request.app.state.admission.is_draining:
        count_rejected(state, ServerDraining.reason)
        raise ServerDraining("the server is shutting down; retry on another replica")


def count_rejected(state: AppState, reason: str) -> None:
    state.metrics.on_request_rejected(reason)


def admit(request: Request, state: AppState, *jobs: GenerationJob) -> Ticket:
    """Reserve room for all `n` sequences of the job (of each of a batch's), or 503
    (counted). A batch larger than the whole room is a 400: an idle server admits any one
    request, and a batch of 1024 prompts x 16 held 16384 sequences while every other
    request got 503."""
    admission = request.app.state.admission
    num_sequences = sum(job.n for job in jobs)
    num_tokens = sum(job.n * len(job.prompt.token_ids) for job in jobs)
    if len(jobs) > 1 and (
        num_sequences > admission.max_sequences or num_tokens > admission.max_waiting_tokens
    ):
        raise InvalidRequest(
            f"this batch is {num_sequences} sequences of {num_tokens} prompt tokens (prompts "
            f"x n), more than the server admits at once ({admission.max_sequences} sequences: "
            f"--max-num-seqs + --max-waiting-requests; {admission.max_waiting_tokens} tokens: "
            "--max-waiting-tokens); send it in smaller batches",
            param="prompt",
        )
    # Features to download: a slow store holds the request in the engine, apart from the rest.
    fetches = any(item.feature is not None and not item.feature.url.startswith("data:")
                  for job in jobs for item in job.prompt.media)  # fmt: skip
    try:
        return admission.admit(num_sequences=num_sequences, num_tokens=num_tokens, fetches=fetches)
    except ServerOverloaded as exc:
        count_rejected(state, exc.reason)
        raise


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream(stream: Any, ticket: Ticket) -> EventStreamResponse:
    """A streamed answer's response: its chunks, ended with an error event if it fails,
    the ticket given back however it ends."""
    return EventStreamResponse(releasing(stream, ticket), headers=SSE_HEADERS)


async def releasing(stream: Any, ticket: Ticket) -> Any:
    """Yield from a response stream, ending it with an error event if it fails; release
    the admission ticket however it ends."""
    try:
        # Closed here, not left to the loop's finalizer: its aclose() ran as a task while
        # the `finally` below closed the stream under it ("aclose(): asynchronous
        # generator is already running", fuzz44).
        async with contextlib.aclosing(guarded(stream)) as chunks:
            async for chunk in chunks:
                yield chunk
    finally:
        ticket.release()
        with contextlib.suppress(Exception):
            await stream.aclose()


def finisher(state: AppState, request: Request) -> Callable[[GenerationTotals], None]:
    """Records a finished request's metrics, its latencies counted from its arrival."""
    start = arrival_of(request)

    def on_finished(totals: GenerationTotals) -> None:
        if totals.error_code is not None:
            state.metrics.on_stream_error(totals.error_code)
            return
        now = time.monotonic()
        for choice in totals.choices.values():
            if choice.finish_reason is None:
                continue
            first = choice.first_token_time
            state.metrics.on_choice_finished(
                finish_reason=choice.finish_reason,
                num_prompt_tokens=totals.num_prompt_tokens,
                ttft_s=None if first is None else first - start,
                latency_s=(choice.finish_time or now) - start,
            )
        state.metrics.on_token_gaps(totals.inter_token_seconds)
        record = record_of(request)
        if record is not None:
            # A batch's prompts finish one by one: the record sums them.
            record.prompt_tokens = (record.prompt_tokens or 0) + totals.num_prompt_tokens
            generated = totals.num_generated_tokens
            record.completion_tokens = (record.completion_tokens or 0) + generated

    return on_finished


async def collect_until_disconnect(
    request: Request, state: AppState, *jobs: GenerationJob
) -> list[tuple[GenerationTotals, list[ChoiceResult]]]:
    """Run a non-streaming generation (one job, or a batch's) to its end: each job's
    totals and choices. Cancel it (aborting in the engine) if the client disconnects
    first."""
    totals = [GenerationTotals(num_prompt_tokens=len(job.prompt.token_ids)) for job in jobs]
    on_finished = finisher(state, request)
    work = collect(jobs, state.engine, state.processor.tokenizer, totals)
    try:
        results = await unless_client_leaves(request, work)
    except ClientDisconnected:
        logger.info("client disconnected; request %s aborted", jobs[0].request_id)
        for job, figures in zip(jobs, totals, strict=True):
            figures.abort_unfinished(job.n)
            on_finished(figures)
        raise
    for figures in totals:
        on_finished(figures)
    return list(zip(totals, results, strict=True))
