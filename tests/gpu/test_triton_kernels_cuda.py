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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vision_rotary_rounds_once_like_the_reference(dtype):
    """The vision tower's q and k ([T, 3, H, D] QKV, Qwen2-VL's 16 heads of 80) rotated in
    float32 and rounded once, bit for bit: the compiled kernel must neither contract the
    products into FMAs nor round bf16 other than to nearest even."""
    from engine.models.layers import rotary_tables
    from kernels.triton.rotary import rotary_folded_

    tokens, heads, head_dim = 2048, 16, 80
    qkv = (torch.randn(tokens, 3, heads, head_dim, device=DEVICE) * 4).to(dtype)
    angles = torch.randn(tokens, head_dim // 2, device=DEVICE) * 20
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = rotary_tables(emb.cos(), emb.sin())  # [T, 1, D] float32
    expected = reference.rotary_folded(qkv[:, :2].float(), cos[:, None], sin[:, None]).to(dtype)
    v_before = qkv[:, 2].clone()
    rotary_folded_(qkv.view(tokens, 3 * heads, head_dim)[:, : 2 * heads], cos, sin)
    assert torch.equal(qkv[:, :2], expected)
    assert torch.equal(qkv[:, 2], v_before)


def test_quick_gelu_matches_reference():
    """The vision MLP's activation at its real width (4 x 1280); the kernel's exp is not
    torch's to the last float32 bit, so a rare element may round the other way."""
    from kernels.triton.quick_gelu import quick_gelu

    x = torch.randn(4096, 5120, device=DEVICE).bfloat16() * 4
    actual, expected = quick_gelu(x), reference.quick_gelu(x)
    torch.testing.assert_close(actual, expected, atol=1e-2, rtol=2**-7)
    assert (actual == expected).float().mean() > 0.999


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_seqs", [1, 5, 128])
def test_paged_decode_attention_matches_reference(cache_dtype, num_seqs):
    """Qwen2-VL-2B's attention shape (12 query heads over 2 KV heads, head dim 128, blocks
    of 16) over shuffled blocks and random histories of up to 640 keys, with the default
    split count of this device; bf16 products with float32 sums, so bf16 tolerances."""
    from kernels.triton.paged_decode_attention import paged_decode_attention

    heads, kv_heads, head_dim, block_size, width = 12, 2, 128, 16, 40
    generator = torch.Generator(device=DEVICE).manual_seed(num_seqs)
    seq_lens = torch.randint(1, width * block_size + 1, (num_seqs,), device=DEVICE,
                             generator=generator, dtype=torch.int32)  # fmt: skip
    num_blocks = num_seqs * width + 4
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device=DEVICE)
    tables = torch.randperm(num_blocks, device=DEVICE, generator=generator)[: num_seqs * width]
    tables = tables.view(num_seqs, width).to(torch.int32)
    query = torch.randn(num_seqs, heads, head_dim, device=DEVICE).bfloat16()
    scales = (torch.tensor([0.02], device=DEVICE), torch.tensor([0.05], device=DEVICE))
    if cache_dtype == torch.float8_e4m3fn:
        quantized = [reference.quantize_fp8(cache[:, i], s) for i, s in enumerate(scales)]
        cache = torch.stack(quantized, 1)
        k_scale, v_scale = scales
    else:
        cache, k_scale, v_scale = cache.bfloat16(), None, None
    scale = head_dim**-0.5
    out = paged_decode_attention(query, cache, tables, seq_lens, scale, k_scale, v_scale)
    fp8_scales = (0.02, 0.05) if k_scale is not None else (1.0, 1.0)
    expected = reference.paged_decode_attention(query, cache, tables, seq_lens, scale,
                                                *fp8_scales)  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
