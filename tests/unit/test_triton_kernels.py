"""Triton kernels vs their torch references, on CPU under TRITON_INTERPRET=1 (small shapes).

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
from kernels.triton.embedding_scatter import scatter_rows  # noqa: E402
from kernels.triton.kv_cache_write import write_kv_cache  # noqa: E402
from kernels.triton.quick_gelu import quick_gelu  # noqa: E402
from kernels.triton.rms_norm import add_rms_norm  # noqa: E402
from kernels.triton.rotary import rotary_folded_  # noqa: E402
from kernels.triton.silu_and_mul import silu_and_mul  # noqa: E402
from kernels.triton.small_batch_linear import (  # noqa: E402
    MAX_ROWS,
    PRODUCT_ELEMENTS,
    Blocks,
    pick_blocks,
    small_batch_linear,
)
from kernels.triton.token_gather import gather_rows  # noqa: E402

FP8 = torch.float8_e4m3fn

# (num_tokens, num_kv_heads, head_dim, block_size, num_blocks)
KV_SHAPES = [(1, 1, 8, 4, 2), (7, 2, 24, 4, 5), (19, 4, 32, 16, 3), (33, 3, 40, 8, 6)]


def _qkv_views(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """K and V as strided slices of one fused projection, like the model hands them over."""
    generator = torch.Generator().manual_seed(seed)
    width = num_kv_heads * head_dim
    fused = torch.randn(num_tokens, 3 * width, generator=generator).to(dtype)  # [T, 3 * KVH * D]
    key = fused[:, width : 2 * width].view(num_tokens, num_kv_heads, head_dim)  # [T, KVH, D]
    value = fused[:, 2 * width :].view(num_tokens, num_kv_heads, head_dim)  # [T, KVH, D]
    return key, value


def _slots(num_tokens: int, block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Distinct slots, shuffled, spread over the whole cache."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(block_size * num_blocks, generator=generator)[:num_tokens]  # [T] int64


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


@pytest.mark.parametrize("shape", KV_SHAPES)
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_kv_cache_write_matches_reference(shape, dtype, cache_dtype):
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = shape
    key, value = _qkv_views(num_tokens, num_kv_heads, head_dim, dtype, seed=num_tokens)
    slots = _slots(num_tokens, block_size, num_blocks, seed=head_dim)
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim).to(cache_dtype)
    expected = cache.clone()
    write_kv_cache(key, value, cache, slots.to(torch.int32))
    reference.write_kv_cache(key, value, expected, slots)
    assert torch.equal(cache, expected)
    block_ids, offsets = slots // block_size, slots % block_size
    assert torch.equal(cache[block_ids, 0, offsets], key.to(cache_dtype))  # a test that can fail
    assert torch.equal(cache[block_ids, 1, offsets], value.to(cache_dtype))


@pytest.mark.parametrize("shape", KV_SHAPES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_cache_write_fp8(shape, per_head, dtype):
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = shape
    key, value = _qkv_views(num_tokens, num_kv_heads, head_dim, dtype, seed=7 * num_tokens)
    slots = _slots(num_tokens, block_size, num_blocks, seed=head_dim)

    def amax_scale(x: torch.Tensor) -> torch.Tensor:  # largest |x| maps to 448: no clamping
        amax = x.float().abs().amax(dim=(0, 2)) if per_head else x.float().abs().amax().view(1)
        return (amax / reference.FP8_MAX).clamp_min(1e-6)  # [KVH] or [1]

    k_scale, v_scale = amax_scale(key), amax_scale(value)
    cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=FP8)
    expected = cache.clone()
    write_kv_cache(key, value, cache, slots, k_scale, v_scale)
    reference.write_kv_cache(key, value, expected, slots, k_scale, v_scale)
    assert _same_bytes(cache, expected)

    block_ids, offsets = slots // block_size, slots % block_size
    for index, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        restored = reference.dequantize_fp8(cache[block_ids, index, offsets], scale)
        # E4M3 keeps 3 mantissa bits: relative error <= 1/16 in the normal range, plus an
        # absolute 2**-10 * scale for values rounded in the subnormal range.
        tolerance = x.float().abs() / 16 + scale.unsqueeze(-1) * 2.0**-10
        assert ((restored - x.float()).abs() <= tolerance).all()


def test_fp8_rounding_ties_and_saturation_match_torch():
    """Every E4M3 value, every midpoint between neighbours (ties to even), and values past
    448 (saturate) give the same byte as torch's own cast."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()  # [256]
    grid = grid[torch.isfinite(grid)].unique()  # sorted
    positive = grid[grid >= 0]
    midpoints = (positive[1:] + positive[:-1]) / 2
    nudged = torch.cat([midpoints * (1 + 2.0**-20), midpoints * (1 - 2.0**-20)])
    beyond = torch.tensor([448.5, 464.0, 480.0, 1e4, 3e38])
    values = torch.cat([positive, midpoints, nudged, beyond])
    values = torch.cat([values, -values])
    width = 16
    values = torch.cat([values, torch.zeros(-len(values) % width)])
    key = values.view(-1, 1, width)  # [T, 1, 16]
    slots = torch.arange(key.shape[0])
    cache = torch.zeros(key.shape[0], 2, 1, 1, width, dtype=FP8)
    expected = cache.clone()
    scale = torch.ones(1)
    write_kv_cache(key, key, cache, slots, scale, scale)
    reference.write_kv_cache(key, key, expected, slots, scale, scale)
    assert _same_bytes(cache, expected)
    assert cache[:, 0].float().abs().max() == reference.FP8_MAX


