"""Triton kernel: scatter encoder embeddings into the placeholder rows of a chunk.

    dst [T, hidden]   (token embeddings of the step, placeholder rows hold garbage)
    src [M, hidden]   (encoder output rows, in placeholder order)
    row_indices [M]   (flat row of each placeholder, distinct)
    dst[row_indices[i]] = src[i]

Same result as `dst.masked_scatter(mask[:, None], src)` with `row_indices =
mask.nonzero()[:, 0]`, but in place and without the host sync of a boolean mask
when the indices were built on the host. Grid: (M, cdiv(hidden, BLOCK)).

Torch reference: `kernels.reference.scatter_rows`.
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
def _scatter_rows_kernel(
    dst_ptr,
    src_ptr,
    row_indices_ptr,
    dst_stride_row,
    src_stride_row,
    hidden,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    dst_row = tl.load(row_indices_ptr + row).to(tl.int64)
    values = tl.load(src_ptr + row * src_stride_row + cols, mask=mask)  # [BLOCK]
    tl.store(dst_ptr + dst_row * dst_stride_row + cols, values, mask)


def scatter_rows(
    dst: torch.Tensor,  # [T, hidden]
    row_indices: torch.Tensor,  # [M] int32 or int64, distinct rows of dst
    src: torch.Tensor,  # [M, hidden]
) -> None:
    """dst[row_indices[i]] = src[i], in place (src and dst share a dtype)."""
    require(dst.dim() == 2, f"dst must be [T, hidden], got {tuple(dst.shape)}")
    require(
        src.dim() == 2 and src.shape[1] == dst.shape[1],
        f"src must be [M, {dst.shape[1]}], got {tuple(src.shape)}",
    )
    require(
        row_indices.shape == (src.shape[0],),
        f"row_indices must be [{src.shape[0]}], got {tuple(row_indices.shape)}",
    )
    require_dtype("dst", dst, FLOAT_DTYPES)
    # Same dtype, no cast: a cast belongs to the caller (and the interpreter truncates
    # fp32 -> bf16 where the GPU rounds to nearest even).
    require(src.dtype == dst.dtype, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    require_dtype("row_indices", row_indices, (torch.int32, torch.int64))
    require(row_indices.numel() <= 1 or row_indices.stride(0) == 1, "row_indices not contiguous")
    require_unit_last_stride("dst", dst)
    require_unit_last_stride("src", src)
    require_same_device(dst=dst, src=src, row_indices=row_indices)
    num_rows, hidden = src.shape
    if num_rows == 0 or hidden == 0:
        return
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    grid = (num_rows, triton.cdiv(hidden, block))
    _scatter_rows_kernel[grid](
        dst, src, row_indices, dst.stride(0), src.stride(0), hidden, BLOCK=block
    )


__all__ = ["scatter_rows"]
