"""Triton kernel: write this step's K/V rows into their paged-cache slots.

    kv_cache [num_blocks, 2, block_size, KVH, D]     key/value [T, KVH, D]
    token t -> slot s = slot_mapping[t] -> kv_cache[s // block_size, {0,1}, s % block_size]

One program per token moves all KVH x D elements of its K and V rows (one
[BLOCK_H, BLOCK_D] tile each). For a float8_e4m3fn cache the row is divided by
its scale (per tensor or per head), clamped to +-448 and rounded to nearest even;
the result is byte-identical to `kernels.reference.quantize_fp8`.

Torch reference: `kernels.reference.write_kv_cache`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPE, FP8_MAX
from kernels.triton.checks import (
    FLOAT_DTYPES,
    require,
    require_dtype,
    require_fp8_scales,
    require_same_device,
    require_unit_last_stride,
)

_E4M3_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _round_to_e4m3_grid(x):
    """Rounds float32 x (|x| <= 448) to the nearest-even E4M3 value, still in float32.

    The cast that follows is then exact, so the stored byte does not depend on how the
    backend rounds fp32 -> fp8 (the CPU interpreter rounds half-up and loses the carry
    into the exponent; the GPU rounds to nearest even).
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    magnitude = tl.abs(x)
    # Normal range (|x| >= 2**-6): keep 3 of fp32's 23 mantissa bits, ties to even.
    mag_bits = magnitude.to(tl.int32, bitcast=True)
    mag_bits = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & -1048576  # & 0xFFF00000
    normal = mag_bits.to(tl.float32, bitcast=True)
    # Subnormal range: multiples of 2**-9, ties to even. |x| * 512 < 8, so all exact.
    y = magnitude * 512.0
    low = tl.floor(y)
    frac = y - low
    is_odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    round_up = (frac > 0.5) | ((frac == 0.5) & is_odd)
    subnormal = tl.where(round_up, low + 1.0, low) * (1.0 / 512.0)
    rounded = tl.where(magnitude < 0.015625, subnormal, normal)
    # Put the sign back as a bit, so that values rounding to zero keep it (-0.0 like torch).
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_row(
    src_ptr,
    src_stride_t,
    src_stride_h,
    dst_ptr,  # already offset to this token's (block, K or V, offset)
    dst_stride_h,
    scale_ptr,
    scale_stride,
    token,
    num_kv_heads,
    head_dim,
    IS_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    src = src_ptr + token * src_stride_t + heads[:, None] * src_stride_h + dims[None, :]
    row = tl.load(src, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    if IS_FP8:
        scale = tl.load(scale_ptr + heads * scale_stride, mask=heads < num_kv_heads, other=1.0)
        scaled = tl.math.div_rn(row.to(tl.float32), scale.to(tl.float32)[:, None])
        scaled = tl.minimum(tl.maximum(scaled, -_E4M3_MAX), _E4M3_MAX)
        row = _round_to_e4m3_grid(scaled)
    dst = dst_ptr + heads[:, None] * dst_stride_h + dims[None, :]
    tl.store(dst, row.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_offset,
    cache_stride_h,
    scale_stride,
    num_kv_heads,
    head_dim,
    block_size,
    IS_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # int64 offsets: a cache may hold more than 2**31 elements.
    base = cache_ptr + (slot // block_size) * cache_stride_block
    base += (slot % block_size) * cache_stride_offset
    _store_row(
        key_ptr, key_stride_t, key_stride_h, base, cache_stride_h, k_scale_ptr, scale_stride,
        token, num_kv_heads, head_dim, IS_FP8, BLOCK_H, BLOCK_D,
    )  # fmt: skip
    _store_row(
        value_ptr, value_stride_t, value_stride_h, base + cache_stride_kv, cache_stride_h,
        v_scale_ptr, scale_stride, token, num_kv_heads, head_dim, IS_FP8, BLOCK_H, BLOCK_D,
    )  # fmt: skip


def write_kv_cache(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int32 or int64
    k_scale: torch.Tensor | None = None,  # [1] or [KVH] float32, FP8 caches only
    v_scale: torch.Tensor | None = None,  # [1] or [KVH] float32, FP8 caches only
) -> None:
    """Writes token t's K/V into slot `slot_mapping[t]` of `kv_cache`, in place.

    A bf16/fp16/fp32 cache must have K/V's dtype; a float8_e4m3fn cache takes any of them
    plus its scales. Slots must be distinct and in range (the scheduler's are). K/V may be
    strided views (e.g. slices of a fused QKV projection) as long as head_dim is contiguous.
    """
    _check_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    is_fp8 = kv_cache.dtype == FP8_DTYPE
    # Per-head scales step one element per head; a per-tensor scale is read at offset 0.
    scale_stride = 1 if is_fp8 and k_scale is not None and k_scale.numel() > 1 else 0
    _kv_cache_write_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        scale_stride, num_kv_heads, head_dim, kv_cache.shape[2],
        IS_FP8=is_fp8,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def _check_args(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    require(key.dim() == 3, f"key must be [T, KVH, D], got {tuple(key.shape)}")
    require(value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}")
    require(
        kv_cache.dim() == 5 and kv_cache.shape[1] == 2,
        f"kv_cache must be [num_blocks, 2, block_size, KVH, D], got {tuple(kv_cache.shape)}",
    )
    require(
        kv_cache.shape[3:] == key.shape[1:],
        f"kv_cache heads/dim {tuple(kv_cache.shape[3:])} != key's {tuple(key.shape[1:])}",
    )
    require(
        slot_mapping.shape == (key.shape[0],),
        f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}",
    )
    require_dtype("key", key, FLOAT_DTYPES)
    require(value.dtype == key.dtype, f"value dtype {value.dtype} != key dtype {key.dtype}")
    require_dtype("kv_cache", kv_cache, (*FLOAT_DTYPES, FP8_DTYPE))
    # No silent down-cast on write (and the interpreter truncates fp32 -> bf16 where the GPU
    # rounds): a 16/32-bit cache holds K/V in their own dtype.
    require(
        kv_cache.dtype in (key.dtype, FP8_DTYPE),
        f"kv_cache dtype {kv_cache.dtype} must be key's dtype {key.dtype} or {FP8_DTYPE}",
    )
    require_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    require(slot_mapping.numel() <= 1 or slot_mapping.stride(0) == 1, "slot_mapping not contiguous")
    for name, tensor in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        require_unit_last_stride(name, tensor)
    require_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if kv_cache.dtype == FP8_DTYPE:
        require_fp8_scales(k_scale, v_scale, kv_cache.device, num_kv_heads=key.shape[1])


__all__ = ["write_kv_cache"]