def test_kv_cache_write_leaves_other_slots_alone():
    key, value = _qkv_views(3, 2, 8, torch.float16, seed=1)
    cache = torch.full((4, 2, 4, 2, 8), 5.0, dtype=torch.float16)
    write_kv_cache(key, value, cache, torch.tensor([0, 9, 15]))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[0, 9, 15]] = False
    flat = cache.transpose(1, 2).reshape(16, 2, 2, 8)  # [slot, K/V, KVH, D]
    assert (flat[untouched] == 5.0).all()


def test_kv_cache_write_rejects_bad_arguments():
    key, value = _qkv_views(4, 2, 8, torch.float16, seed=2)
    slots = torch.arange(4)
    cache = torch.zeros(2, 2, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(KernelArgumentError, match="kv_cache heads/dim"):
        write_kv_cache(key, value, torch.zeros(2, 2, 4, 3, 8, dtype=torch.float16), slots)
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        write_kv_cache(key, value, cache, slots[:3])
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        write_kv_cache(key, value, cache, slots.float())
    with pytest.raises(KernelArgumentError, match="kv_cache dtype"):
        write_kv_cache(key, value, cache.bfloat16(), slots)
    with pytest.raises(KernelArgumentError, match="value dtype"):
        write_kv_cache(key, value.float(), cache, slots)
    with pytest.raises(KernelArgumentError, match="last dim"):
        write_kv_cache(key.transpose(1, 2).contiguous().transpose(1, 2), value, cache, slots)
    fp8_cache = torch.zeros(2, 2, 4, 2, 8, dtype=FP8)
    with pytest.raises(KernelArgumentError, match="k_scale and v_scale"):
        write_kv_cache(key, value, fp8_cache, slots)
    with pytest.raises(KernelArgumentError, match="k_scale must be"):
        write_kv_cache(key, value, fp8_cache, slots, torch.ones(3), torch.ones(3))
    with pytest.raises(KernelArgumentError, match="dtype"):
        write_kv_cache(key, value, fp8_cache, slots, torch.ones(1).half(), torch.ones(1).half())


@pytest.mark.parametrize("hidden", [8, 100, 1100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scatter_rows_matches_reference_and_masked_scatter(hidden, dtype):
    generator = torch.Generator().manual_seed(hidden)
    num_tokens = 13
    mask = torch.rand(num_tokens, generator=generator) < 0.5  # [T] placeholder rows
    mask[3] = True
    row_indices = mask.nonzero()[:, 0]  # [M]
    dst = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    src = torch.randn(len(row_indices), hidden, generator=generator).to(dtype)
    expected = dst.clone()
    masked = dst.masked_scatter(mask.unsqueeze(-1), src)
    scatter_rows(dst, row_indices.to(torch.int32), src)
    reference.scatter_rows(expected, row_indices, src)
    assert torch.equal(dst, expected)
    assert torch.equal(dst, masked)
    assert torch.equal(dst[3], src[int((row_indices == 3).nonzero())])


def test_scatter_rows_rejects_bad_arguments():
    dst = torch.zeros(4, 8)
    with pytest.raises(KernelArgumentError, match="src must be"):
        scatter_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 7))
    with pytest.raises(KernelArgumentError, match="row_indices must be"):
        scatter_rows(dst, torch.tensor([0]), torch.zeros(2, 8))
    with pytest.raises(KernelArgumentError, match="src dtype"):
        scatter_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 8).half())
    with pytest.raises(KernelArgumentError, match="last dim"):
        scatter_rows(torch.zeros(8, 4).t(), torch.tensor([0, 1]), torch.zeros(2, 8))


