"""Pydantic models of the OpenAI JSON bodies Tessera answers with: chat completions (whole
and streamed chunks), completions, the model list and errors.

They are plain models whose `model_dump(exclude_none=...)` is the exact OpenAI JSON; a
field that OpenAI leaves out when unset is dropped by a wrap serializer. Called "replies"
so they are not mistaken for the Responses API (`server/responses.py`). The request bodies
are in `server/openai_models.py`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0  # completion tokens that were thinking (a reasoning parser's)


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # with a reasoning parser only, as vLLM: left out of the JSON otherwise
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _no_null_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "completion_tokens_details")


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Response):
    content: list[TokenLogprobInfo] | None = None


class ResponseFunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: str = "function"
    function: ResponseFunctionCall


class ResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    # The thinking before the answer (server/reasoning.py), under both names clients read:
    # `reasoning_content` (DeepSeek's, SGLang's, vLLM's before 0.11) and `reasoning` (what
    # vLLM renamed it to, after OpenAI's guidance for gpt-oss). Set reasoning_content.
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None  # left out of the JSON when None

    @model_serializer(mode="wrap")
    def _no_null_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        message = _without_null(handler(self), "tool_calls", "reasoning_content")
        if "reasoning_content" in message:
            message["reasoning"] = message["reasoning_content"]
        return message


class ChatChoice(_Response):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked

    @model_serializer(mode="wrap")
    def _no_null_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "prompt_logprobs")


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None  # a fragment: a call's fragments add up to its arguments


class DeltaToolCall(_Response):
    """A streamed piece of a tool call: the first carries its id, type and name."""

    index: int  # which call of the choice; a call's pieces share it
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text: vLLM's newer name
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # on the chunk that finishes the choice


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(_Response):
    """vLLM's score of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked

    @model_serializer(mode="wrap")
    def _no_null_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "prompt_logprobs")


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tessera"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _without_null(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """`data` without those `keys` that are None: optional fields left out of the JSON."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


def dump(model: BaseModel, **kwargs: Any) -> dict:
    return model.model_dump(mode="json", **kwargs)
