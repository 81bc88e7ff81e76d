"""Incremental detokenisation and stop strings, one sequence at a time.

The engine sends token ids; the server turns them into text deltas here. Two rules:

* Never emit U+FFFD for a character whose UTF-8 bytes are split across tokens that have
  not all arrived yet. We decode a small window of recent tokens twice (with and without
  the newest ones, the "prefix/read offsets" technique) and hold the delta back while the
  window's text ends in an incomplete sequence. `finish()` flushes whatever is held.
* Never emit text that could be the start of a stop string. The last
  `len(longest stop) - 1` characters that might begin a stop string stay held back until
  the next delta shows they do not; a stop string found is cut with everything after it.

```
 token ids  ─▶ IncrementalDetokenizer.step() ─▶ text delta ─▶ StopChecker.feed() ─▶ safe text
```

It lives in engine/ although the engine process never detokenises: both the server (its
streams) and the offline `LLM` (engine/llm.py) turn token ids into text here, so that the
same request gets the same text on either path, and engine/ never imports server/. It is
pure text code (the `tokenizers` library; no torch, no engine state), as engine/multimodal/
is the preprocessing both sides share.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# How many tokens before the newest ones are decoded again for context: a byte-level BPE
# character spans at most 4 tokens, and surrounding tokens fix leading-space handling.
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, safe for multi-byte UTF-8.

    `prompt_token_ids` (optional) gives decoding context for the first generated tokens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._token_ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0  # window start: tokens decoded again for context
        # Tokens before this are already emitted. A prompt that ends inside a character
        # leaves that character's first bytes unread: the completion that finishes it
        # begins with it, rather than losing it (vLLM's decode stream keeps it too).
        self._read_offset = len(context) - self._unfinished_tail(context)
        # Its U+FFFD, dropped from the first text if no character came of it (the prompt's).
        self._unfinished_prompt_text = self._decode(context[self._read_offset :])

    def _unfinished_tail(self, ids: Sequence[int]) -> int:
        """How many of the last `ids` are the first bytes of a character still open."""
        if not ids or not self._decode(ids).endswith(REPLACEMENT_CHAR):
            return 0
        for tail in range(1, min(4, len(ids)) + 1):  # UTF-8: at most 3 lead bytes
            if not self._decode(ids[: len(ids) - tail]).endswith(REPLACEMENT_CHAR):
                return tail
        return 0

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens and return the text that became certain (possibly "")."""
        self._token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete UTF-8 sequence (or a skipped special token): wait
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return self._without_prompt_bytes(full_text[len(prefix_text) :])

    def _without_prompt_bytes(self, text: str) -> str:
        unfinished, self._unfinished_prompt_text = self._unfinished_prompt_text, ""
        return text.removeprefix(unfinished) if unfinished else text

    @property
    def is_holding(self) -> bool:
        """Whether tokens wait for text (the start of a character; a skipped special token)."""
        return len(self._token_ids) > self._read_offset

    def text_alone(self, token_id: int) -> str:
        """One token's text decoded by itself."""
        return self._decode((token_id,))

    def mark(self) -> tuple[int, int, int, str]:
        """Where the detokenizer stands now, for `rewind`."""
        return (len(self._token_ids), self._prefix_offset, self._read_offset,
                self._unfinished_prompt_text)  # fmt: skip

    def rewind(self, mark: tuple[int, int, int, str]) -> None:
        """Back to where `mark` was taken: the tokens stepped since are forgotten, and
        stepping them again gives their text again."""
        length, self._prefix_offset, self._read_offset, self._unfinished_prompt_text = mark
        del self._token_ids[length:]

    def finish(self) -> str:
        """Flush held-back text at the end of the sequence (may contain U+FFFD if the
        model really produced invalid UTF-8)."""
        if len(self._token_ids) == self._num_context:
            return ""  # nothing generated: a prompt's unfinished character stays its own
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        if len(full_text) <= len(prefix_text):
            return ""
        return self._without_prompt_bytes(full_text[len(prefix_text) :])


