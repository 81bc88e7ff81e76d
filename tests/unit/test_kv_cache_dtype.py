"""--kv-cache-dtype: the cache's storage dtype, its size per element and the block count."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.device_config import resolve_kv_cache_dtype
from engine.model_runner import ModelRunner
from engine.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv_dtype"))


def runner(model_dir, **options) -> ModelRunner:
    # max_num_seqs large enough that memory, not "every sequence at full length", bounds blocks
    config = EngineConfig(
        model=str(model_dir), device="cpu", kv_cache_memory_gib=0.01, max_num_seqs=4096, **options
    )
    return ModelRunner(config)


def test_fp8_cache_is_one_byte_per_element_and_doubles_blocks(model_dir):
    bf16 = runner(model_dir, dtype="bfloat16")
    fp8 = runner(model_dir, dtype="bfloat16", kv_cache_dtype="fp8")
    assert bf16.kv_caches[0].dtype == torch.bfloat16
    assert fp8.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.kv_caches[0].element_size() == 1
    assert bf16.num_kv_blocks > 10
    # The budget pays for the scheduler's blocks and the scratch block of CUDA-graph padding.
    bf16_blocks, fp8_blocks = bf16.kv_caches[0].shape[0], fp8.kv_caches[0].shape[0]
    assert (bf16_blocks, fp8_blocks) == (bf16.num_kv_blocks + 1, fp8.num_kv_blocks + 1)
    assert fp8_blocks in (2 * bf16_blocks, 2 * bf16_blocks + 1)
    budget = int(0.01 * 2**30)
    fp8_bytes = sum(cache.numel() * cache.element_size() for cache in fp8.kv_caches)
    assert 0 <= budget - fp8_bytes < fp8_bytes / fp8_blocks  # less than one block unused


def test_auto_is_the_model_dtype(model_dir):
    assert runner(model_dir, dtype="float32").kv_caches[0].dtype == torch.float32


@pytest.mark.parametrize(
    "name,scale,message",
    [
        ("fp16", 1.0, "unknown kv_cache_dtype 'fp16'; choose one of auto, fp8"),
        ("fp8", 0.0, "kv_cache_scale must be a positive finite number"),
        ("fp8", float("inf"), "kv_cache_scale must be a positive finite number"),
    ],
)
def test_bad_values_are_rejected(name, scale, message):
    with pytest.raises(ValueError, match=message):
        resolve_kv_cache_dtype(name, torch.float32, scale)
