"""`allowed_token_ids` (vLLM's sampling field): every pick is among those tokens. Against
transformers' `prefix_allowed_tokens_fn` giving the same set at every step: the same greedy
tokens, whole and chunked; a random pick never leaves the set; with a grammar, only the
tokens both allow."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from engine import LLM, SamplingParams, StructuredOutput  # noqa: E402
from engine.sampler import Sampler, SamplingRow, leaves_no_token, token_bitmask  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import hf_text_tokens  # noqa: E402

PROMPT = "the quick brown fox"
ALLOWED = (5, 17, 99, 230, 231, 1000, 1500)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("allowed"), seed=0)


def hf_tokens(model_dir, prompt: str, allowed: tuple[int, ...]) -> list[int]:
    return hf_text_tokens(model_dir, prompt, max_new_tokens=10, min_new_tokens=10,
                          prefix_allowed_tokens_fn=lambda batch, so_far: list(allowed))  # fmt: skip


@pytest.mark.parametrize("budget", [2048, 3])  # 3: the prompt arrives in chunks
def test_greedy_picks_among_the_allowed_tokens_as_transformers(model_dir, budget):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), num_kv_blocks=64, max_num_batched_tokens=budget) as llm:
        free, allowed, sampled = llm.generate(
            [PROMPT] * 3,
            [
                greedy,
                SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                               allowed_token_ids=ALLOWED),
                SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True,
                               allowed_token_ids=ALLOWED[:3]),
            ],
        )  # fmt: skip
    assert allowed.token_ids == hf_tokens(model_dir, PROMPT, ALLOWED)
    assert set(free.token_ids) - set(ALLOWED)  # the set changed something
    assert set(sampled.token_ids) <= set(ALLOWED[:3]) and len(set(sampled.token_ids)) > 1


def test_with_a_grammar_only_tokens_both_allow(model_dir):
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        tokenizer = llm.prompt_processor.tokenizer
        digits = [tokenizer.token_to_id(d) for d in "0123456789"]
        eos = llm.engine.model_config.eos_token_ids[0]
        allowed = (*digits[:3], eos, *range(1000, 1100))  # only 0, 1, 2 of the digits
        [result] = llm.generate(
            [PROMPT],
            SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=allowed,
                           structured_output=StructuredOutput(regex="[0-9]{6}")),
        )  # fmt: skip
    assert result.error is None
    assert len(result.text) == 6 and set(result.text) <= set("012")


def test_bad_allowed_token_ids_fail_only_their_request(model_dir):
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        vocab = llm.engine.model_config.vocab_size
        empty, outside, fine = llm.generate(
            [PROMPT] * 3,
            [SamplingParams(max_tokens=2, allowed_token_ids=()),
             SamplingParams(max_tokens=2, allowed_token_ids=(1, vocab)),
             SamplingParams(max_tokens=2, allowed_token_ids=(vocab - 1,), ignore_eos=True)],
        )  # fmt: skip
    assert empty.error.param == outside.error.param == "allowed_token_ids"
    assert fine.error is None and fine.token_ids == [vocab - 1] * 2


def test_allowed_token_ids_that_the_requests_own_bans_empty_fail_only_their_request(model_dir):
    """Every allowed token a bad word, or only EOS and stop tokens allowed before min_tokens:
    every logit was -inf and the sampler drew id 0, a token the request did not allow."""
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        eos = llm.engine.model_config.eos_token_ids[0]
        bad, ends, stops, ignored, fine = llm.generate(
            [PROMPT] * 5,
            [SamplingParams(max_tokens=4, allowed_token_ids=(794,), bad_words_token_ids=((794,),)),
             SamplingParams(max_tokens=8, min_tokens=4, allowed_token_ids=(eos,)),
             SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True, stop_token_ids=(17,),
                            allowed_token_ids=(17,)),
             SamplingParams(max_tokens=8, min_tokens=4, ignore_eos=True, allowed_token_ids=(eos,)),
             SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=(eos,),
                            bad_words_token_ids=((5, 794),))],
        )  # fmt: skip
    assert bad.error.param == "bad_words" and ends.error.param == stops.error.param == "min_tokens"
    assert "min_tokens (4)" in ends.error.message
    # min_tokens bans EOS with ignore_eos too, as vLLM does (fuzz103: it let EOS through)
    assert ignored.error.param == "min_tokens"
    # a bad word of two tokens bans only after its first
    assert fine.error is None and fine.token_ids == [eos] * 8


def test_the_bitmask_allows_exactly_its_tokens():
    vocab = 70  # three words; ids 31, 32 and 63 sit on word edges (the int32 sign bit)
    ids = [0, 31, 32, 63, 69]
    mask = token_bitmask(ids, vocab)
    assert mask.dtype == torch.int32 and mask.shape == (3,)
    logits = torch.zeros(1, vocab)
    row = SamplingRow(SamplingParams(temperature=1.0), [1], [], allowed_tokens=mask)
    picked = {Sampler(seed=s)(logits, [row]).token_ids[0] for s in range(200)}
    assert picked == set(ids)


def test_constraints_that_leave_no_token_later_fail_their_request_without_a_stray_token(
    model_dir,
):
    """A bad word of two tokens bans the only allowed token once it was picked; stop tokens
    covering the vocabulary ban everything before min_tokens. Every logit was -inf and the
    sampler drew id 0, a token the request did not allow, as if it were an answer."""
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        vocab = llm.engine.model_config.vocab_size
        repeat, all_stops, fine = llm.generate(
            [PROMPT] * 3,
            [SamplingParams(max_tokens=4, ignore_eos=True, allowed_token_ids=(794,),
                            bad_words_token_ids=((794, 794),)),
             SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=tuple(range(vocab))),
             SamplingParams(max_tokens=4, ignore_eos=True, allowed_token_ids=(794,))],
        )  # fmt: skip
    assert repeat.error.param == "allowed_token_ids", repeat
    assert "output position 1" in repeat.error.message and repeat.token_ids == [794]
    assert all_stops.error.param == "min_tokens" and all_stops.token_ids == []
    assert fine.error is None and fine.token_ids == [794] * 4


@pytest.mark.parametrize("vocab", [64, 70])
def test_leaves_no_token_reads_the_bitmask_less_the_bans(vocab):
    mask = token_bitmask([31, 63], vocab)  # the int32 sign bit of both words
    assert not leaves_no_token(mask, (), vocab)
    assert not leaves_no_token(mask, (31, 5, 5), vocab)
    assert leaves_no_token(mask, (63, 31, 31), vocab)
    assert leaves_no_token(token_bitmask([], vocab), (), vocab)
    past_the_end = token_bitmask([vocab + 1], vocab + 32)  # a longer mask: sliced, or masked
    assert leaves_no_token(past_the_end, (), vocab)  # bits past the vocabulary are no tokens
    assert not leaves_no_token(None, tuple(range(vocab - 1)), vocab)
    assert leaves_no_token(None, tuple(range(vocab)) * 2, vocab)
