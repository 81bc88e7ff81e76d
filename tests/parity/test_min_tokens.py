"""`min_tokens` (vLLM's sampling field): EOS and stop tokens cannot be picked until that many
tokens are out. Against transformers' `min_new_tokens`, with EOS pushed to the top by a
+100 bias so that it would otherwise come first: the same tokens, EOS right after the
minimum. The count holds with overlap scheduling too, where the request's output list lags
a token behind the row being sampled."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import hf_text_tokens  # noqa: E402

PROMPTS = ["the quick brown fox", "a b c d e f g h"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("min_tokens"), seed=0)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        yield llm


def hf_tokens(model_dir, prompt: str, min_new: int, biased: int) -> list[int]:
    return hf_text_tokens(model_dir, prompt, max_new_tokens=12, min_new_tokens=min_new,
                          sequence_bias=[[[biased], 100.0]])  # fmt: skip


def params(eos: int, min_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=12, min_tokens=min_tokens, temperature=0.0,
                          logit_bias=((eos, 100.0),), **extra)  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
def test_eos_waits_for_min_tokens_as_in_transformers(llm, model_dir, overlap):
    eos = llm.engine.model_config.eos_token_ids[0]
    llm.engine.overlaps_steps = overlap
    try:
        results = llm.generate(PROMPTS, [params(eos, 5), params(eos, 0)])
    finally:
        llm.engine.overlaps_steps = False
    assert results[0].token_ids == hf_tokens(model_dir, PROMPTS[0], 5, eos)
    assert len(results[0].token_ids) == 6 and results[0].token_ids[-1] == eos
    assert results[0].finish_reason == "stop"
    assert results[1].token_ids == [eos]  # no minimum: the biased EOS comes first


def test_every_eos_of_generation_config_ends_the_answer_as_in_transformers(llm, model_dir):
    """generation_config.json lists <|im_end|> and <|endoftext|> (as Qwen2-VL-Instruct's
    does); config.json names only the first. transformers' generate() stops on both; the
    engine read config.json alone and wrote on past <|endoftext|>."""
    import json

    listed = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert list(llm.engine.model_config.eos_token_ids) == listed
    second = listed[1]
    results = llm.generate(PROMPTS, [params(second, 3), params(second, 0)])
    assert results[0].token_ids == hf_tokens(model_dir, PROMPTS[0], 3, second)
    assert results[0].token_ids[-1] == second and results[0].finish_reason == "stop"
    assert results[1].token_ids == [second] and results[1].finish_reason == "stop"


def test_stop_token_ids_wait_too(llm):
    eos = llm.engine.model_config.eos_token_ids[0]
    stop = 77
    [result] = llm.generate(
        PROMPTS[:1],
        SamplingParams(max_tokens=12, min_tokens=3, temperature=0.0, stop_token_ids=(stop,),
                       logit_bias=((eos, 90.0), (stop, 100.0))),
    )  # fmt: skip
    assert result.token_ids[3] == stop and stop not in result.token_ids[:3]
    assert eos not in result.token_ids


def test_more_min_tokens_than_max_tokens_is_refused(llm):
    [result] = llm.generate(["hi"], SamplingParams(max_tokens=4, min_tokens=5))
    assert result.error is not None and result.error.param == "min_tokens"
