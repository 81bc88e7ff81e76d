"""Triton kernels compiled for the GPU vs their torch references (CUDA only).

Run this directory in its own pytest process: tests/unit/test_triton_kernels.py switches
triton to its CPU interpreter for the whole process.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.triton import is_interpreted  # noqa: E402
from kernels.triton.embedding_scatter import scatter_rows  # noqa: E402
from kernels.triton.kv_cache_write import write_kv_cache  # noqa: E402
from kernels.triton.token_gather import gather_rows  # noqa: E402

DEVICE = torch.device("cuda")
if is_interpreted():
    pytest.skip("triton runs interpreted in this process", allow_module_level=True)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim", [(1, 1, 64), (300, 8, 128), (77, 2, 80)]
)
def test_kv_cache_write(cache_dtype, per_head, num_tokens, num_kv_heads, head_dim):
    block_size, num_blocks = 16, 64
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, device=DEVICE).bfloat16() * 5
    key, value = fused[:, 1], fused[:, 2]  # strided views, like slices of a QKV projection
    slots = torch.randperm(block_size * num_blocks, device=DEVICE)[:num_tokens]
    cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, device=DEVICE)
    cache = cache.to(cache_dtype)
    expected = cache.clone()
    scales = (torch.rand(num_kv_heads if per_head else 1, device=DEVICE) + 0.01,) * 2
    write_kv_cache(key, value, cache, slots, *scales)
    reference.write_kv_cache(key, value, expected, slots, *scales)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_scatter_and_gather_rows():
    dst = torch.randn(500, 1536, device=DEVICE).bfloat16()
    rows = torch.randperm(500, device=DEVICE)[:200]
    src = torch.randn(200, 1536, device=DEVICE).bfloat16()
    expected = dst.clone()
    scatter_rows(dst, rows, src)
    reference.scatter_rows(expected, rows, src)
    assert torch.equal(dst, expected)
    assert torch.equal(gather_rows(dst, rows), src)
