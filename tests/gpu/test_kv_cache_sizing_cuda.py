"""KV-cache sizing from `gpu_memory_utilization` on a real device (CUDA only): the cache
fills what the weights and the profiled step leave of the budget, the engine then stays
inside the budget while it serves the largest steps, and a budget the device cannot give
fails at start-up with the reason."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv_cache_sizing import GIB, MemoryBudgetError
from engine.model_runner import ModelRunner
from engine.tiny_model import make_tiny_model
from tests.parity.test_generate import make_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# What the profiled step of a tiny model, cuBLAS's workspaces and the allocator's
# rounding may take out of the budget, with room to spare.
SLACK = GIB


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sizing_cuda"), seed=2, size="tiny-hd128")


def utilization_for(extra_bytes: int) -> float:
    """A utilization whose budget is what the device holds now plus `extra_bytes`."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return round((total - free + extra_bytes) / total, 4)


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_the_kv_cache_fills_what_the_weights_and_largest_step_leave(model_dir):
    utilization = utilization_for(4 * GIB)
    config = EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=4096,
        gpu_memory_utilization=utilization, enforce_eager=True,
    )  # fmt: skip
    runner = ModelRunner(config)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    cache = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    # Most of the 4 GiB goes to the cache; the profiled step and CUDA's own
    # allocations of a tiny model take less than SLACK.
    assert 4 * GIB - SLACK < weights + cache <= 4 * GIB + SLACK
    assert cache > 2 * GIB


def test_serving_the_largest_steps_stays_inside_the_budget(model_dir):
    utilization = utilization_for(3 * GIB)
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(
        str(model_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=utilization,
        max_num_batched_tokens=512,
    )  # fmt: skip
    prompts = make_prompts()
    llm.generate(prompts * 4, GREEDY)  # prefill chunks of the whole budget, images
    assert device_used() <= utilization * total + SLACK
    # The sized engine answers as one with a fixed cache does.
    fixed = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                max_num_batched_tokens=512)  # fmt: skip
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [
        o.token_ids for o in fixed.generate(prompts, GREEDY)
    ]


def test_a_budget_larger_than_the_free_memory_fails_at_start_up(model_dir):
    config = EngineConfig(model=str(model_dir), device="cuda", gpu_memory_utilization=1.0)
    with pytest.raises(MemoryBudgetError, match="is free"):
        ModelRunner(config)
