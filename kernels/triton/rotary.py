"""Triton kernel: rotary embedding applied in place to the q and k heads of a fused QKV row.

    qk [T, N, D] (a view: heads 0..N-1 of each row, D contiguous), cos [T, D],
    signed_sin [T, D] (rotate_half's sign folded in, `engine.models.layers.rotary_tables`)
    qk[t, n] <- qk[t, n] * cos[t] + roll(qk[t, n], D / 2) * signed_sin[t]

Grid: (T, cdiv(N, BLOCK_HEADS)). The arithmetic happens in the tables' dtype:

* tables in qk's dtype (the decoder): both products and the sum are rounded to it, as the
  torch path's three ops are (it runs five kernels and a copy);
* float32 tables with bf16 / fp16 qk (the vision tower, where transformers rotates
  `q.float()`): float32 throughout, rounded once on the store. The torch path there casts
  q and k to float32, rotates and casts back: six kernels and ~13 bytes of traffic per
  element of q and k, against one kernel and 4 bytes here.

Either way one kernel runs and writes back into the QKV buffer, so q, k and v stay views
of it. FMA contraction is off, so every product and sum rounds as torch's separate ops do.
Torch reference: `kernels.reference.rotary_folded` (on `x.float()` in the second case).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import FLOAT_DTYPES, require, require_dtype, require_same_device

BLOCK_HEADS = 4


@triton.jit
def _rotary_kernel(
    qk_ptr,
    cos_ptr,
    sin_ptr,
    token_stride,
    head_stride,
    table_stride,
    num_heads,
    half,
    ROUND_PRODUCTS: tl.constexpr,  # round each product to qk's dtype (tables in its dtype)
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BH]
    cols = tl.arange(0, BLOCK_HALF)  # [BD]
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)  # [BH, BD]
    dtype = qk_ptr.dtype.element_ty
    first = (
        qk_ptr + token * token_stride + heads[:, None].to(tl.int64) * head_stride + cols[None, :]
    )
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    table = token * table_stride + cols
    table_mask = cols < half
    cos1 = tl.load(cos_ptr + table, mask=table_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + half, mask=table_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table, mask=table_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + half, mask=table_mask, other=0.0).to(tl.float32)[None, :]
    if ROUND_PRODUCTS:
        out1 = (x1 * cos1).to(dtype).to(tl.float32) + (x2 * sin1).to(dtype).to(tl.float32)
        out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    else:
        out1 = x1 * cos1 + x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + half, out2.to(dtype), mask=mask)


def rotary_folded_(
    qk: torch.Tensor,  # [T, N, D], D contiguous; rotated in place
    cos: torch.Tensor,  # [T, D] or [T, 1, D], in qk's dtype or float32
    signed_sin: torch.Tensor,  # like cos
) -> torch.Tensor:  # qk
    require(qk.dim() == 3, f"qk must be [T, N, D], got {tuple(qk.shape)}")
    num_tokens, num_heads, head_dim = qk.shape
    require(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    require_dtype("qk", qk, FLOAT_DTYPES)
    require(qk.stride(2) == 1, "qk must be contiguous in head_dim")
    cos2d = cos.reshape(cos.shape[0], cos.shape[-1])
    sin2d = signed_sin.reshape(signed_sin.shape[0], signed_sin.shape[-1])
    for name, table in (("cos", cos2d), ("signed_sin", sin2d)):
        require(table.shape == (num_tokens, head_dim), f"{name} must be [{num_tokens}, {head_dim}]")
        require(
            table.dtype in (qk.dtype, torch.float32),
            f"{name} dtype {table.dtype} is neither qk's dtype {qk.dtype} nor float32",
        )
        require(table.stride(1) == 1, f"{name} must be row-contiguous")
    require(cos2d.stride(0) == sin2d.stride(0), "cos and signed_sin must share a row stride")
    require(cos2d.dtype == sin2d.dtype, "cos and signed_sin must share a dtype")
    require_same_device(qk=qk, cos=cos2d, signed_sin=sin2d)
    if num_tokens == 0 or num_heads == 0:
        return qk
    half = head_dim // 2
    grid = (num_tokens, triton.cdiv(num_heads, BLOCK_HEADS))
    _rotary_kernel[grid](
        qk, cos2d, sin2d, qk.stride(0), qk.stride(1), cos2d.stride(0), num_heads, half,
        ROUND_PRODUCTS=cos2d.dtype != torch.float32,
        BLOCK_HEADS=BLOCK_HEADS, BLOCK_HALF=triton.next_power_of_2(half),
        enable_fp_fusion=False,
    )  # fmt: skip
    return qk


__all__ = ["rotary_folded_"]
