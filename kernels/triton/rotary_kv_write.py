"""Triton kernel: rotary on q and k, and this step's K/V rows into their paged-cache slots,
in one launch: `rotary.rotary_folded_` followed by `kv_cache_write.write_kv_cache`.

    qk [T, H + KVH, D] (q heads, then k heads; D contiguous), v [T, KVH, D],
    cos / signed_sin [T, D] in qk's dtype (`engine.models.layers.rotary_tables`)
    qk[t, n] <- qk[t, n] * cos[t] + roll(qk[t, n], D / 2) * signed_sin[t]   (in place)
    kv_cache[s // block_size, 0, s % block_size] <- qk[t, H:]   s = slot_mapping[t]
    kv_cache[s // block_size, 1, s % block_size] <- v[t]

Why: a decode step of a small model is mostly fixed per-kernel cost, not bytes (docs/gpu.md:
the 2B shape's batch-1 step runs ~12 kernels a layer that take 1-7 µs each whatever they
read). The two launches become one, and the rotated K goes to the cache from registers
instead of being read back.

Grid: (T, cdiv(H + KVH, BLOCK_HEADS) + cdiv(KVH, BLOCK_HEADS)). The first programs of a
token rotate its q and k heads (and store the k heads into the cache); the rest copy its v
heads. The arithmetic is the two kernels' own: products rounded to qk's dtype, no FMA
contraction, and an FP8 cache quantizes the rounded K exactly as `write_kv_cache` does, so
the cache bytes and qk equal the two-kernel path's bit for bit.

Torch reference: `kernels.reference.rotary_folded` then `kernels.reference.write_kv_cache`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPE
from kernels.triton.checks import FLOAT_DTYPES, require, require_dtype, require_same_device
from kernels.triton.kv_cache_write import _E4M3_MAX, _check_args, _round_to_e4m3_grid

BLOCK_HEADS = 4


@triton.jit
def _to_cache(
    x,  # [BH, BD] float32 values already rounded to the source dtype
    scale_ptr,
    scale_stride,
    kv_heads,  # [BH] the rows' head index in the cache
    head_mask,  # [BH]
    IS_FP8: tl.constexpr,
):
    """x as the cache stores it (quantized for FP8, as kv_cache_write._store_row)."""
    if IS_FP8:
        scale = tl.load(scale_ptr + kv_heads * scale_stride, mask=head_mask, other=1.0)
        scaled = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
        scaled = tl.minimum(tl.maximum(scaled, -_E4M3_MAX), _E4M3_MAX)
        x = _round_to_e4m3_grid(scaled)
    return x


@triton.jit
def _rotary_kv_write_kernel(
    qk_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_stride_t,
    qk_stride_h,
    v_stride_t,
    v_stride_h,
    table_stride,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_offset,
    cache_stride_h,
    scale_stride,
    num_heads,  # q heads
    num_kv_heads,
    half,
    block_size,
    num_qk_programs,
    IS_FP8: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    program = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # int64 offsets: a cache may hold more than 2**31 elements.
    row = cache_ptr + (slot // block_size) * cache_stride_block
    row += (slot % block_size) * cache_stride_offset
    cols = tl.arange(0, BLOCK_HALF)  # [BD]
    col_mask = cols[None, :] < half  # [1, BD]
    cache_dtype = cache_ptr.dtype.element_ty
    if program < num_qk_programs:  # q and k heads: rotate; k heads also go to the cache
        dtype = qk_ptr.dtype.element_ty
        heads = program * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BH]
        mask = (heads[:, None] < num_heads + num_kv_heads) & col_mask  # [BH, BD]
        first = qk_ptr + token * qk_stride_t + heads[:, None].to(tl.int64) * qk_stride_h
        first += cols[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
        table = token * table_stride + cols
        cos1 = tl.load(cos_ptr + table, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + table + half, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + table, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + table + half, mask=cols < half, other=0.0).to(tl.float32)[None, :]
        # Each product and the sum rounded to qk's dtype, as rotary._rotary_kernel with
        # tables in qk's dtype (the decoder's case).
        out1 = (x1 * cos1).to(dtype).to(tl.float32) + (x2 * sin1).to(dtype).to(tl.float32)
        out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
        out1 = out1.to(dtype)
        out2 = out2.to(dtype)
        tl.store(first, out1, mask=mask)
        tl.store(first + half, out2, mask=mask)
        kv_heads = heads - num_heads  # [BH]; negative for q heads
        is_k = (kv_heads >= 0) & (kv_heads < num_kv_heads)  # [BH]
        k_mask = is_k[:, None] & col_mask
        dst = row + tl.where(is_k, kv_heads, 0)[:, None].to(tl.int64) * cache_stride_h
        dst += cols[None, :]
        k1 = _to_cache(out1.to(tl.float32), k_scale_ptr, scale_stride, kv_heads, is_k, IS_FP8)
        k2 = _to_cache(out2.to(tl.float32), k_scale_ptr, scale_stride, kv_heads, is_k, IS_FP8)
        tl.store(dst, k1.to(cache_dtype), mask=k_mask)
        tl.store(dst + half, k2.to(cache_dtype), mask=k_mask)
    else:  # v heads: copied (quantized for FP8)
        heads = (program - num_qk_programs) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BH]
        is_v = heads < num_kv_heads
        mask = is_v[:, None] & col_mask
        first = v_ptr + token * v_stride_t + heads[:, None].to(tl.int64) * v_stride_h
        first += cols[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
        dst = row + cache_stride_kv + heads[:, None].to(tl.int64) * cache_stride_h + cols[None, :]
        v1 = _to_cache(x1, v_scale_ptr, scale_stride, heads, is_v, IS_FP8)
        v2 = _to_cache(x2, v_scale_ptr, scale_stride, heads, is_v, IS_FP8)
        tl.store(dst, v1.to(cache_dtype), mask=mask)
        tl.store(dst + half, v2.to(cache_dtype), mask=mask)


def rotary_kv_write_(
    qk: torch.Tensor,  # [T, H + KVH, D], D contiguous; rotated in place
    value: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [T, D] or [T, 1, D], in qk's dtype
    signed_sin: torch.Tensor,  # like cos
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int32 or int64
    k_scale: torch.Tensor | None = None,  # [1] or [KVH] float32, FP8 caches only
    v_scale: torch.Tensor | None = None,  # [1] or [KVH] float32, FP8 caches only
) -> torch.Tensor:  # qk
    """Rotates qk's heads in place and writes its last KVH heads (K) and `value` into
    `slot_mapping`'s cache slots: what `rotary_folded_(qk, cos, signed_sin)` then
    `write_kv_cache(qk[:, H:], value, ...)` do, in one kernel. Slots must be distinct and
    in range (the scheduler's are)."""
    require(qk.dim() == 3, f"qk must be [T, H + KVH, D], got {tuple(qk.shape)}")
    require(value.dim() == 3, f"value must be [T, KVH, D], got {tuple(value.shape)}")
    num_tokens, num_qk_heads, head_dim = qk.shape
    num_kv_heads = value.shape[1]
    num_heads = num_qk_heads - num_kv_heads
    require(num_heads > 0, f"qk's {num_qk_heads} heads hold no q heads beside {num_kv_heads} k")
    require(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    require_dtype("qk", qk, FLOAT_DTYPES)
    require(qk.stride(2) == 1, "qk must be contiguous in head_dim")
    # K/V, the cache, the slots and the scales: as write_kv_cache checks them.
    _check_args(qk[:, num_heads:], value, kv_cache, slot_mapping, k_scale, v_scale)
    cos2d = cos.reshape(cos.shape[0], cos.shape[-1])
    sin2d = signed_sin.reshape(signed_sin.shape[0], signed_sin.shape[-1])
    for name, table in (("cos", cos2d), ("signed_sin", sin2d)):
        require(table.shape == (num_tokens, head_dim), f"{name} must be [{num_tokens}, {head_dim}]")
        require(table.dtype == qk.dtype, f"{name} dtype {table.dtype} is not qk's {qk.dtype}")
        require(table.stride(1) == 1, f"{name} must be row-contiguous")
    require(cos2d.stride(0) == sin2d.stride(0), "cos and signed_sin must share a row stride")
    require_same_device(qk=qk, cos=cos2d, signed_sin=sin2d, kv_cache=kv_cache)
    if num_tokens == 0:
        return qk
    is_fp8 = kv_cache.dtype == FP8_DTYPE
    # Per-head scales step one element per head; a per-tensor scale is read at offset 0.
    scale_stride = 1 if is_fp8 and k_scale is not None and k_scale.numel() > 1 else 0
    num_qk_programs = triton.cdiv(num_qk_heads, BLOCK_HEADS)
    grid = (num_tokens, num_qk_programs + triton.cdiv(num_kv_heads, BLOCK_HEADS))
    _rotary_kv_write_kernel[grid](
        qk, value, cos2d, sin2d, kv_cache, slot_mapping, k_scale, v_scale,
        qk.stride(0), qk.stride(1), value.stride(0), value.stride(1), cos2d.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        scale_stride, num_heads, num_kv_heads, head_dim // 2, kv_cache.shape[2],
        num_qk_programs,
        IS_FP8=is_fp8, BLOCK_HEADS=BLOCK_HEADS, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False,
    )  # fmt: skip
    return qk


__all__ = ["rotary_kv_write_"]