@dataclass
class StopResult:
    """What `StopChecker.feed` decided: `text` is safe to emit; `is_stopped` means a stop
    string was hit (and cut) and the sequence must finish with reason "stop"."""

    text: str
    is_stopped: bool = False


class StopChecker:
    """Finds stop strings in streamed text and holds back possible partial matches.

    The text is cut before the stop string, or after it with `include_stop` (vLLM's
    `include_stop_str_in_output`); `matched` is the stop string found (vLLM's
    `stop_reason`)."""

    def __init__(self, stop: Sequence[str] = (), *, include_stop: bool = False):
        self._stops = [s for s in stop if s]
        self.include_stop = include_stop
        self._pending = ""  # text received but not yet released
        # How much of `_pending` is text no stop string may end in: looked at already (a
        # stop ending in it was found then), or passed over by `hold` (min_tokens).
        self._checked_from = 0
        self.matched: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.matched is not None

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> StopResult:
        if self.is_stopped:
            return StopResult("", True)
        if not self._stops:
            return StopResult(delta)
        text = self._pending + delta
        found = _first_stop(text, self._stops, must_end_after=self._checked_from)
        if found is not None:
            start, self.matched = found
            self._pending = ""
            cut = start + len(self.matched) if self.include_stop else start
            return StopResult(text[:cut], True)
        hold = _longest_partial_suffix(text, self._stops)
        self._pending = text[len(text) - hold :] if hold else ""
        self._checked_from = len(self._pending)
        return StopResult(text[: len(text) - hold])

    def hold(self, delta: str) -> str:
        """Text no stop string may end in (vLLM's `min_tokens`): released unchecked, but
        what could begin a stop string is held back, for a stop string that begins in it
        and ends in a later `feed`."""
        if not self._stops:
            return delta
        text = self._pending + delta
        hold = _longest_partial_suffix(text, self._stops)
        self._pending = text[len(text) - hold :] if hold else ""
        self._checked_from = len(self._pending)
        return text[: len(text) - hold]

    def flush(self) -> str:
        """Release held text at the end of the sequence (no stop string followed)."""
        text, self._pending = self._pending, ""
        return "" if self.is_stopped else text


def _first_stop(text: str, stops: Sequence[str], must_end_after: int = 0) -> tuple[int, str] | None:
    """(where, which) of the stop string that starts first in `text` and ends after
    `must_end_after` characters (of two that start together, the shorter: it ends first)."""
    found = [
        (i, len(stop), stop)
        for stop in stops
        if (i := text.find(stop, max(0, must_end_after - len(stop) + 1))) >= 0
    ]
    if not found:
        return None
    start, _, stop = min(found)
    return start, stop


def _longest_partial_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best


