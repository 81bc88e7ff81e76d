"""Chunked multimodal prefill at every budget from 1 to 17 tokens equals transformers.

One chat prompt with two images of different sizes (12 and 35 placeholder tokens).
With a budget of b tokens, chunk edges fall at multiples of b from the first
uncached token, so for every b <= 12 some edge lands inside each image span and
the image is encoded by the first chunk touching it, then sliced from the encoder
cache by the next ones:

    prompt  | text | image A (12) | text | image B (35)                  | text |
    b = 5   |....|....|....|....|....|....|....|....|....|....|....|....|....|

Each budget runs four times and every run must give HF's greedy tokens:
    * prefix caching off, first run: both images go through the vision tower;
    * prefix caching off, same prompt again: both images come from the encoder
      cache (zero vision work) - "with and without the encoder cache";
    * prefix caching on (block_size 4), first run and a second run that reuses
      the cached KV blocks.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.parity.test_generate import Reference, chat, picture  # noqa: E402

NUM_NEW = 8
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
BUDGETS = range(1, 18)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("chunked_media"), seed=0, size="tiny")
    reference = Reference(model_dir)
    prompt = chat(picture(112, 84, 1), "and then", picture(140, 196, 2), "Compare them.")
    inputs = reference.inputs(prompt)
    with torch.no_grad():
        out = reference.model.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    expected = out[0, len(prompt_ids) :].tolist()
    return str(model_dir), prompt, prompt_ids, expected


def _run(llm: LLM, prompt, prompt_ids, expected, budget: int) -> list:
    result = llm.generate([prompt], GREEDY)[0]
    assert result.error is None, result.error
    assert result.prompt_token_ids == prompt_ids
    assert result.token_ids == expected, f"budget {budget}"
    assert max(s.num_scheduled_tokens for s in llm.last_stats) <= budget
    return llm.last_stats


def _media_spans(llm: LLM, prompt) -> list[tuple[int, int]]:
    request = llm._build_request("probe", prompt, GREEDY).request
    return [(m.offset, m.offset + m.num_tokens) for m in request.media]


def test_spans_are_split_by_small_budgets(setup):
    model_dir, prompt, _, _ = setup
    spans = _media_spans(LLM(model_dir, num_kv_blocks=64), prompt)
    assert [end - start for start, end in spans] == [12, 35]
    for budget in range(1, 13):  # an edge strictly inside every span
        for start, end in spans:
            assert any(start < edge < end for edge in range(0, end + budget, budget))


@pytest.mark.parametrize("budget", BUDGETS)
def test_budget_matches_hf_with_and_without_caches(setup, budget):
    model_dir, prompt, prompt_ids, expected = setup
    llm = LLM(
        model_dir, num_kv_blocks=64, max_num_batched_tokens=budget, enable_prefix_caching=False
    )
    fresh = _run(llm, prompt, prompt_ids, expected, budget)
    assert sum(s.vision_encoder_items_total for s in fresh) == 2
    assert sum(s.encoder_cache_hits_total for s in fresh) == 0
    cached = _run(llm, prompt, prompt_ids, expected, budget)
    assert sum(s.vision_encoder_items_total for s in cached) == 0  # encoder cache only
    assert sum(s.encoder_cache_hits_total for s in cached) == 2
    assert sum(s.prefix_cache_hits_total for s in cached) == 0

    llm = LLM(model_dir, num_kv_blocks=64, max_num_batched_tokens=budget, block_size=4)
    _run(llm, prompt, prompt_ids, expected, budget)
    reused = _run(llm, prompt, prompt_ids, expected, budget)
    assert sum(s.prefix_cache_hits_total for s in reused) >= len(prompt_ids) - 8


@pytest.mark.parametrize("budget", [1, 5, 13])
def test_unsplit_media_matches_hf(setup, budget):
    model_dir, prompt, prompt_ids, expected = setup
    llm = LLM(
        model_dir,
        num_kv_blocks=64,
        max_num_batched_tokens=budget,
        split_media=False,
        enable_prefix_caching=False,
    )
    _run(llm, prompt, prompt_ids, expected, budget)
