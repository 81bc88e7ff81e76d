"""What a step's sampled token makes of a request, for the scheduler's `update`
(engine/scheduler.py): whether it finishes the request (`stop_status`), the error of a
grammar that refuses it (`grammar_failure`), and the `RequestOutput` sent to the frontend
(`request_output`)."""

from __future__ import annotations

import time

from engine.protocol import ErrorInfo, RequestOutput, SamplingParams, TokenLogprob
from engine.request import Request, RequestStatus, counted_output_tokens


def stop_status(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The status `token_id`, just appended, finishes `request` with, or None."""
    sampling = request.sampling
    if not sampling.ignore_eos and token_id in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if token_id in sampling.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar_active and request.grammar.is_complete:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= sampling.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def grammar_failure(reason: str | None, sampling: SamplingParams) -> ErrorInfo:
    spec = sampling.structured_output
    return ErrorInfo(
        f"the structured output's grammar failed: {reason or 'no allowed token'}",
        param=spec.param if spec else None,
        code="invalid_value",  # as the same grammar refused before generation is
    )


def request_output(
    request: Request, token_ids: list[int], logprobs: list[TokenLogprob] | None = None
) -> RequestOutput:
    """The step's output of `request`: its new tokens, and once finished its finish reason,
    error and phase times."""
    prompt_logprobs = None
    is_first_token = bool(token_ids) and request.num_output_tokens == len(token_ids)
    if request.sampling.prompt_logprobs is not None and is_first_token:
        prompt_logprobs = request.prompt_logprobs  # once, with the first token
    if not request.is_finished:  # every decode step of every request: the short form
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=token_ids,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        finish_reason=request.status.finish_reason,
        error=request.error,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_output_tokens=counted_output_tokens(
            request.status.finish_reason, request.num_output_tokens
        ),
        **request.phase_seconds(time.monotonic()),
    )
