"""Engine logprobs (token ids) to OpenAI's logprobs shapes (token strings and bytes)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokenizers import Tokenizer

from engine.protocol import TokenLogprob
from server.detokenizer import token_bytes
from server.openai_replies import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprobInfo,
    TopLogprob,
)


def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = token_bytes(tokenizer, token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _token_name(tokenizer: Tokenizer, token_id: int, as_id: bool) -> tuple[str, list[int]]:
    """A logprob entry's `token` and `bytes`. With vLLM's `return_tokens_as_token_ids` the
    token is "token_id:{id}", which names a token whose bytes are not whole UTF-8
    characters; `bytes` stay the token's own."""
    text, raw = _token_text(tokenizer, token_id)
    return (f"token_id:{token_id}" if as_id else text), raw


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprob], *, as_ids: bool = False
) -> ChoiceLogprobs:
    """`logprobs.content[{token, logprob, bytes, top_logprobs[...]}]` of a chat choice."""
    content = []
    for entry in entries:
        token, raw = _token_name(tokenizer, entry.token_id, as_ids)
        top = []
        for token_id, logprob in entry.top:
            top_token, top_raw = _token_name(tokenizer, token_id, as_ids)
            top.append(TopLogprob(token=top_token, logprob=logprob, bytes=top_raw))
        content.append(
            TokenLogprobInfo(token=token, logprob=entry.logprob, bytes=raw, top_logprobs=top)
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: Tokenizer,
    entries: Sequence[TokenLogprob],
    text_offset: int = 0,
    *,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The legacy `/v1/completions` logprobs shape (parallel lists); `text_offset` counts
    the tokens' text even when they are named by id. A token that ends inside a UTF-8
    character adds nothing to the offset until a later one completes the character (the
    tokens of one character share its offset), so offsets index the returned text."""
    result = CompletionLogprobs()
    offset = text_offset
    characters = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for entry in entries:
        name, raw = _token_name(tokenizer, entry.token_id, as_ids)
        result.tokens.append(name)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(
            {_token_name(tokenizer, tid, as_ids)[0]: lp for tid, lp in entry.top}
        )
        result.text_offset.append(offset)
        offset += len(characters.decode(bytes(raw)))
    return result


def prompt_logprobs(
    tokenizer: Tokenizer, scores: Sequence[TokenLogprob]
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token
    {token id: {logprob, rank, decoded_token}} for the prompt's token and its alternatives
    (ranked 1.. by likelihood)."""
    result: list[dict[str, PromptLogprob] | None] = [None]
    for score in scores:
        entry = {}
        for rank, (token_id, logprob) in enumerate(score.top, start=1):
            text = _token_text(tokenizer, token_id)[0]
            entry[str(token_id)] = PromptLogprob(logprob=logprob, rank=rank, decoded_token=text)
        text = _token_text(tokenizer, score.token_id)[0]
        entry[str(score.token_id)] = PromptLogprob(
            logprob=score.logprob, rank=score.rank, decoded_token=text
        )
        result.append(entry)
    return result


def prompt_logprobs_json(entries: Sequence[dict[str, PromptLogprob] | None]) -> list:
    """`prompt_logprobs`' entries as plain JSON values, for a stream's chunk."""
    return [
        None if entry is None else {key: value.model_dump() for key, value in entry.items()}
        for entry in entries
    ]


def echoed_prompt_logprobs(
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    scores: Sequence[TokenLogprob],
    num_top: int,
    *,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The legacy logprobs of an echoed prompt (`num_top` alternatives each): its first
    token has no logprob (None)."""
    entries = [TokenLogprob(prompt_token_ids[0], 0.0)]
    entries += [TokenLogprob(s.token_id, s.logprob, s.top[:num_top]) for s in scores]
    result = completion_logprobs(tokenizer, entries, as_ids=as_ids)
    result.token_logprobs[0] = None
    result.top_logprobs[0] = None
    return result
