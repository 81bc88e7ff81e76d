"""Pydantic models of the OpenAI request bodies we accept (the replies are in
`server/openai_replies.py`; the structured-output fields in
`server/structured_output_fields.py`, `mm_processor_kwargs` in `server/media_options.py`).

Requests are validated here (types, ranges); pydantic errors become 400s naming the field
path in `server/errors.py`. Unknown request fields are ignored, like OpenAI does; keys of
vLLM's `structured_outputs` that Tessera does not implement are refused rather than ignored.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.errors import InvalidRequest
from engine.protocol import StructuredOutput
from server.chat_messages import (
    ChatMessage,
    NamedToolChoice,
    RequestModel,
    TokenId,
    Tool,
    few_enough_tools,
    some_messages,
)
from server.chat_template_fields import ChatTemplateFields
from server.field_limits import bounded, check_count
from server.media_options import MediaProcessingOptions
from server.structured_output_fields import (
    ResponseFormat,
    StructuredOutputs,
    structured_output_of,
    with_guided_fields_mapped,
)
from server.tool_calls import ToolPlan, check_tools, tool_plan

# Limits OpenAI's API or the engine fix (each violation is a 400 naming the field); those an
# operator may change are settings (server/field_limits.py).
MAX_ABS_LOGIT_BIAS = 100.0
MAX_INT64 = 2**63 - 1
MAX_CACHE_SALT_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 2**18  # more than any vocabulary served

def null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
    """A `mode="before"` validator: an explicit null is the field's default, as OpenAI's
    types and vLLM take it (the openai client sends one when a caller passes None on)."""
    return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: usage so far in every chunk (of the whole request, all its choices and prompts)
    continuous_usage_stats: bool = False
    # fuzz108: null was a 400 here, where vLLM reads it as the default
    _nulls = field_validator("include_usage", "continuous_usage_stats", mode="before")(
        null_is_the_default
    )


class SamplingFields(RequestModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: no EOS / stop before this many
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-MAX_INT64 - 1, le=MAX_INT64)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string
    # vLLM's: words the answer never writes (server/sampling_params.py's bad_word_token_ids)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int = Field(default=1, ge=1)  # <= --max-n
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    user: str | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # vLLM's: keep only the prompt's last k tokens (-1: as many as fit with max_tokens)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: str | None = None  # vLLM's; "left" (keep the last tokens) alone here
    # vLLM's: only these tokens may be picked (with a grammar: those both allow)
    allowed_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    # vLLM's: logprobs name their tokens "token_id:{id}" (a token may be part of a character)
    # The logprob fields are strict: `logprobs: false` was read as 0, the chosen token's
    # logprob, and turned them on (fuzz77).
    return_tokens_as_token_ids: StrictBool = False
    # vLLM's: score every prompt token, with this many alternatives (the answer's
    # `prompt_logprobs`: null for the first token, then {token id: {logprob, rank, ...}}).
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0)  # <= --max-logprobs
    # vLLM's: with --scheduling-policy priority, lower runs first (else only 0 is allowed).
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # vLLM's: the prompt shares prefix-cache blocks only with requests of the same salt
    # (per tenant, say), so timing cannot tell one tenant what another one asked.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Constrained decoding (engine/structured_output.py); at most one of the two.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        """vLLM's older names of `structured_outputs`, mapped onto it."""
        return with_guided_fields_mapped(data) if isinstance(data, dict) else data

    _null_stream_or_n = field_validator("stream", "n", mode="before")(null_is_the_default)

    @field_validator("truncation_side")
    @classmethod
    def _left_only(cls, side: str | None) -> str | None:
        if side not in (None, "left"):  # fuzz103: it was ignored, "right" and "bogus" alike
            raise ValueError(
                f"truncation_side {side!r} is not supported: truncate_prompt_tokens keeps the "
                "prompt's last tokens ('left')"
            )
        return side

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(
        cls, structured: StructuredOutputs | None, info: ValidationInfo
    ) -> StructuredOutputs | None:
        response_format = info.data.get("response_format")
        if structured is not None and response_format and response_format.type != "text":
            raise ValueError("give either response_format or structured_outputs, not both")
        return structured

    @property
    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The engine's constraint and the field it came from, or None for free text."""
        return structured_output_of(self.structured_outputs, self.response_format)

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options needs stream: true")  # as vLLM and OpenAI
        return options

    # Lists and mappings a body may make long are counted before their items are validated
    # (server/field_limits.py).
    _few_biases = field_validator("logit_bias", mode="before")(
        bounded(count=("max_logit_bias_tokens", "biased tokens"))
    )
    _few_bad_words = field_validator("bad_words", mode="before")(
        bounded(("max_bad_words", "bad words"), ("max_stop_string_chars", "a bad word"))
    )
    _few_stop_token_ids = field_validator("stop_token_ids", mode="before")(
        bounded(count=("max_stop_token_ids", "stop token ids"))
    )
    _few_stop_strings = field_validator("stop", mode="before")(
        bounded(("max_stop_strings", "stop strings"), ("max_stop_string_chars", "a stop string"))
    )

    @field_validator("logit_bias")
    @classmethod
    def _bounded_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if not bias:
            return bias
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise ValueError(f"keys must be token ids, got {key[:40]!r}")
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"biases must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {value}"
                )
        return bias

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) by token id; "007" and "7" name one token, the last one wins."""
        merged = {int(key): value for key, value in (self.logit_bias or {}).items()}
        return tuple(sorted(merged.items()))

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else stop or []
        if any(item == "" for item in items):  # vLLM's refusal too; it would stop nothing
            raise ValueError("stop cannot contain an empty string")
        return stop

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: every chunk carries the usage so far (with
        `include_usage`, as vLLM asks)."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)  # <= --max-logprobs
    mm_processor_kwargs: MediaProcessingOptions | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out of the answer
    # OpenAI's fields that would change the answer and that Tessera does not serve: refused
    # rather than ignored (an ignored function_call answered in text, not with the call).
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None

    _null_logprobs = field_validator("logprobs", mode="before")(null_is_the_default)

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(
                f"{info.field_name} (deprecated by OpenAI) is not supported; use tools and "
                "tool_choice"
            )
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, modalities: list[str] | None) -> list[str] | None:
        if modalities and set(modalities) != {"text"}:
            raise ValueError("only text output is supported: modalities must be ['text']")
        return modalities

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, audio: Any) -> Any:
        if audio is not None:
            raise ValueError("audio output is not supported")
        return audio

    _some_messages = field_validator("messages", mode="before")(some_messages)
    _few_enough_tools = field_validator("tools", mode="before")(few_enough_tools)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):  # OpenAI's 400 too
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @field_validator("tools")
    @classmethod
    def _some_tools_of_distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        if tools == []:  # OpenAI's and vLLM's 400 too (vllm-project/vllm#39741)
            raise ValueError("tools must not be empty: leave the field out for no tools")
        first: dict[str, int] = {}
        for index, tool in enumerate(tools or ()):
            name = tool.function.name
            if name in first:
                # The model could not tell them apart, nor the answer which one it called.
                raise ValueError(
                    f"tools[{index}] has the name {name!r} of tools[{first[name]}]: each "
                    "function needs a name of its own"
                )
            first[name] = index
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, tool_choice: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return tool_choice  # the tools failed validation: that is the error to report
        tools = info.data.get("tools")
        check_tools([tool.model_dump() for tool in tools or ()], _as_dict(tool_choice))
        constrained = tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)
        response_format = info.data.get("response_format")
        has_format = response_format is not None and response_format.type != "text"
        if tools and constrained and (has_format or info.data.get("structured_outputs")):
            raise ValueError(
                "a required or named tool call constrains the output itself; leave "
                "response_format, structured_outputs and guided_* out"
            )
        return tool_choice

    @functools.cached_property
    def tool_plan(self) -> ToolPlan | None:
        """Read by the prompt, the grammar check, the sampling params and the response:
        worked out once."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or ()]
        return tool_plan(tools, _as_dict(self.tool_choice), self.parallel_tool_calls)

    @property
    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        plan = self.tool_plan
        constraint = plan.constraint() if plan else None
        if constraint is not None:
            return constraint, "tools"
        return super().structured_output

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


