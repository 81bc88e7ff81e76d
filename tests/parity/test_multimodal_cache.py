"""Encoder cache, cross-request vision batching and media-aware prefix caching, end to end
through `LLM` / `EngineCore`, every output checked against transformers' greedy tokens.

Images: A (112x84, 12 tokens), A2 (same size as A, other pixels: same token ids, other
content hash), B (140x196, 35 tokens), C (200x90, 21 tokens).
"""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.parity.test_generate import Reference, chat, picture  # noqa: E402

NUM_NEW = 8
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
IMAGES = {
    "A": picture(112, 84, 1),
    "A2": picture(112, 84, 5),
    "B": picture(140, 196, 2),
    "C": picture(200, 90, 3),
}
QUESTIONS = ["What is this?", "Describe it.", "Name three colours.", "Is it big?"]
# 8 requests over 3 distinct images, as (image, question).
EIGHT = [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 2), ("C", 3), ("A", 2), ("B", 1)]


class HF:
    """Greedy continuations from transformers, cached by prompt key."""

    def __init__(self, model_dir):
        self.reference = Reference(model_dir)
        self._tokens: dict[tuple, list[int]] = {}

    def tokens(self, key: tuple, prompt) -> list[int]:
        if key not in self._tokens:
            inputs = self.reference.inputs(prompt)
            with torch.no_grad():
                out = self.reference.model.generate(
                    **inputs, max_new_tokens=NUM_NEW, do_sample=False
                )
            self._tokens[key] = out[0, inputs["input_ids"].shape[1] :].tolist()
        return self._tokens[key]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("mm_cache"), seed=0, size="tiny")
    return str(model_dir), HF(model_dir)


def prompt_of(*parts) -> tuple[tuple, dict]:
    """(cache key, chat prompt) for parts that are image names or text."""
    return parts, chat(*(IMAGES.get(part, part) for part in parts))


def eight_prompts() -> list[tuple[tuple, dict]]:
    return [prompt_of(name, QUESTIONS[q]) for name, q in EIGHT]


def check(llm: LLM, hf: HF, keyed_prompts) -> list:
    results = llm.generate([prompt for _, prompt in keyed_prompts], GREEDY)
    for result, (key, prompt) in zip(results, keyed_prompts, strict=True):
        assert result.error is None, result.error
        assert result.token_ids == hf.tokens(key, prompt), key
    return llm.last_stats


def total(stats, field: str) -> int:
    return sum(getattr(s, field) for s in stats)


def test_eight_requests_three_images_one_vision_call(setup):
    model_dir, hf = setup
    llm = LLM(model_dir, num_kv_blocks=256)
    stats = check(llm, hf, eight_prompts())
    assert total(stats, "vision_encoder_items_total") == 3
    assert total(stats, "vision_encoder_batches_total") == 1
    assert stats[0].vision_encoder_items_total == 3  # all in the first step
    assert total(stats, "encoder_cache_hits_total") <= total(stats, "encoder_cache_queries_total")
    # The same eight again: zero vision work, every query a hit (prefix caching off so
    # that the prompts do reach the encoder cache).
    llm = LLM(model_dir, num_kv_blocks=256, enable_prefix_caching=False)
    check(llm, hf, eight_prompts())
    stats = check(llm, hf, eight_prompts())
    assert total(stats, "vision_encoder_items_total") == 0
    assert total(stats, "encoder_cache_queries_total") == 8
    assert total(stats, "encoder_cache_hits_total") == 8


def test_batched_vision_rows_equal_per_item_rows(setup):
    model_dir, _ = setup
    keyed = [prompt_of(name, "What is this?") for name in ("A", "B", "C")]
    prompts = [prompt for _, prompt in keyed]
    batched = LLM(model_dir, num_kv_blocks=256)
    batched.generate(prompts, GREEDY)
    assert total(batched.last_stats, "vision_encoder_batches_total") == 1
    single = LLM(model_dir, num_kv_blocks=256)
    for prompt in prompts:
        single.generate([prompt], GREEDY)
        assert total(single.last_stats, "vision_encoder_batches_total") == 1
        assert total(single.last_stats, "vision_encoder_items_total") == 1
    sizes = set()
    for index, prompt in enumerate(prompts):
        (media,) = batched._build_request(f"probe{index}", prompt, GREEDY).request.media
        rows = batched.engine.runner.encoder_cache.get(media.content_hash)  # [tokens, hidden]
        alone = single.engine.runner.encoder_cache.get(media.content_hash)
        assert rows.shape == (media.num_tokens, 128)
        torch.testing.assert_close(rows, alone, atol=1e-5, rtol=1e-5)
        sizes.add(media.num_tokens)
    assert sizes == {12, 35, 21}


def test_prefix_cache_counts_same_and_different_image(setup):
    model_dir, hf = setup
    llm = LLM(model_dir, num_kv_blocks=256, block_size=4)
    same = prompt_of("A", "What is this?")
    other = prompt_of("A2", "What is this?")  # same token ids, other pixels
    request_a = llm._build_request("probe-a", same[1], GREEDY).request
    request_a2 = llm._build_request("probe-a2", other[1], GREEDY).request
    assert request_a.prompt_token_ids == request_a2.prompt_token_ids
    num_prompt = len(request_a.prompt_token_ids)
    (media,) = request_a.media

    stats = check(llm, hf, [same])
    assert (
        total(stats, "prefix_cache_queries_total"),
        total(stats, "prefix_cache_hits_total"),
    ) == (
        num_prompt,
        0,
    )
    stats = check(llm, hf, [same])  # same text + same image: every full block but the last token
    assert total(stats, "prefix_cache_queries_total") == num_prompt
    assert total(stats, "prefix_cache_hits_total") == (num_prompt - 1) // 4 * 4
    assert total(stats, "vision_encoder_items_total") == 0
    stats = check(llm, hf, [other])  # same text + another image: only blocks before the image
    assert total(stats, "prefix_cache_queries_total") == num_prompt
    assert total(stats, "prefix_cache_hits_total") == media.offset // 4 * 4
    assert total(stats, "vision_encoder_items_total") == 1


def test_tiny_encoder_budget_evicts_and_outputs_stay_right(setup, caplog):
    model_dir, hf = setup
    llm = LLM(
        model_dir,
        num_kv_blocks=256,
        encoder_cache_tokens=24,  # B alone (35 tokens) is larger: the budget grows to 35
        max_encoder_tokens_per_step=24,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        stats = check(llm, hf, eight_prompts())
    assert "growing the encoder cache budget to 35" in caplog.text
    assert llm.engine.scheduler.encoder_cache.budget_tokens == 35
    assert total(stats, "vision_encoder_items_total") > 3  # evicted entries were re-encoded


def test_same_image_twice_in_one_prompt_with_small_chunks(setup):
    model_dir, hf = setup
    llm = LLM(
        model_dir,
        num_kv_blocks=256,
        encoder_cache_tokens=12,
        max_num_batched_tokens=5,
        enable_prefix_caching=False,
    )
    twice = prompt_of("A", "and again", "A", "Are they the same?")
    stats = check(llm, hf, [twice, prompt_of("C", "What is this?")])
    assert total(stats, "encoder_cache_hits_total") >= 1
