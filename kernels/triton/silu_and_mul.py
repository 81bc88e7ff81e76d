"""Triton kernel: silu(gate) * up over a fused gate_up projection.

    x [T, 2I] = [gate | up]  ->  out [T, I] = silu(gate) * up

Grid: (T, cdiv(I, BLOCK)). silu is rounded to the model dtype before the product, as in the
torch path (two kernels there, one here). Torch reference: `kernels.reference.silu_and_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import FLOAT_DTYPES, require, require_dtype

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    require(x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}")
    require_dtype("x", x, FLOAT_DTYPES)
    require(x.stride(-1) == 1, "x must be row-contiguous")
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block = min(triton.next_power_of_2(inter), MAX_BLOCK)
    grid = (num_rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](out, x, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out


__all__ = ["silu_and_mul"]