class SequenceDetokenizer:
    """Detokenizer + stop checker for one output sequence; also keeps the full text.

    A stop string must end in the text of a token after the first `min_tokens`, and may
    begin in theirs (as vLLM's): their text goes out unchecked, less what could begin a
    stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
        track_offsets: bool = False,
    ):
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._stop = StopChecker(stop, include_stop=include_stop)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self.text = ""
        # With `track_offsets`: where each token's text starts in the sequence's text (a
        # special token left out, or the first bytes of a character a later token ends,
        # add nothing), counted before stop strings hold text back.
        self.text_offsets: list[int] | None = [] if track_offsets else None
        self._num_decoded_chars = 0

    @property
    def is_stopped(self) -> bool:
        return self._stop.is_stopped

    @property
    def matched_stop(self) -> str | None:
        return self._stop.matched

    @property
    def include_stop(self) -> bool:
        """Whether the text keeps what stopped it (`include_stop_str_in_output`)."""
        return self._stop.include_stop

    def step(self, new_token_ids: Sequence[int]) -> str:
        self._num_tokens += len(new_token_ids)
        delta = self._detokenizer.step(new_token_ids)
        self._num_decoded_chars += len(delta)
        text = self._release(delta)
        self.text += text
        return text

    def _release(self, delta: str) -> str:
        """`delta` through the stop checker: no stop string may end within the first
        `min_tokens` tokens' text."""
        if self._num_tokens <= self._min_tokens:
            return self._stop.hold(delta)
        return self._stop.feed(delta).text

    def step_until_stop(self, new_token_ids: Sequence[int]) -> tuple[str, int]:
        """`step`, and how many of `new_token_ids` it took: with stop strings, tokens go
        in one by one and those after the one that completes a stop string are left out
        (they are no part of the answer: not counted, no logprobs). With `track_offsets`
        every token goes in alone, its offset noted first."""
        if self.text_offsets is None and (not self._stop.has_stops or len(new_token_ids) < 2):
            return self.step(new_token_ids), len(new_token_ids)
        text = ""
        for taken, token_id in enumerate(new_token_ids, start=1):
            text += self._step_one(token_id)
            if self.is_stopped:
                return text, taken
        return text, len(new_token_ids)

    def _step_one(self, token_id: int) -> str:
        """`step` with one token, noting its offset with `track_offsets`: where the text
        so far ends, or, when its text comes out with held-back text (bytes that turned
        out to be no character), the end of that held text."""
        if self.text_offsets is None:
            return self.step((token_id,))
        start, held = self._num_decoded_chars, self._detokenizer.is_holding
        text = self.step((token_id,))
        if held:
            released = self._num_decoded_chars - start
            start += max(0, released - len(self._detokenizer.text_alone(token_id)))
        self.text_offsets.append(start)
        return text

    def note_token_offset(self) -> None:
        """With `track_offsets`, note where the next token's text starts (also for a token
        that is counted but not decoded: a stop token left out of the text)."""
        if self.text_offsets is not None:
            self.text_offsets.append(self._num_decoded_chars)

    def finish(self) -> str:
        """Flush all held text; call once when the engine reports the sequence finished."""
        if self._stop.is_stopped:
            return ""
        # Text held back for an unfinished character is the last token's: min_tokens holds.
        tail = self._release(self._detokenizer.finish()) + self._stop.flush()
        self.text += tail
        return tail


# GPT-2 byte-level alphabet: printable stand-ins for the 256 byte values.
def _byte_decoder() -> dict[str, int]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


_BYTE_DECODER = _byte_decoder()


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_METASPACE = "\u2581"  # SentencePiece's "▁": a space


@functools.lru_cache(maxsize=16)
def _vocabulary_scheme(tokenizer: Tokenizer) -> tuple[str, frozenset[int]]:
    """How `tokenizer`'s pieces spell bytes, read from its decoder: "byte_level" (GPT-2's
    alphabet: Qwen, Llama 3), "metaspace" (SentencePiece: "▁" a space, "<0xE9>" one byte:
    Llama 2, Mistral) or "plain"; and its added tokens, stored as plain text in any."""
    decoder = tokenizer.decoder
    state = decoder.__getstate__().decode("utf-8") if decoder is not None else ""
    if '"ByteLevel"' in state:
        scheme = "byte_level"
    elif '"ByteFallback"' in state or '"Metaspace"' in state or _METASPACE in state:
        scheme = "metaspace"
    else:
        scheme = "plain"
    return scheme, frozenset(tokenizer.get_added_tokens_decoder())


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The raw bytes one token stands for, for OpenAI `logprobs.bytes`: concatenated over
    an answer's tokens, the UTF-8 of its text."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    scheme, added = _vocabulary_scheme(tokenizer)
    if token_id in added:
        return piece.encode("utf-8")
    if scheme == "byte_level" and all(ch in _BYTE_DECODER for ch in piece):
        return bytes(_BYTE_DECODER[ch] for ch in piece)
    if scheme == "metaspace":
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace(_METASPACE, " ").encode("utf-8")
    return piece.encode("utf-8")
