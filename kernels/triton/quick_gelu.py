"""Triton kernel: quick_gelu(x) = x * sigmoid(1.702 * x), the Qwen2-VL vision MLP's activation.

    x [..., I] (contiguous)  ->  out, x's shape and dtype

Grid: (T, cdiv(I, BLOCK)) over the T = numel / I rows. 1.702 * x and the sigmoid are
rounded to the model dtype before the product, as the torch path's three kernels round
them; there each kernel reads and writes the whole [rows, 4 x embed] activation, here it
is read once and written once. Torch reference: `kernels.reference.quick_gelu`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import FLOAT_DTYPES, require, require_dtype

MAX_BLOCK = 1024


@triton.jit
def _quick_gelu_kernel(out_ptr, x_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    scaled = (x * 1.702).to(dtype).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (x * gate).to(dtype), mask=mask)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    require(x.dim() >= 1, "x must have at least one dimension")
    require_dtype("x", x, FLOAT_DTYPES)
    require(x.is_contiguous(), "x must be contiguous")
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    width = x.shape[-1]
    block = min(triton.next_power_of_2(width), MAX_BLOCK)
    grid = (x.numel() // width, triton.cdiv(width, block))
    _quick_gelu_kernel[grid](out, x, width, BLOCK=block)
    return out


__all__ = ["quick_gelu"]
