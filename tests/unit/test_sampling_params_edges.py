"""build_sampling_params at its edges: context and KV room one token either side, token ids at
the vocabulary's end, and every sampling field reaching the engine's SamplingParams (mutation
testing found each untested)."""

from __future__ import annotations

import pytest

from engine.errors import ContextLengthExceeded
from server.openai_models import ChatCompletionRequest, CompletionRequest
from server.sampling_params import build_sampling_params


def chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_a_prompt_that_fills_a_small_kv_cache_is_refused_without_max_tokens():
    # kv 64 < context 128, a 64-token prompt leaves no KV room: 400 on "messages"
    with pytest.raises(ContextLengthExceeded) as err:
        build_sampling_params(chat(), num_prompt_tokens=64, max_model_len=128, kv_capacity=64)
    assert err.value.param == "messages"
    params = build_sampling_params(chat(), num_prompt_tokens=63, max_model_len=128, kv_capacity=64)
    assert params.max_tokens == 1


def test_a_prompt_one_token_over_the_context_names_the_prompt_even_with_max_tokens():
    # the prompt alone is too long, whatever max_tokens says
    with pytest.raises(ContextLengthExceeded, match="longer than this model's context") as err:
        build_sampling_params(chat(max_tokens=1), num_prompt_tokens=129, max_model_len=128)
    assert err.value.param == "messages"


def test_a_prompt_that_fills_the_context_is_refused_without_max_tokens():
    # no room to generate at all: 400 on "messages", not max_tokens 0
    with pytest.raises(ContextLengthExceeded, match="leaves no room") as err:
        build_sampling_params(chat(), num_prompt_tokens=128, max_model_len=128)
    assert err.value.param == "messages"
    assert build_sampling_params(chat(), num_prompt_tokens=127, max_model_len=128).max_tokens == 1


def test_prompt_plus_max_tokens_one_over_the_context_is_refused():
    # 100 + 29 = 129 > 128 (vLLM: 400); 100 + 28 fits exactly
    with pytest.raises(ContextLengthExceeded, match="129 in all") as err:
        build_sampling_params(chat(max_tokens=29), num_prompt_tokens=100, max_model_len=128)
    assert err.value.param == "max_tokens"
    assert (
        build_sampling_params(
            chat(max_tokens=28), num_prompt_tokens=100, max_model_len=128
        ).max_tokens
        == 28
    )


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def test_echo_with_max_tokens_0_scores_a_prompt_that_fills_the_context():
    # echo + max_tokens 0 needs no room to generate
    params = build_sampling_params(
        completion(echo=True, max_tokens=0, logprobs=1), num_prompt_tokens=128, max_model_len=128
    )
    assert params.max_tokens == 1


def test_a_kv_cache_one_token_smaller_than_the_context_still_bounds_a_request():
    # kv 127 < context 128: a default max_tokens shrinks to the cache's room
    params = build_sampling_params(
        chat(), num_prompt_tokens=100, max_model_len=128, kv_capacity=127
    )
    assert params.max_tokens == 27


def test_min_tokens_one_over_max_tokens_is_refused():
    from engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        build_sampling_params(
            chat(max_tokens=4, min_tokens=5), num_prompt_tokens=10, max_model_len=128
        )
    assert err.value.param == "min_tokens"
    assert (
        build_sampling_params(
            chat(max_tokens=4, min_tokens=4), num_prompt_tokens=10, max_model_len=128
        ).min_tokens
        == 4
    )


def test_a_token_id_equal_to_the_vocabulary_size_is_refused():
    # ids are 0 .. vocab_size-1; vocab_size itself would index past the logits
    from engine.errors import InvalidRequest
    from server.sampling_params import check_token_ids

    check_token_ids([0, 99], 100, "logit_bias")
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        check_token_ids([100], 100, "logit_bias")
    with pytest.raises(InvalidRequest):
        check_token_ids([-1], 100, "logit_bias")


def test_a_bad_word_is_banned_at_the_start_of_a_text_and_after_a_space():
    # byte-level BPE spells "cat" and " cat" differently: both are banned
    from engine.tiny_model import SIZES, train_tokenizer
    from server.sampling_params import bad_word_token_ids

    tokenizer = train_tokenizer(SIZES["tiny"].bpe_vocab_size)
    alone = tuple(tokenizer.encode("cat", add_special_tokens=False).ids)
    spaced = tuple(tokenizer.encode(" cat", add_special_tokens=False).ids)
    assert alone != spaced
    assert set(bad_word_token_ids(["cat"], tokenizer)) == {alone, spaced}


def test_the_error_names_max_completion_tokens_when_that_is_what_came():
    with pytest.raises(ContextLengthExceeded) as err:
        build_sampling_params(
            chat(max_completion_tokens=100), num_prompt_tokens=100, max_model_len=128
        )
    assert err.value.param == "max_completion_tokens"


def test_sampling_fields_reach_the_engine_params():
    # each field the client sets is the one the engine gets
    params = build_sampling_params(
        chat(
            presence_penalty=0.5,
            frequency_penalty=0.25,
            min_p=0.1,
            top_p=0.9,
            temperature=0.7,
            repetition_penalty=1.1,
        ),
        num_prompt_tokens=10,
        max_model_len=128,
    )
    assert (
        params.presence_penalty,
        params.frequency_penalty,
        params.min_p,
        params.top_p,
        params.temperature,
        params.repetition_penalty,
    ) == (0.5, 0.25, 0.1, 0.9, 0.7, 1.1)


def test_an_asked_max_tokens_over_a_small_kv_cache_is_refused_not_shrunk():
    # kv 64 < context 128; 20 + 50 needs 70 slots
    with pytest.raises(ContextLengthExceeded) as err:
        build_sampling_params(
            chat(max_tokens=50), num_prompt_tokens=20, max_model_len=128, kv_capacity=64
        )
    assert err.value.param == "max_tokens"
