"""The tokens a sampling row may not pick at one step, beyond what its grammar and
`allowed_token_ids` allow: the last token of a bad word the sequence would complete, EOS
and stop tokens before `min_tokens`, EOS while a grammar waits for its marker; and the error
of a request whose constraints leave no token at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.protocol import ErrorInfo

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduler_output import ScheduledChunk


def banned_token_ids(chunk: ScheduledChunk) -> tuple[int, ...]:
    """The last tokens of bad words the sequence would complete, EOS and stop tokens while
    the token this chunk samples is one of the first `min_tokens` outputs, and EOS while a
    grammar waits for its marker (`structured_output_after`). Counted
    from the chunk's end, not from `output_token_ids`, which lags a token behind while the
    previous step's token is in flight (a request with bad words of several tokens is never
    scheduled while a token of it is in flight: `SamplingParams.needs_output_on_host`)."""
    request = chunk.request
    sampling = request.sampling
    banned = bad_word_ends(request, chunk.end) if sampling.bad_words_token_ids else ()
    eos = () if sampling.ignore_eos else request.eos_token_ids
    if chunk.end - request.num_prompt_tokens < sampling.min_tokens:
        # EOS even with ignore_eos, as vLLM and transformers' min_new_tokens ban it (fuzz103)
        return (*banned, *request.eos_token_ids, *sampling.stop_token_ids)
    if sampling.structured_output is not None and not request.grammar_active:
        # A grammar that holds after a marker (a thinking model's </think>): an answer
        # that ended before it would have nothing in the format the request asked for.
        return (*banned, *eos)
    return banned


def no_token_left(request: Request) -> ErrorInfo:
    """The error of a request whose constraints exclude every token at its next pick
    (`leaves_no_token`): a grammar or `allowed_token_ids`, less bad words, and EOS and stop
    tokens before `min_tokens`. Most such sets are refused on arrival
    (engine/request_checks.py); these depend on the tokens written so far."""
    sampling = request.sampling
    spec = sampling.structured_output
    if spec is not None:
        param = spec.param
    elif sampling.allowed_token_ids is not None:
        param = "allowed_token_ids"
    elif request.num_output_tokens < sampling.min_tokens:
        param = "min_tokens"  # EOS and stop tokens banned, with the bad words the rest
    else:
        param = "bad_words"
    return ErrorInfo(
        f"no token is left to pick at output position {request.num_output_tokens}: the "
        "request's constraints (allowed_token_ids or its structured output, less bad_words, "
        "and EOS and stop tokens before min_tokens) exclude every token",
        param=param,
        code="invalid_value",
    )


def bad_word_ends(request: Request, end: int) -> tuple[int, ...]:
    """The last token of each bad word whose other tokens are the sequence's last ones
    before index `end` (prompt and output alike, as transformers' `bad_words_ids`)."""
    banned = []
    for word in request.sampling.bad_words_token_ids:
        head = list(word[:-1])
        if len(head) <= end and request.token_ids_between(end - len(head), end) == head:
            banned.append(word[-1])
    return tuple(banned)
