"""Engine logprobs (token ids) to OpenAI's logprobs shapes (token strings and bytes)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from engine.detokenizer import SequenceDetokenizer, token_bytes
from engine.protocol import TokenLogprob
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


def _legacy_token_name(tokenizer: Tokenizer, token_id: int, as_id: bool) -> str:
    """A legacy completions logprobs token: its text, or, for a token whose bytes are not
    whole UTF-8 characters, "bytes:\\xNN..." as OpenAI's legacy API names it (fuzz103: as
    U+FFFD, such tokens shared one key of a `top_logprobs` dict and all but one were lost;
    the legacy shape has no `bytes` field to tell them apart)."""
    text, raw = _token_name(tokenizer, token_id, as_id)
    if as_id or "\ufffd" not in text:
        return text
    try:
        return bytes(raw).decode("utf-8")  # a real U+FFFD in the vocabulary
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


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
    text_offsets: Sequence[int],
    *,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The legacy `/v1/completions` logprobs shape (parallel lists). `text_offsets`, one
    per entry, is where each token's text starts in the returned text (the detokenizer's
    `SequenceDetokenizer.text_offsets`, or `echoed_text_offsets`), also when the tokens
    are named by id. Each `top_logprobs` entry holds the chosen token first, then its
    alternatives: "up to logprobs+1 elements" (OpenAI's legacy API; vLLM does the same),
    so `logprobs: 0` still names the chosen token there."""
    result = CompletionLogprobs(text_offset=list(text_offsets))
    for entry in entries:
        name = _legacy_token_name(tokenizer, entry.token_id, as_ids)
        result.tokens.append(name)
        result.token_logprobs.append(entry.logprob)
        top = {name: entry.logprob}
        for token_id, logprob in entry.top:  # a name two tokens share keeps the first's
            top.setdefault(_legacy_token_name(tokenizer, token_id, as_ids), logprob)
        result.top_logprobs.append(top)
    return result


def echoed_text_offsets(tokenizer: Tokenizer, token_ids: Sequence[int], echoed: str) -> list[int]:
    """Where each prompt token's text starts in `echoed`, the prompt's text as the answer
    echoes it. Where `echoed` tokenises to these very tokens, the tokenizer's own offsets
    into it say (a BOS it added at 0; a character its normalizer changed, NFC's "e" +
    U+0301, mapped back). Else the tokens are decoded one by one as generated ones are
    (special tokens shown); tokens the tokenizer added that the prompt string lacks (a
    BOS before it, an EOS after it) take no room: their offsets are the echo's start or
    end."""
    for with_special_tokens in (True, False):
        encoding = tokenizer.encode(echoed, add_special_tokens=with_special_tokens)
        if encoding.ids == list(token_ids):
            return [start for start, _ in encoding.offsets]
    detokenizer = SequenceDetokenizer(tokenizer, skip_special_tokens=False, track_offsets=True)
    detokenizer.step_until_stop(token_ids)
    decoded = detokenizer.text + detokenizer.finish()
    offsets = detokenizer.text_offsets or []
    if decoded != echoed and decoded.endswith(echoed):
        added = len(decoded) - len(echoed)
        offsets = [max(0, offset - added) for offset in offsets]
    return [min(offset, len(echoed)) for offset in offsets]


def prompt_logprobs(
    tokenizer: Tokenizer, scores: Sequence[TokenLogprob], num_top: int | None = None
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token
    {token id: {logprob, rank, decoded_token}} for the prompt's token and its alternatives
    (ranked 1.. by likelihood; the first `num_top` of the scores' own, if given)."""
    result: list[dict[str, PromptLogprob] | None] = [None]
    for score in scores:
        entry = {}
        for rank, (token_id, logprob) in enumerate(score.top[:num_top], start=1):
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
    echoed: str,
    *,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The legacy logprobs of an echoed prompt (`num_top` alternatives each), whose text
    is `echoed`: its first token has no logprob (None)."""
    entries = [TokenLogprob(prompt_token_ids[0], 0.0)]
    entries += [TokenLogprob(s.token_id, s.logprob, s.top[:num_top]) for s in scores]
    offsets = echoed_text_offsets(tokenizer, prompt_token_ids, echoed)
    result = completion_logprobs(tokenizer, entries, offsets, as_ids=as_ids)
    result.token_logprobs[0] = None
    result.top_logprobs[0] = None
    return result
