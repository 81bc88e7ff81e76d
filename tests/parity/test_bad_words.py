"""Bad words (vLLM's `bad_words`, as token sequences): the last token of a sequence is
banned wherever its other tokens end the text so far. Against transformers'
`bad_words_ids`: the same greedy tokens, with overlap scheduling on (a request with a bad
word of several tokens is not launched ahead, so its bans see the newest token)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import hf_text_tokens  # noqa: E402

PROMPT = "the quick brown fox"
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bad_words"), seed=0)


def hf_tokens(model_dir, bad_words: list[list[int]]) -> list[int]:
    return hf_text_tokens(model_dir, PROMPT, max_new_tokens=NUM_TOKENS,
                          min_new_tokens=NUM_TOKENS, bad_words_ids=bad_words)  # fmt: skip


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **extra)


@pytest.mark.parametrize("overlap", [False, True])
def test_bad_words_as_in_transformers(model_dir, overlap):
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        llm.engine.overlaps_steps = overlap
        [free] = llm.generate([PROMPT], greedy())
        tokens = free.token_ids
        cases = [
            [[tokens[1]]],  # one token: never picked
            [[tokens[3], tokens[4]]],  # two: the second never follows the first
            [[tokens[0], tokens[1], tokens[2]], [tokens[6]]],
        ]
        results = llm.generate([PROMPT] * len(cases),
                               [greedy(bad_words_token_ids=tuple(map(tuple, words)))
                                for words in cases])  # fmt: skip
    for words, result in zip(cases, results, strict=True):
        assert result.error is None
        assert result.token_ids != tokens
        assert result.token_ids == hf_tokens(model_dir, words), words


def test_a_bad_word_that_the_prompt_begins_is_not_finished(model_dir):
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        prompt = llm.prompt_processor.encode_prompt(PROMPT)
        [free] = llm.generate([prompt], greedy())
        word = (prompt[-1], free.token_ids[0])  # the prompt's last token, then the first pick
        banned, bad = llm.generate(
            [prompt, prompt], [greedy(bad_words_token_ids=(word,)),
                               greedy(bad_words_token_ids=((),))]
        )  # fmt: skip
    assert banned.token_ids[0] != free.token_ids[0]
    assert banned.token_ids == hf_tokens(model_dir, [list(word)])
    assert bad.error is not None and bad.error.param == "bad_words"
