"""A request's `GenerationJob`: its prompt tokenised (off the event loop when long) and
truncated, its sampling built and checked against the model, its tool plan and reasoning
state. The routes of server/app.py call these between parsing a body and admitting it."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from engine.errors import InvalidRequest
from engine.multimodal.prompt import INLINE_TOKENIZE_CHARS, final_message_text
from server.chat import messages_as_dicts
from server.generation import GenerationJob, PreparedPrompt
from server.openai_models import ChatCompletionRequest
from server.reasoning import (
    THINK_END,
    prefill_opens_thinking,
    prompt_opens_thinking,
    reasoning_format,
)
from server.sampling_params import bad_word_token_ids, build_sampling_params, check_token_ids
from server.tool_calls import ToolPlan, call_format

if TYPE_CHECKING:
    from server.app_state import AppState


def prompt_bound(state: AppState, body: Any) -> int | None:
    """The most tokens a request's prompt may have: the context, unless the request
    truncates its prompt (then any length, cut after tokenising)."""
    return None if body.truncate_prompt_tokens is not None else state.max_model_len


async def tokenised_off_the_loop_if_long(tokenise: Callable[[], Any], text: Any) -> Any:
    """`tokenise()` in a worker thread when `text` (a prompt: a string, or strings in a
    list) is long, so the event loop serves other requests meanwhile (the tokenizer lets
    go of the GIL); inline otherwise, where a thread would cost more than the work."""
    strings = [text] if isinstance(text, str) else text if isinstance(text, list) else []
    length = sum(len(item) for item in strings if isinstance(item, str))
    if length > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(tokenise)
    return tokenise()


def build_job(state: AppState, body: Any, prompt: Any, *, prefix: str) -> GenerationJob:
    if body.n > state.settings.max_n:
        raise InvalidRequest(
            f"n must be at most {state.settings.max_n} (the server's --max-n), got {body.n}",
            param="n",
        )
    if body.priority and state.settings.engine.scheduling_policy != "priority":
        raise InvalidRequest(
            "priority needs the server's --scheduling-policy priority", param="priority"
        )
    prompt = _truncated(prompt, body, state.max_model_len)
    check_token_ids(body.stop_token_ids or [], state.vocab_size, "stop_token_ids")
    check_token_ids(body.allowed_token_ids or [], state.vocab_size, "allowed_token_ids")
    check_token_ids([token_id for token_id, _ in body.logit_bias_pairs], state.vocab_size,
                    "logit_bias")  # fmt: skip
    sampling = build_sampling_params(
        body,
        num_prompt_tokens=len(prompt.token_ids),
        max_model_len=state.max_model_len,
        kv_capacity=state.kv_capacity_tokens,
        defaults=state.sampling_defaults,
        max_logprobs=state.settings.engine.max_logprobs,
    )
    if body.bad_words:
        banned = bad_word_token_ids(body.bad_words, state.processor.tokenizer)
        sampling = msgspec.structs.replace(sampling, bad_words_token_ids=banned)
    thinking_opened = _thinking_opened(state, body, prompt)
    if thinking_opened and sampling.structured_output is not None:
        # The model thinks first: the grammar (a format, a required tool) holds after it.
        after = tuple(state.processor.encode(THINK_END))
        sampling = msgspec.structs.replace(sampling, structured_output_after=after)
    if body.cache_salt is not None:
        prompt = dataclasses.replace(prompt, cache_salt=body.cache_salt)
    return GenerationJob(
        request_id=f"{prefix}{uuid.uuid4().hex}",
        model_name=state.model_name,
        prompt=prompt,
        sampling=sampling,
        n=body.n,
        stop=body.stop_list,
        include_stop=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
        tokens_as_ids=body.return_tokens_as_token_ids,
        prompt_only=getattr(body, "prompt_only", False),
        text_offsets=getattr(body, "wants_text_offsets", False),
        tools=_tool_plan(state, body),
        thinking_opened=thinking_opened,
        include_reasoning=getattr(body, "include_reasoning", True),
        priority=body.priority,
        tokens_per_wake=state.settings.stream_interval if body.stream or body.stop_list else None,
        eos_token_ids=state.eos_token_ids,
        tokenizer_eos_token_id=state.processor.tokenizer_eos_token_id,
    )


def _truncated(prompt: PreparedPrompt, body: Any, max_model_len: int) -> PreparedPrompt:
    """The prompt after `truncate_prompt_tokens` (-1: what leaves room for max_tokens)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompt
    if keep == -1:
        keep = max_model_len - (body.requested_max_tokens or 1)
    if keep < 1:
        raise InvalidRequest("truncate_prompt_tokens must keep at least one token",
                             param="truncate_prompt_tokens")  # fmt: skip
    return prompt.keep_last(keep)


def _thinking_opened(state: AppState, body: Any, prompt: PreparedPrompt) -> bool | None:
    """A chat request's reasoning parsing (server/reasoning.py): None without a parser,
    else whether the rendered prompt left a <think> open for the model."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    template = body.chat_template or state.processor.chat_template
    if reasoning_format(state.settings.reasoning_parser, template) is None:
        return None
    # The last message alone (prepare_chat_prompt checked it already), not every turn's dump
    if body.continue_final_message and prefill_opens_thinking(
        final_message_text(messages_as_dicts(body.messages[-1:]))
    ):
        return True
    tail = state.processor.decode(prompt.token_ids[-8:], skip_special_tokens=False)
    return prompt_opens_thinking(tail)


def _tool_plan(state: AppState, body: Any) -> ToolPlan | None:
    """A chat request's tool plan, parsing calls in the format its chat template teaches."""
    plan = body.tool_plan if isinstance(body, ChatCompletionRequest) else None
    if plan is None:
        return None
    template = body.chat_template or state.processor.chat_template
    return dataclasses.replace(plan, format=call_format(state.settings.tool_call_parser, template))
