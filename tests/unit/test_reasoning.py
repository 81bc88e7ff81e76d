"""Reasoning split from the answer (server/reasoning.py), whatever the chunking of the
stream: the same reasoning and content as the whole answer gives."""

from __future__ import annotations

import pytest

from server.reasoning import (
    ReasoningSplitter,
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


@pytest.mark.parametrize("opened, texts, expected", [
    (False, ["<think>", "a", " b", "</think>", "\n\n", "ans"], 2),
    (False, ["<think>", "</think>", "ans"], 0),  # an empty thinking is none (it was 2)
    (True, ["a", "</think>", "ans"], 1),  # the template opened it
    (False, ["<th", "ink>", "a", "</think>x"], 4),  # markers split over tokens count
    (False, ["plain", " answer"], 0),
    (True, ["cut", " short"], 2),
])  # fmt: skip
def test_reasoning_tokens_are_the_thinking_without_its_marker_tokens(opened, texts, expected):
    assert ReasoningSplitter(opened=opened).count_reasoning_tokens(texts) == expected
