"""The Triton split-KV decode attention kernel against the torch reference, on CPU under
TRITON_INTERPRET=1 (small shapes): one query row per sequence, histories of any length up
to the bound (split edges, block edges, a single key), GQA and MHA, FP8 caches.

Skipped cleanly when triton is not installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.triton.checks import KernelArgumentError  # noqa: E402
from kernels.triton.paged_decode_attention import (  # noqa: E402
    MAX_SPLITS,
    num_splits_for,
    paged_decode_attention,
)

FP8 = torch.float8_e4m3fn


def _batch(seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0, width=None):
    """Queries, a cache of shuffled blocks and each sequence's block table."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    width = width or max(blocks_needed)
    num_blocks = sum(blocks_needed) + 3  # spare blocks hold noise nobody may read
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, count in enumerate(blocks_needed):
        tables[i, :count] = torch.tensor([order.pop() for _ in range(count)])
    query = torch.randn(len(seq_lens), heads, head_dim, generator=generator)
    return query.to(dtype), cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


# (seq_lens, heads, kv heads, head_dim, block_size, splits): histories cut into splits of
# 32-key tiles that end inside a split, on a split edge and on a block edge, fewer keys than
# splits (the last programs idle), one key; 38 splits of one history (the merge reads them
# in chunks of 16); GQA groups of 6 (Qwen2-VL-2B's) and 1; head dims that are not a power
# of two; the default split count.
CASES = [
    ([1, 16, 17, 45, 64, 200], 12, 2, 16, 4, 4),
    ([5, 33, 96], 4, 4, 24, 8, 3),
    ([1200, 7], 6, 1, 32, 16, 38),
    ([3, 9, 2], 7, 7, 8, 4, None),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(case, dtype):
    seq_lens, heads, kv_heads, head_dim, block_size, splits = case
    # Block tables wider than any history needs, as a CUDA graph's are.
    query, cache, tables, lens = _batch(seq_lens, heads, kv_heads, head_dim, block_size, dtype,
                                        width=-(-max(seq_lens) // block_size) + 2)  # fmt: skip
    cache = cache.to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(query, cache, tables, lens, scale, num_splits=splits)
    expected = reference.paged_decode_attention(query, cache, tables, lens, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert out.dtype == dtype


def test_an_fp8_cache_is_dequantized_with_its_scales():
    seq_lens, heads, kv_heads, head_dim, block_size, splits = CASES[0]
    query, cache, tables, lens = _batch(seq_lens, heads, kv_heads, head_dim, block_size,
                                        torch.bfloat16, seed=1)  # fmt: skip
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.05])
    quantized = torch.empty_like(cache, dtype=FP8)
    quantized[:, 0] = reference.quantize_fp8(cache[:, 0], k_scale)
    quantized[:, 1] = reference.quantize_fp8(cache[:, 1], v_scale)
    scale = head_dim**-0.5
    out = paged_decode_attention(query, quantized, tables, lens, scale, k_scale, v_scale,
                                 num_splits=splits)  # fmt: skip
    expected = reference.paged_decode_attention(query, quantized, tables, lens, scale, 0.02, 0.05)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_the_split_count_gives_every_sm_a_few_programs():
    assert num_splits_for(1, 2, sm_count=132) == MAX_SPLITS  # batch 1: as many as allowed
    assert num_splits_for(128, 2, sm_count=132) == 3  # 768 programs, ~4 an SM
    assert num_splits_for(512, 2, sm_count=132) == 1
    assert num_splits_for(1, 1, sm_count=1) == 4  # the interpreter counts one SM


def test_bad_arguments_are_refused():
    query, cache, tables, lens = _batch([5], 4, 2, 16, 4, torch.float32)
    with pytest.raises(KernelArgumentError, match="int32"):
        paged_decode_attention(query, cache, tables.long(), lens, 0.25)
    with pytest.raises(KernelArgumentError, match="group"):
        paged_decode_attention(query[:, :3], cache, tables, lens, 0.25)
    with pytest.raises(KernelArgumentError, match="scales"):
        paged_decode_attention(query, cache.to(FP8), tables, lens, 0.25)
    # The kernel reads one scale a tensor: per-head scales (write_kv_cache takes them) and
    # float16 ones were taken, the first head's applied to all (the twin check's, shared)
    per_head = torch.tensor([0.1, 0.2])
    with pytest.raises(KernelArgumentError, match=r"k_scale must be \[1\]"):
        paged_decode_attention(query, cache.to(FP8), tables, lens, 0.25, per_head, per_head)
    half = torch.tensor([0.1], dtype=torch.float16)
    with pytest.raises(KernelArgumentError, match="float32"):
        paged_decode_attention(query, cache.to(FP8), tables, lens, 0.25, half, half)
    with pytest.raises(KernelArgumentError, match="block_n"):
        paged_decode_attention(query, cache, tables, lens, 0.25, block_n=24)


def test_the_tuning_knobs_keep_the_result():
    """Other key tiles and split counts (bench/gpu_decode_attention.py's sweep) compute the
    same attention."""
    query, cache, tables, lens = _batch([1, 40, 130], 6, 2, 16, 8, torch.float32, seed=2)
    expected = reference.paged_decode_attention(query, cache, tables, lens, 0.25)
    for block_n, splits, stages in ((16, 1, None), (16, 9, 1), (64, 2, None), (128, 3, 4)):
        out = paged_decode_attention(query, cache, tables, lens, 0.25, num_splits=splits,
                                     block_n=block_n, num_warps=2, num_stages=stages)  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
