"""Reasoning split from the answer (server/reasoning.py), whatever the chunking of the
stream: the same reasoning and content as the whole answer gives."""

from __future__ import annotations

import functools
import random

import pytest
from tokenizers import AddedToken, Tokenizer

from bench.reasoning_count import count_token_by_token
from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_model import SIZES, train_tokenizer
from server.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningSplitter,
    count_reasoning_tokens,
    prompt_opens_thinking,
    reasoning_format,
)

ANSWER = "<think>\nThe user wants a number < 10.\nSo 7.\n</think>\n\nSeven: 7 </thin"


def streamed(text: str, chunk: int, *, opened: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(opened=opened)
    reasoning = content = ""
    for start in range(0, len(text), chunk):
        r, c = splitter.feed(text[start : start + chunk])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        (ANSWER, False, ("\nThe user wants a number < 10.\nSo 7.\n", "Seven: 7 </thin")),
        ("  <think>a</think>b", False, ("a", "b")),  # blanks before <think> are dropped
        ("Plain answer <think> later", False, (None, "Plain answer <think> later")),
        ("<thin", False, (None, "<thin")),  # ended before it could be a tag
        ("<think>cut short by max_tokens </thi", False, ("cut short by max_tokens </thi", "")),
        ("already thinking</think>\n\nanswer", True, ("already thinking", "answer")),
        ("", False, (None, "")),
    ],
)
def test_streams_split_as_the_whole_answer(chunk, text, opened, expected):
    assert ReasoningSplitter(opened=opened).split(text) == expected
    reasoning, content = streamed(text, chunk, opened=opened)
    assert (reasoning, content) == (expected[0] or "", expected[1])


def test_no_partial_tag_goes_out_early():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>why</th") == ("why", "")
    assert splitter.feed("ink>") == ("", "")
    assert splitter.feed("\n\nso") == ("", "so")


def test_the_parser_in_effect():
    assert reasoning_format("auto", "{{ '<think>' }}") == "qwen3"
    assert reasoning_format("auto", "plain template") is None
    assert reasoning_format("none", "{{ '<think>' }}") is None
    assert reasoning_format("qwen3", None) == "qwen3"
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def marker_tokenizer() -> Tokenizer:
    """The tiny tokenizer with <think> and </think> as tokens of their own, as Qwen3's."""
    tokenizer = train_tokenizer(SIZES["tiny"].bpe_vocab_size)
    tokenizer.add_tokens([AddedToken(THINK_START), AddedToken(THINK_END)])
    return tokenizer


def counted(tokenizer: Tokenizer, pieces: list[str], *, opened: bool) -> int:
    ids = [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False).ids]
    return count_reasoning_tokens(tokenizer, IncrementalDetokenizer(tokenizer), ids, opened=opened)


@pytest.mark.parametrize("opened, pieces, expected", [
    (False, ["<think>", "a", " b", "</think>", "\n\n", "ans"], 2),
    (False, ["<think>", "</think>", "ans"], 0),  # an empty thinking is none (it was 2)
    (True, ["a", "</think>", "ans"], 1),  # the template opened it
    (False, ["plain", " answer"], 0),
    (True, ["a", " b"], 2),  # cut short inside the thinking
])  # fmt: skip
def test_reasoning_tokens_are_the_thinking_without_its_marker_tokens(
    marker_tokenizer, opened, pieces, expected
):
    assert counted(marker_tokenizer, pieces, opened=opened) == expected


def test_markers_spelled_by_several_tokens_are_thinking(marker_tokenizer):
    tokenizer = train_tokenizer(SIZES["tiny"].bpe_vocab_size)  # no marker tokens
    ids = tokenizer.encode("<think>a</think>x", add_special_tokens=False).ids
    closing = len(tokenizer.encode("</think>", add_special_tokens=False).ids)
    assert closing > 1
    expected = len(ids) - len(tokenizer.encode("x", add_special_tokens=False).ids)
    assert (
        count_reasoning_tokens(tokenizer, IncrementalDetokenizer(tokenizer), ids, opened=False)
        == expected
    )


@pytest.mark.parametrize("seed", range(40))
def test_counting_in_chunks_gives_each_tokens_own_count(marker_tokenizer, seed):
    """Long thinkings whose end falls anywhere around the chunk edges (a marker token, a
    </think> spelled over the edge, a character split between tokens), and answers that
    never close it, count as reading each token's text alone does."""
    rng = random.Random(seed)
    words = ["so", " the", " 7", "<", "/", "think", ">", "é", "🎉", "\n", "</thi", "nk>"]
    words += [THINK_START, THINK_END] * 2
    ids = marker_tokenizer.encode(
        "".join(rng.choice(words) for _ in range(rng.randrange(50, 700))), add_special_tokens=False
    ).ids
    opened = rng.random() < 0.5
    if not opened:
        ids = [marker_tokenizer.token_to_id(THINK_START), *ids]
    if seed % 3 == 0:  # cut inside a character: the text of the last chunk stays held
        ids += marker_tokenizer.encode("🎉", add_special_tokens=False).ids[:-1]
    expected = count_token_by_token(marker_tokenizer, ids, opened=opened)
    count = count_reasoning_tokens(
        marker_tokenizer, IncrementalDetokenizer(marker_tokenizer), ids, opened=opened
    )
    assert count == expected


@pytest.mark.parametrize("opened", [False, True])
def test_an_answer_cut_inside_a_character_is_counted_to_its_end(marker_tokenizer, opened):
    """The last chunk's text stayed held when the answer ended inside a character, and the
    </think> in it was never read: every token counted, or none (fuzz80)."""
    encode = functools.partial(marker_tokenizer.encode, add_special_tokens=False)
    ids = ([] if opened else encode(THINK_START).ids) + encode(" so" * 300).ids
    ids += encode(THINK_END + "ok 🎉").ids[:-1]
    count = count_reasoning_tokens(
        marker_tokenizer, IncrementalDetokenizer(marker_tokenizer), ids, opened=opened
    )
    expected = count_token_by_token(marker_tokenizer, ids, opened=opened)
    assert count == expected == len(encode(" so" * 300).ids)


def test_chunk_edges_are_read_exactly(marker_tokenizer):
    """The thinking closing on each token around the first chunk edge."""
    word = marker_tokenizer.encode(" so", add_special_tokens=False).ids
    end = marker_tokenizer.encode("</think>", add_special_tokens=False).ids
    for before in range(250, 262):
        ids = word * before + end + word * 5
        assert (
            count_reasoning_tokens(
                marker_tokenizer, IncrementalDetokenizer(marker_tokenizer), ids, opened=True
            )
            == count_token_by_token(marker_tokenizer, ids, opened=True)
            == before * len(word)
        )
