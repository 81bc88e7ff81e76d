"""Triton kernel: gather rows of the flat batch, e.g. the last hidden state of each
sequence that samples this step (`row_indices = query_start_loc[1:] - 1` for all).

    src [T, hidden]   row_indices [S]   ->   out [S, hidden], out[i] = src[row_indices[i]]

Grid: (S, cdiv(hidden, BLOCK)). Torch reference: `kernels.reference.gather_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.checks import (
    FLOAT_DTYPES,
    require,
    require_dtype,
    require_same_device,
    require_unit_last_stride,
)

MAX_BLOCK = 1024


@triton.jit
def _gather_rows_kernel(
    out_ptr,
    src_ptr,
    row_indices_ptr,
    out_stride_row,
    src_stride_row,
    hidden,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    src_row = tl.load(row_indices_ptr + row).to(tl.int64)
    values = tl.load(src_ptr + src_row * src_stride_row + cols, mask=mask)  # [BLOCK]
    tl.store(out_ptr + row * out_stride_row + cols, values, mask)


def gather_rows(
    src: torch.Tensor,  # [T, hidden]
    row_indices: torch.Tensor,  # [S] int32 or int64, each in [0, T)
    out: torch.Tensor | None = None,  # [S, hidden]; allocated like src when None
) -> torch.Tensor:  # [S, hidden]
    """out[i] = src[row_indices[i]] (out shares src's dtype)."""
    require(src.dim() == 2, f"src must be [T, hidden], got {tuple(src.shape)}")
    require(row_indices.dim() == 1, f"row_indices must be 1-D, got {tuple(row_indices.shape)}")
    num_rows, hidden = row_indices.shape[0], src.shape[1]
    if out is None:
        out = torch.empty(num_rows, hidden, dtype=src.dtype, device=src.device)
    require(
        out.shape == (num_rows, hidden),
        f"out must be [{num_rows}, {hidden}], got {tuple(out.shape)}",
    )
    require_dtype("src", src, FLOAT_DTYPES)
    require(out.dtype == src.dtype, f"out dtype {out.dtype} != src dtype {src.dtype}")
    require_dtype("row_indices", row_indices, (torch.int32, torch.int64))
    require(row_indices.numel() <= 1 or row_indices.stride(0) == 1, "row_indices not contiguous")
    require_unit_last_stride("src", src)
    require_unit_last_stride("out", out)
    require_same_device(src=src, out=out, row_indices=row_indices)
    if num_rows == 0 or hidden == 0:
        return out
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    grid = (num_rows, triton.cdiv(hidden, block))
    _gather_rows_kernel[grid](
        out, src, row_indices, out.stride(0), src.stride(0), hidden, BLOCK=block
    )
    return out


__all__ = ["gather_rows"]
