"""Engine logprobs (token ids) to OpenAI's logprobs shapes (token strings and bytes)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from engine.protocol import TokenLogprob
from server.detokenizer import token_bytes
from server.openai_models import (
    ChoiceLogprobs,
    CompletionLogprobs,
    TokenLogprobInfo,
    TopLogprob,
)


def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = token_bytes(tokenizer, token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> ChoiceLogprobs:
    """`logprobs.content[{token, logprob, bytes, top_logprobs[...]}]` of a chat choice."""
    content = []
    for entry in entries:
        token, raw = _token_text(tokenizer, entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            top_token, top_raw = _token_text(tokenizer, token_id)
            top.append(TopLogprob(token=top_token, logprob=logprob, bytes=top_raw))
        content.append(
            TokenLogprobInfo(token=token, logprob=entry.logprob, bytes=raw, top_logprobs=top)
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprob], text_offset: int = 0
) -> CompletionLogprobs:
    """The legacy `/v1/completions` logprobs shape (parallel lists)."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry in entries:
        token, _ = _token_text(tokenizer, entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({_token_text(tokenizer, tid)[0]: lp for tid, lp in entry.top})
        result.text_offset.append(offset)
        offset += len(token)
    return result
