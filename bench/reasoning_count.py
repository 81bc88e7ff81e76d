"""Benchmark (not a test): the reasoning-token count of one long thinking answer (chat usage's
`completion_tokens_details.reasoning_tokens`), as the API process computes it when a choice
ends, beside reading every token's text alone (how it was counted before 2026-11-28).

    PYTHONPATH=. .venv/bin/python bench/reasoning_count.py [--repeats 2500]

The tiny tokenizer with <think> and </think> as tokens of their own (as Qwen3's); the answer
is "<think>" + a sentence --repeats times + "</think>" + an answer. Prints each way's time
and count (the counts must agree); both run on the event loop in the server.
"""

from __future__ import annotations

import argparse
import time

from tokenizers import AddedToken, Tokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_model import SIZES, train_tokenizer
from server.reasoning import THINK_END, THINK_START, ReasoningSplitter, count_reasoning_tokens


def count_token_by_token(tokenizer: Tokenizer, ids: list[int], *, opened: bool) -> int:
    """The count read from each token's own text, as the reasoning parser reads a stream
    (the definition `count_reasoning_tokens` keeps while decoding in chunks; also the
    oracle of tests/unit/test_reasoning.py)."""
    splitter, detokenizer, count = (
        ReasoningSplitter(opened=opened),
        IncrementalDetokenizer(tokenizer),
        0,
    )
    for token_id in ids:
        if not splitter.in_thinking:
            break
        text = detokenizer.step((token_id,))
        count += text not in (THINK_START, THINK_END)
        splitter.feed(text)
    return count if splitter.has_reasoning else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2500)
    args = parser.parse_args()
    tokenizer = train_tokenizer(SIZES["tiny"].bpe_vocab_size)
    tokenizer.add_tokens([AddedToken(THINK_START), AddedToken(THINK_END)])
    sentence = "Let me think about this carefully, step by step. é🎉 "
    text = THINK_START + sentence * args.repeats + THINK_END + "\n\nThe answer."
    ids = tokenizer.encode(text, add_special_tokens=False).ids

    def token_by_token() -> int:
        return count_token_by_token(tokenizer, ids, opened=False)

    def in_chunks() -> int:
        return count_reasoning_tokens(
            tokenizer, IncrementalDetokenizer(tokenizer), ids, opened=False
        )

    for name, count in [("token by token", token_by_token), ("in chunks", in_chunks)] * 2:
        started = time.perf_counter()
        result = count()
        elapsed = time.perf_counter() - started
        print(f"{name:>14}: {len(ids)} tokens, {result} reasoning, {elapsed * 1000:.1f} ms")


if __name__ == "__main__":
    main()
