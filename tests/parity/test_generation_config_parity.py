"""The offline `LLM` without sampling params takes the model's recommendations from its
generation_config.json (vLLM's `get_default_sampling_params`), as transformers'
`generate()` does on the same folder."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")


from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import hf_text_tokens  # noqa: E402

PROMPT = "the cat sat on the mat and the cat sat on the"
RECOMMENDED = {"top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("recommending"), seed=0)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **RECOMMENDED}))
    return folder


def test_generate_without_params_follows_the_models_recommendations(model_dir):
    expected = hf_text_tokens(model_dir, PROMPT)  # greedy, penalty 1.3, 8 new tokens
    assert expected != hf_text_tokens(model_dir, PROMPT, repetition_penalty=1.0)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        assert llm.default_sampling_params() == SamplingParams(
            max_tokens=8, top_k=1, repetition_penalty=1.3
        )
        [result] = llm.generate(PROMPT)
    assert result.token_ids == expected


def test_none_and_an_override(model_dir):
    with LLM(str(model_dir), generation_config="none", num_kv_blocks=64) as llm:
        assert llm.default_sampling_params() == SamplingParams()
    override = '{"temperature": 0.0, "max_new_tokens": 3}'
    with LLM(str(model_dir), override_generation_config=override, num_kv_blocks=64) as llm:
        params = llm.default_sampling_params()
        assert (params.temperature, params.max_tokens, params.top_k) == (0.0, 3, 1)