@pytest.mark.parametrize("hidden", [16, 72, 1030])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_matches_reference(hidden, dtype):
    generator = torch.Generator().manual_seed(hidden)
    query_lens = torch.tensor([5, 1, 1, 9, 2])
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    src = torch.randn(int(query_lens.sum()), hidden, generator=generator).to(dtype)  # [T, hidden]
    last_rows = reference.last_token_indices(query_start_loc)  # [S]
    assert last_rows.tolist() == [4, 5, 6, 15, 17]
    out = gather_rows(src, last_rows)
    assert torch.equal(out, reference.gather_rows(src, last_rows))
    assert torch.equal(out, src[[4, 5, 6, 15, 17]])
    into = torch.empty(2, hidden, dtype=dtype)
    gather_rows(src, torch.tensor([3, 0], dtype=torch.int32), out=into)
    assert torch.equal(into, src[[3, 0]])


def test_gather_rows_rejects_bad_out():
    with pytest.raises(KernelArgumentError, match="out must be"):
        gather_rows(torch.zeros(4, 8), torch.tensor([1]), out=torch.zeros(2, 8))
    with pytest.raises(KernelArgumentError, match="out dtype"):
        gather_rows(torch.zeros(4, 8), torch.tensor([1]), out=torch.zeros(1, 8).half())


