"""An OpenAI request's sampling fields, checked against the model and the server (context,
KV cache, vocabulary, grammar), as the engine's `SamplingParams`."""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import blake3
import msgspec
from tokenizers import Tokenizer

from engine.errors import ContextLengthExceeded, InvalidRequest, too_long_for_kv_cache
from engine.generation_defaults import SamplingDefaults
from engine.protocol import DEFAULT_MAX_LOGPROBS, SamplingParams, StructuredOutput
from server.field_limits import check_lengths
from server.openai_models import SamplingFields

# llguidance's check of a large schema takes ~0.3 s (5000 properties), with the GIL
# released. In asyncio's default pool, which also renders every chat prompt, a burst of
# them held plain chats for seconds (fuzz53: 13 s for a 2-token chat behind 48): the checks
# get two threads of their own, and a schema checked once is not checked again.
GRAMMAR_CHECK_THREADS = 2
GRAMMAR_CHECKS_REMEMBERED = 256
GRAMMAR_ERROR_CHARS = 500  # of llguidance's message, which may quote the whole schema
_grammar_checks = ThreadPoolExecutor(GRAMMAR_CHECK_THREADS, thread_name_prefix="grammar-check")


class GrammarRefused(InvalidRequest):
    """A structured output llguidance cannot build; `detail` is its (shortened) reason, kept
    apart so that a renamed field (the Responses API's) never rewrites the client's text."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"invalid {param}: {detail}", param=param)
        self.detail = detail


# A check's answer: why the spec cannot constrain a request (None: it can), and the spec
# the engine gets (a GBNF grammar as Lark, converted once, here).
Verdict = tuple[str | None, StructuredOutput]


class _GrammarVerdicts:
    """An LRU of grammar checks' answers, keyed by the blake3 of the spec: a schema can be
    megabytes, its digest is 32 bytes. Looked up on the event loop; only a spec not seen
    yet goes to a check thread, once however many requests carry it."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()
        self._in_flight: dict[bytes, asyncio.Future] = {}

    @staticmethod
    def _key(spec: StructuredOutput) -> bytes:
        return blake3.blake3(msgspec.msgpack.encode(spec)).digest()

    def engine_spec(self, spec: StructuredOutput) -> StructuredOutput:
        """What the engine gets for a checked `spec` (`spec` itself if its verdict is gone:
        the engine converts a GBNF grammar then). Only a grammar can change: the others
        are not hashed a second time."""
        if spec.grammar is None:
            return spec
        verdict = self._verdicts.get(self._key(spec))
        return spec if verdict is None else verdict[1]

    async def check(self, spec: StructuredOutput) -> str | None:
        """Why `spec` cannot constrain a request, or None (`engine_spec` then says what the
        engine gets)."""
        key = self._key(spec)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return self._verdicts[key][0]
        if key not in self._in_flight:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(_grammar_checks, _grammar_verdict, spec)
            future.add_done_callback(functools.partial(self._settle, key))
            self._in_flight[key] = future
        # shielded: a request that leaves does not cancel the others' shared check
        error, _ = await asyncio.shield(self._in_flight[key])
        return error

    def _settle(self, key: bytes, future: asyncio.Future) -> None:
        del self._in_flight[key]
        if not future.cancelled() and future.exception() is None:
            self._verdicts[key] = future.result()
            if len(self._verdicts) > self._capacity:
                self._verdicts.popitem(last=False)


def _grammar_verdict(spec: StructuredOutput) -> Verdict:
    # llguidance only when asked for
    from engine.structured_output import grammar_error, lark_spec

    try:
        ready = lark_spec(spec)
    except ValueError as exc:
        return str(exc)[:GRAMMAR_ERROR_CHARS], spec
    error = grammar_error(ready)
    return (None if error is None else error[:GRAMMAR_ERROR_CHARS]), ready


_grammar_verdicts = _GrammarVerdicts(GRAMMAR_CHECKS_REMEMBERED)


async def check_structured_output(request: SamplingFields) -> None:
    """A 400 naming the field when the request's grammar is too large or cannot be built."""
    constraint = request.structured_output
    if constraint is None:
        return
    spec, param = constraint
    try:  # whatever the schema came from (response_format, structured_outputs, tools)
        check_lengths(spec.json or "", "max_structured_output_schema_chars", "a JSON schema")
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=param) from None
    error = await _grammar_verdicts.check(spec)
    if error is not None:
        raise GrammarRefused(param, error)


OPENAI_DEFAULTS = SamplingDefaults()


