"""Triton kernel: RMSNorm, optionally fused with the residual add before it.

    x [T, H] (+ residual [T, H])  ->  out [T, H] = weight * rms_norm(x + residual)
                                      residual_out [T, H] = x + residual

One program per row. The roundings are the torch path's (engine/models/layers.py): the sum
is rounded to the model dtype, normalised in float32, rounded, then scaled by the weight
(float32 product, rounded), so only the order of the float32 sum differs. It replaces the
five to eight elementwise kernels of the torch path with one. Torch reference:
`kernels.reference.add_rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import FLOAT_DTYPES, require, require_dtype, require_same_device

MAX_HIDDEN = 16384  # one row per program: the whole row must fit in one block


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    normed = (x / tl.sqrt(mean_square + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (weight * normed).to(dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H], residual_out [T, H] (x when no residual)
    """weight * rms_norm(x + residual), and x + residual (the next residual)."""
    require(x.dim() == 2, f"x must be [T, hidden], got {tuple(x.shape)}")
    num_rows, hidden = x.shape
    require(weight.shape == (hidden,), f"weight must be [{hidden}], got {tuple(weight.shape)}")
    require(hidden <= MAX_HIDDEN, f"hidden {hidden} exceeds {MAX_HIDDEN}")
    require_dtype("x", x, FLOAT_DTYPES)
    require(weight.dtype == x.dtype, f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    require(x.stride(-1) == 1 and weight.stride(-1) == 1, "x and weight must be row-contiguous")
    if residual is not None:
        require(residual.shape == x.shape, f"residual must be {tuple(x.shape)}")
        require(residual.dtype == x.dtype, f"residual dtype {residual.dtype} != {x.dtype}")
        require(residual.stride(-1) == 1, "residual must be row-contiguous")
        require_same_device(x=x, residual=residual, weight=weight)
    else:
        require_same_device(x=x, weight=weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = x if residual is None else torch.empty_like(out)
    if num_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        out, residual_out, x, x if residual is None else residual, weight,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0),
        out.stride(0), residual_out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, residual_out


__all__ = ["add_rms_norm"]