def _as_dict(tool_choice: Any) -> Any:
    return tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else tool_choice


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # OpenAI's and vLLM's default; null: as many as the context has room for. 0: with
    # echo, the prompt only.
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0)  # <= --max-logprobs
    echo: bool = False

    _null_echo = field_validator("echo", mode="before")(null_is_the_default)
    # OpenAI's fields that would change the answer and that Tessera does not serve: refused
    # rather than ignored (an ignored suffix answers a fill-in-the-middle prompt wrongly).
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _at_most_max_prompts(cls, prompt: Any) -> Any:
        # Before the union is tried over every item: 5 M `[0]` prompts took 10 s of it.
        if not (isinstance(prompt, list) and prompt):
            return prompt
        if type(prompt[0]) is int:
            # One prompt of token ids. A string further on made the union try each of its
            # members over every item: 1 M of them held the event loop 20 s (fuzz51).
            for index, item in enumerate(prompt):
                if type(item) is not int:
                    raise ValueError(
                        f"prompt[{index}] is not a token id as prompt[0] is: a prompt of "
                        "token ids holds only integers"
                    )
        elif isinstance(prompt[0], str | list):
            check_count(len(prompt), "max_prompts_per_request", "prompts in one request")
            # A batch: all strings or all token-id lists. Left to the union, a mixed one's
            # error named the first prompt, whichever was wrong (fuzz37).
            kind = type(prompt[0])
            for index, item in enumerate(prompt):
                if not isinstance(item, kind):
                    raise ValueError(
                        f"prompt[{index}] is not a {'string' if kind is str else 'token-id list'}"
                        " as prompt[0] is: a batch is all strings or all token-id lists"
                    )
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or a batch: a string or token ids, each."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (fill in the middle) is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of ({best_of}) must be at least n ({n})")
        if best_of is not None and best_of > n:
            raise ValueError("best_of larger than n (candidates ranked on the server) is not "
                             "supported; ask for n choices instead")  # fmt: skip
        return best_of

    @property
    def prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) without a completion,
        how evaluation harnesses score a text. The engine still picks one token (it runs a
        prefill either way), which the answer leaves out."""
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be at least 1 (0 only with echo)",
                                 param="max_tokens")  # fmt: skip
        return self.max_tokens == 0

    @property
    def wants_text_offsets(self) -> bool:
        """The legacy logprobs' `text_offset`: where each token's text starts."""
        return self.logprobs is not None

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` scores the echoed prompt too (OpenAI's legacy shape)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered as chat's
    _some_messages = field_validator("messages", mode="before")(some_messages)
    _few_enough_tools = field_validator("tools", mode="before")(few_enough_tools)
    # vLLM's defaults: a prompt gets the tokenizer's specials (a BOS), a chat only what its
    # template writes unless asked (see `with_special_tokens`); null is the default.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # vLLM's: each token's own string, as the vocabulary has it
    # How a chat's media are sized (as on the chat), and whose media uuids it may name
    mm_processor_kwargs: MediaProcessingOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @property
    def with_special_tokens(self) -> bool:
        """Whether the tokenizer's special tokens go around the tokens (on a chat, around
        what its template wrote, as vLLM's `add_special_tokens: true` does)."""
        if self.add_special_tokens is None:
            return self.messages is None
        return self.add_special_tokens


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]