# The fused kernels round where the torch ops do, so they may differ from the reference by
# a unit or two in the last place (2^-7 relative for bf16, 2^-10 for fp16): the norm's float32
# sum order differs, and Triton's CPU interpreter truncates float32 -> bf16 where CUDA
# rounds to nearest even. (atol, rtol) per dtype:
ROUNDING_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 2**-5),  # two units: the truncated sum feeds the norm
    torch.float16: (1e-3, 2**-9),
}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = ROUNDING_TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("rows,hidden", [(1, 8), (5, 96), (3, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_add_rms_norm_matches_reference(rows, hidden, dtype, with_residual):
    generator = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=generator) * 3).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    residual = torch.randn(rows, hidden, generator=generator).to(dtype) if with_residual else None
    out, residual_out = add_rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = reference.add_rms_norm(x, weight, 1e-6, residual)
    _close(residual_out, expected_residual)
    _close(out, expected)


def test_add_rms_norm_reads_strided_rows():
    x = torch.randn(4, 64)[:, :32]  # row stride 64
    weight = torch.randn(32)
    out, _ = add_rms_norm(x, weight, 1e-5)
    _close(out, reference.rms_norm(x, weight, 1e-5))


def test_add_rms_norm_rejects_bad_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(KernelArgumentError, match="weight"):
        add_rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(KernelArgumentError, match="residual"):
        add_rms_norm(x, torch.ones(8), 1e-6, torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(KernelArgumentError, match="row-contiguous"):
        add_rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("rows,inter", [(1, 4), (6, 100), (2, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_reference(rows, inter, dtype):
    generator = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=generator) * 4).to(dtype)
    _close(silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("shape", [(1, 8), (5, 96), (3, 1000), (2, 3, 1280)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quick_gelu_matches_reference(shape, dtype):
    generator = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=generator) * 4).to(dtype)
    _close(quick_gelu(x), reference.quick_gelu(x))


def test_quick_gelu_rejects_a_strided_input():
    with pytest.raises(KernelArgumentError, match="contiguous"):
        quick_gelu(torch.randn(4, 8).t())


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(KernelArgumentError, match="2I"):
        silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 8), (5, 6, 16), (3, 5, 24), (2, 3, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_qkv_view_matches_reference(tokens, heads, head_dim, dtype):
    """q and k heads of a fused QKV row are rotated in place; v (after them) is untouched."""
    from engine.models.layers import rotary_tables

    generator = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=generator).to(dtype)
    angles = torch.randn(tokens, head_dim // 2, generator=generator) * 3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = rotary_tables(emb.cos().to(dtype), emb.sin().to(dtype))  # [T, 1, D]
    qk = qkv[:, : (heads + 1) * head_dim].view(tokens, heads + 1, head_dim)
    expected = reference.rotary_folded(qk.clone(), cos, sin)
    v_before = qkv[:, (heads + 1) * head_dim :].clone()
    assert rotary_folded_(qk, cos, sin) is qk
    _close(qk, expected)
    assert torch.equal(qkv[:, (heads + 1) * head_dim :], v_before)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 8), (6, 3, 80), (4, 16, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_with_float32_tables_rounds_once_like_the_vision_reference(
    tokens, heads, head_dim, dtype
):
    """The vision tower's layout ([T, 3, H, D] QKV, q and k rotated together) and numerics:
    float32 math on `x.float()`, one rounding to the model dtype, bit for bit (the compiled
    kernel rounds bf16 to nearest even, tests/gpu; the interpreter truncates)."""
    from engine.models.layers import rotary_tables

    generator = torch.Generator().manual_seed(head_dim + heads)
    qkv = (torch.randn(tokens, 3, heads, head_dim, generator=generator) * 4).to(dtype)
    angles = torch.randn(tokens, head_dim // 2, generator=generator) * 20
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = rotary_tables(emb.cos(), emb.sin())  # [T, 1, D] float32
    rotated = reference.rotary_folded(qkv[:, :2].float(), cos[:, None], sin[:, None])
    if dtype == torch.bfloat16:  # the interpreter's float32 -> bf16 drops the low 16 bits
        rotated = (rotated.view(torch.int32) & -(1 << 16)).view(torch.float32)
    expected = rotated.to(dtype)
    v_before = qkv[:, 2].clone()
    qk = qkv.view(tokens, 3 * heads, head_dim)[:, : 2 * heads]  # [T, 2H, D], a view
    rotary_folded_(qk, cos, sin)
    assert torch.equal(qkv[:, :2], expected)
    assert torch.equal(qkv[:, 2], v_before)


def test_rotary_rejects_mismatched_tables():
    qk = torch.randn(3, 2, 8)
    with pytest.raises(KernelArgumentError, match="cos"):
        rotary_folded_(qk, torch.randn(3, 6), torch.randn(3, 8))
    with pytest.raises(KernelArgumentError, match="neither"):  # float16 tables for bf16 qk
        rotary_folded_(qk.bfloat16(), torch.randn(3, 8).half(), torch.randn(3, 8).half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vision_tower_with_its_kernels_equals_the_torch_path(monkeypatch, tmp_path, dtype):
    """The tower's Triton kernels (the CUDA path, here under the interpreter: q and k rotated
    in place in the QKV buffer, the fused quick_gelu) give the torch path's encoder output."""
    from engine.attention import get_attention_backend
    from engine.models import layers, qwen2_vl_vision
    from engine.models.loader import load_model
    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", seed=3)
    model = load_model(str(model_dir), dtype=dtype, device=torch.device("cpu"),
                       attention=get_attention_backend("torch"))  # fmt: skip
    vision = model.config.vision
    grids = [(1, 4, 6), (2, 4, 4)]  # two frame lengths: the grouped attention path
    generator = torch.Generator().manual_seed(3)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), vision.patch_dim, generator=generator)
    with torch.no_grad():
        expected = model.encode_images(pixels, torch.tensor(grids))
        for module in (layers, qwen2_vl_vision):
            monkeypatch.setattr(module, "use_triton", lambda x: True)
        actual = model.encode_images(pixels, torch.tensor(grids))
    # Rounding apart: the kernels' sigmoid is not torch's to the last float32 bit.
    _close(actual, expected)


# (rows, out_features, in_features): one row and the most, K past one block and ragged,
# N smaller than a block.
LINEAR_SHAPES = [(1, 37, 50), (3, 64, 300), (MAX_ROWS, 24, 1100), (5, 9, 7)]
UNIT = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # relative


def _linear_close(actual, x, weight, bias=None):
    """Within a float32 sum's error bound (K units of 2^-24 of the sum of |products|) plus
    one unit of the result's rounding (truncation under the interpreter) of the exact sum."""
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    bound = magnitude * x.shape[1] * 2**-24 + exact.abs() * UNIT[x.dtype] + 1e-30
    assert actual.shape == exact.shape and actual.dtype == x.dtype
    excess = ((actual.double() - exact).abs() / bound).max().item()
    assert excess <= 1, f"off the exact sum by {excess:.2f} times the bound"


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_linear_matches_reference(shape, dtype, with_bias):
    rows, out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    _linear_close(small_batch_linear(x, weight, bias), x, weight, bias)
    _linear_close(reference.linear(x, weight, bias), x, weight, bias)  # the bound holds there
    # Other splits sum in other orders, within the same bound.
    for blocks in (Blocks(2, 64), Blocks(4, 128, num_warps=2), Blocks(32, 16)):
        _linear_close(small_batch_linear(x, weight, bias, blocks), x, weight, bias)


def test_small_batch_linear_reads_strided_rows_and_weight_views():
    """x as rows of a wider buffer, the weight as a slice of a fused one (row stride > K)."""
    generator = torch.Generator().manual_seed(7)
    buffer = torch.randn(4, 96, generator=generator)
    fused = torch.randn(40, 80, generator=generator)
    x, weight = buffer[:, 10:90], fused[5:30]  # [4, 80], [25, 80] with strides 96 and 80
    weight_cols = fused[:, :64]  # [40, 64] with row stride 80
    _linear_close(small_batch_linear(x, weight), x, weight)
    _linear_close(small_batch_linear(x[:, :64], weight_cols), x[:, :64], weight_cols)


def test_small_batch_linear_rejects_bad_arguments():
    x, weight = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(KernelArgumentError, match="at most"):
        small_batch_linear(torch.zeros(MAX_ROWS + 1, 8), weight)
    with pytest.raises(KernelArgumentError, match="features"):
        small_batch_linear(x, torch.zeros(4, 9))
    with pytest.raises(KernelArgumentError, match="weight is"):
        small_batch_linear(x, weight.half())
    with pytest.raises(KernelArgumentError, match="bias must be"):
        small_batch_linear(x, weight, torch.zeros(5))
    with pytest.raises(KernelArgumentError, match="contiguous"):
        small_batch_linear(x, torch.zeros(8, 4).T)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize(
    "out_features,in_features", [(1536, 1536), (17920, 1536), (1536, 8960), (5, 3)]
)
def test_pick_blocks_keeps_to_its_budget_and_fills_the_device(rows, out_features, in_features):
    blocks = pick_blocks(rows, out_features, in_features, num_programs_wanted=264)
    padded_rows = 1 << (rows - 1).bit_length()
    assert padded_rows * blocks.block_n * blocks.block_k <= PRODUCT_ELEMENTS
    assert blocks.block_k <= max(in_features, 1024) and blocks.block_n <= max(out_features, 1) * 2
    programs = -(-out_features // blocks.block_n)
    assert programs >= 264 or blocks.block_n == 1


def test_decoder_linears_take_the_small_batch_kernel_up_to_their_rows(monkeypatch, tmp_path):
    """`--small-batch-linear-rows 4` on the tiny decoder: every projection (fused QKV, output,
    gate_up, down) keeps its loaded weight, runs the kernel for 1 to 4 rows (leading dims
    flattened) and `F.linear` past them, bit for bit."""
    import kernels.triton.small_batch_linear as kernel
    from engine.attention import get_attention_backend
    from engine.config import SMALL_BATCH_LINEAR_MAX_ROWS
    from engine.models import layers
    from engine.models.loader import load_model
    from engine.models.small_batch_linear import SmallBatchLinear, use_small_batch_linears
    from engine.tiny_model import make_tiny_model

    assert SMALL_BATCH_LINEAR_MAX_ROWS == MAX_ROWS  # the setting's bound is the kernel's
    model = load_model(str(make_tiny_model(tmp_path / "tiny", seed=4)), dtype=torch.float32,
                       device=torch.device("cpu"), attention=get_attention_backend("torch"))  # fmt: skip
    decoder = model.model
    originals = {name: m for name, m in decoder.named_modules() if type(m) is torch.nn.Linear}
    assert use_small_batch_linears(decoder, max_rows=4) == len(originals)
    assert len(originals) == 4 * model.config.num_hidden_layers
    monkeypatch.setattr(layers, "use_triton", lambda x: True)  # the CUDA path, interpreted
    launches = []
    real_kernel = kernel.small_batch_linear
    monkeypatch.setattr(kernel, "small_batch_linear",
                        lambda *args: launches.append(1) or real_kernel(*args))  # fmt: skip
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, original in originals.items():
            swapped = decoder.get_submodule(name)
            assert isinstance(swapped, SmallBatchLinear) and swapped.weight is original.weight
            for shape in [(1,), (3,), (2, 2), (5,)]:
                x = torch.randn(*shape, original.in_features, generator=generator)
                launched = len(launches)
                actual = swapped(x)
                if x.numel() // x.shape[-1] <= 4:
                    assert len(launches) == launched + 1
                    _linear_close(actual.view(-1, original.out_features),
                                  x.view(-1, x.shape[-1]), original.weight, original.bias)  # fmt: skip
                else:
                    assert len(launches) == launched
                    assert torch.equal(actual, original(x))