def _fit_kv_cache(
    max_tokens: int,
    num_prompt_tokens: int,
    kv_capacity: int,
    max_model_len: int,
    *,
    asked: bool,
    param: str,
) -> int:
    """`max_tokens` within a KV cache smaller than the context: a default one (not
    `asked`) shrinks to the cache's room, as it does to the context's; one the request
    asked for must fit, by the engine's own check (`too_long_for_kv_cache`), which the
    engine would make only after a stream had opened. `param` names the field at fault:
    the prompt's, or the one that asked."""
    if not asked:
        if num_prompt_tokens >= kv_capacity:
            raise ContextLengthExceeded(
                f"the prompt is {num_prompt_tokens} tokens, which leaves no room to generate "
                f"in the server's KV cache of {kv_capacity} tokens",
                param=param,
            )
        return min(max_tokens, kv_capacity - num_prompt_tokens)
    refusal = too_long_for_kv_cache(num_prompt_tokens, max_tokens, max_model_len, kv_capacity,
                                    param=param)  # fmt: skip
    if refusal is not None:
        raise refusal
    return max_tokens


def build_sampling_params(
    request: SamplingFields,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    kv_capacity: int | None = None,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> SamplingParams:
    """Validate the sampling fields against the model and build the engine's params; a
    field the request leaves out takes its value from `defaults`. `kv_capacity`: the KV
    cache's slots, which bound one request too where they are fewer than the context.
    `max_logprobs`: the engine's (--max-logprobs), checked here to name the API's field."""
    requested = request.requested_max_tokens  # type: ignore[attr-defined]
    room = max_model_len - num_prompt_tokens
    prompt_param = "messages" if hasattr(request, "messages") else "prompt"
    max_param = ("max_completion_tokens"  # chat's newer name, when that is what came
                 if getattr(request, "max_completion_tokens", None) is not None else "max_tokens")  # fmt: skip
    if room < 0:
        raise ContextLengthExceeded(
            f"the prompt is {num_prompt_tokens} tokens, longer than this model's context "
            f"length of {max_model_len} tokens",
            param=prompt_param,
        )
    if requested is None:
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt is {num_prompt_tokens} tokens, which leaves no room to generate "
                f"in this model's context length of {max_model_len} tokens",
                param=prompt_param,
            )
        max_tokens = defaults.max_tokens_for(None, room)
    else:
        # A prompt-only request (echo, max_tokens 0) needs no room: its one sampled token
        # is never shown, nor fed back.
        asked = 0 if getattr(request, "prompt_only", False) else requested
        if num_prompt_tokens + asked > max_model_len:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_model_len} tokens; the request "
                f"has {num_prompt_tokens} prompt tokens and asks for {asked} completion "
                f"tokens ({num_prompt_tokens + asked} in all)",
                param=max_param,
            )
        max_tokens = defaults.max_tokens_for(requested, room)
    if kv_capacity is not None and kv_capacity < max_model_len:
        max_tokens = _fit_kv_cache(max_tokens, num_prompt_tokens, kv_capacity, max_model_len,
                                   asked=requested is not None,
                                   param=max_param if requested is not None else prompt_param)  # fmt: skip
    if request.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
        )
    num_logprobs = request.num_logprobs  # type: ignore[attr-defined]
    for param in ("top_logprobs", "logprobs", "prompt_logprobs"):
        asked = getattr(request, param, None)
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > max_logprobs:
            raise InvalidRequest(
                f"{param} must be at most {max_logprobs} (the server's --max-logprobs), "
                f"got {asked}",
                param=param,
            )
    top_k = request.top_k if request.top_k is not None else defaults.top_k
    constraint = request.structured_output
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=0 if top_k < 0 else top_k,
        min_p=defaults.min_p if request.min_p is None else request.min_p,
        seed=request.seed,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=defaults.repetition_penalty
        if request.repetition_penalty is None
        else request.repetition_penalty,
        logprobs=num_logprobs,
        prompt_logprobs=request.num_prompt_logprobs,  # type: ignore[attr-defined]
        logit_bias=request.logit_bias_pairs,
        allowed_token_ids=None
        if request.allowed_token_ids is None
        else tuple(sorted(set(request.allowed_token_ids))),
        structured_output=msgspec.structs.replace(
            _grammar_verdicts.engine_spec(constraint[0]), param=constraint[1]
        )
        if constraint
        else None,
    )


def bad_word_token_ids(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences that `bad_words` ban: each word as it is tokenised at the start
    of a text and after a space (byte-level BPE writes the two differently), once each."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False).ids)
            if ids:
                sequences[ids] = None
    return tuple(sequences)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"token id {token_id} is outside the vocabulary", param=param)
