"""Reasoning ("thinking") split from the answer, as Qwen3 models write it:

    <think>
    The user asks ... so ...
    </think>

    The answer.

With `--reasoning-parser qwen3` (or "auto", the default, when the chat template mentions
<think>) a chat answer's text between <think> and </think> becomes `reasoning_content`
(vLLM's and DeepSeek's field) and only what follows </think> is `content`, where tool calls
are looked for. Reasoning starts at a <think> that opens the answer, or at once when the
prompt itself ends in <think> (templates that open the thinking for the model); an answer
cut short before </think> is all reasoning. Without a <think> the whole answer is content.

`ReasoningSplitter` works on a stream: `feed` returns the reasoning and content that may go
out now (a tail that could begin a tag is held back until it cannot), `finish` the rest.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal

from tokenizers import Tokenizer

from engine.detokenizer import IncrementalDetokenizer
from server.tool_calls import partial_prefix_length

REASONING_PARSERS = ("auto", "none", "qwen3")
THINK_START = "<think>"
THINK_END = "</think>"
# Tokens `count_reasoning_tokens` decodes together; only the stretch where the thinking
# ends is decoded again a token at a time.
_COUNT_CHUNK = 256


def reasoning_format(parser: str, chat_template: str | None) -> str | None:
    """The parser in effect: "qwen3", or None for plain answers ("auto": qwen3 when the
    chat template writes <think>)."""
    if parser == "auto":
        return "qwen3" if THINK_START in (chat_template or "") else None
    return None if parser == "none" else parser


def prompt_opens_thinking(prompt_text_tail: str) -> bool:
    """The rendered prompt ends inside an open <think> (the answer starts as reasoning)."""
    return prompt_text_tail.rstrip().endswith(THINK_START)


def prefill_opens_thinking(final_message: str) -> bool:
    """A prefilled answer (`continue_final_message`) that opened its thinking and has not
    closed it: what the model writes next is reasoning up to its </think>, as vLLM's
    parser splits it."""
    return final_message.rfind(THINK_START) > final_message.rfind(THINK_END)


class ReasoningSplitter:
    """One choice's text, split into reasoning and content as it streams."""

    def __init__(self, *, opened: bool = False) -> None:
        self._state: Literal["start", "reasoning", "after", "content"] = (
            "reasoning" if opened else "start"
        )
        self._held = ""
        self.has_reasoning = opened

    def feed(self, text: str, *, last: bool = False) -> tuple[str, str]:
        """(reasoning, content) that may go out now; with `last` (the answer's end), all
        that is held too."""
        reasoning, content = self._feed(text)
        if last:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        while True:
            held = self._held
            if self._state == "start":
                stripped = held.lstrip()
                if not stripped or (THINK_START.startswith(stripped) and stripped != THINK_START):
                    return reasoning, content  # could still open with <think>
                if stripped.startswith(THINK_START):
                    self._state, self.has_reasoning = "reasoning", True
                    self._held = stripped[len(THINK_START) :]
                else:
                    self._state = "content"
                continue
            if self._state == "reasoning":
                end = held.find(THINK_END)
                if end < 0:
                    keep = partial_prefix_length(held, THINK_END)
                    reasoning += held[: len(held) - keep]
                    self._held = held[len(held) - keep :]
                    return reasoning, content
                reasoning += held[:end]
                self._state, self._held = "after", held[end + len(THINK_END) :]
                continue
            if self._state == "after":  # the blank lines between </think> and the answer
                stripped = held.lstrip("\r\n")
                if not stripped:
                    self._held = ""
                    return reasoning, content
                self._state, self._held = "content", stripped
                continue
            content += held
            self._held = ""
            return reasoning, content

    @property
    def in_answer(self) -> bool:
        """Whether text fed now is the answer's: past the thinking and the blank lines
        after it, or in an answer that never opened any."""
        return self._state == "content"

    @property
    def in_thinking(self) -> bool:
        """Whether the text fed next is still the thinking's (or may open it): a token fed
        then is a reasoning token, if the answer has reasoning at all."""
        return self._state in ("start", "reasoning")

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the answer: reasoning when cut short inside it."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held if self._state in ("start", "content") else ""

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer's (reasoning or None, content)."""
        reasoning, content = self.feed(text, last=True)
        return (reasoning if self.has_reasoning else None), content


def count_reasoning_tokens(
    tokenizer: Tokenizer,
    detokenizer: IncrementalDetokenizer,
    token_ids: Sequence[int],
    *,
    opened: bool,
) -> int:
    """How many of an answer's tokens are its reasoning: those up to and including the one
    whose text ends </think>, all of them if it never comes; 0 for an answer that does not
    open with the thinking. A token that is a marker itself (Qwen3's <think> and </think>
    are one token each) is not thinking, as vLLM counts between them: `<think></think>` is
    0, not 2. `detokenizer` stands where the answer begins.

    The text is decoded a chunk of tokens at a time, and only the chunk in which the
    thinking ends is decoded again token by token, from where it began: decoding every
    token alone held the event loop ~3-4 us a token (0.19-0.24 s for 57,500 thinking
    tokens, against 26-34 ms in chunks).
    """
    splitter = ReasoningSplitter(opened=opened)
    length = 0  # tokens read while the thinking was still open
    # Where to read again from: a place where no token's text was held back (a character
    # begun, not finished), as the thinking may end in the text held.
    again = (detokenizer.mark(), copy.copy(splitter), 0)
    while length < len(token_ids):
        if not detokenizer.is_holding:
            again = (detokenizer.mark(), copy.copy(splitter), length)
        chunk = token_ids[length : length + _COUNT_CHUNK]
        splitter.feed(detokenizer.step(chunk))
        # The last chunk's text may stay held (an answer cut inside a character), and a
        # </think> in it with it (fuzz80): that chunk is read token by token too.
        held_at_the_end = length + len(chunk) == len(token_ids) and detokenizer.is_holding
        if splitter.in_thinking and not held_at_the_end:
            length += len(chunk)
            continue
        mark, splitter, length = again
        detokenizer.rewind(mark)
        for token_id in token_ids[length:]:
            if not splitter.in_thinking:
                break
            length += 1
            splitter.feed(detokenizer.step((token_id,)))
        break
    if not splitter.has_reasoning:
        return 0
    markers = {tokenizer.token_to_id(marker) for marker in (THINK_START, THINK_END)}
    return length - sum(token_id in markers for token_id in token_ids[:length])
