"""Triton kernel: a linear layer for a few rows (decode steps of small batches).

    x [M, K] @ weight[N, K]^T (+ bias [N])  ->  out [M, N],   M <= MAX_ROWS

At one to eight rows a linear layer is a matrix-vector product: it reads the whole weight
once and does two FLOPs per weight element, so its time is the weight's bytes over the
memory bandwidth, plus the launch. On the H100 the decoder's projections of the
Qwen2-VL-2B shape ran at 1-2.5 TB/s through cuBLAS at batch 1 (docs/gpu.md, 2026-11-26):
the QKV and output projections (5-6 MB each) took ~5 µs, where 3.35 TB/s would read them
in under 2 µs. This kernel is the plain alternative: each program reads BLOCK_N whole
weight rows, BLOCK_K columns at a time, multiplies them with every input row and keeps
float32 partial sums, reduced once at the end; no split over K, so every output is one
program's sum (deterministic, and no second pass) and is rounded to the model dtype once,
after the bias, as cuBLAS does.

Whether it beats cuBLAS is measured, not assumed: `bench/gpu_gemv.py` times both at the
decoder's shapes and sweeps the blocks; the engine uses the kernel only below
`--small-batch-linear-rows` (0, off, by default). Measured on an H100 (2026-11-27,
docs/gpu.md): within ±10% of cuBLAS at one row, behind it from 2 rows up; a batch-1 step
gained 0% (2B) and 2% (7B), so it stays off. Torch reference: `kernels.reference.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton import num_sms
from kernels.triton.checks import (
    FLOAT_DTYPES,
    require,
    require_dtype,
    require_same_device,
    require_unit_last_stride,
)

MAX_ROWS = 8  # past this a batch is a small GEMM, which cuBLAS's tensor-core kernels do
PRODUCT_ELEMENTS = 8192  # rows x BLOCK_N x BLOCK_K float32 partial sums a program holds


@triton.jit
def _small_batch_linear_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    rows,
    out_features,
    in_features,
    x_stride,
    weight_stride,
    out_stride,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,  # rows padded to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    col_mask = cols < out_features
    row_ids = tl.arange(0, ROWS)
    row_mask = row_ids < rows
    weight_rows = weight_ptr + cols.to(tl.int64)[:, None] * weight_stride  # [BLOCK_N, 1]
    x_rows = x_ptr + row_ids.to(tl.int64)[:, None] * x_stride  # [ROWS, 1]
    # Each thread keeps its own partial sums over the loop and they are reduced once at
    # the end: no cross-thread reduction between one tile's loads and the next's.
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        weight = tl.load(
            weight_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(
            tl.float32
        )  # [ROWS, BLOCK_K]
        acc += x[:, None, :] * weight[None, :, :]
    total = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + row_ids.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class Blocks:
    """How one launch splits the work: BLOCK_N weight rows a program, BLOCK_K columns a
    loop iteration, and the warps of a program."""

    block_n: int
    block_k: int
    num_warps: int = 4


def pick_blocks(rows: int, out_features: int, in_features: int, num_programs_wanted: int) -> Blocks:
    """A first guess, not yet tuned on a GPU (`bench/gpu_gemv.py` sweeps the others): the
    widest K step that the product budget allows at these rows (up to 1024 columns, so each
    iteration keeps several KB of weight in flight), then as many weight rows a program as
    keep `num_programs_wanted` programs (a few per SM) busy."""
    padded_rows = triton.next_power_of_2(max(rows, 1))
    block_k = min(triton.next_power_of_2(in_features), 1024, PRODUCT_ELEMENTS // padded_rows)
    block_n = min(
        max(1, PRODUCT_ELEMENTS // (padded_rows * block_k)),
        triton.next_power_of_2(out_features),
    )
    while block_n > 1 and triton.cdiv(out_features, block_n) < num_programs_wanted:
        block_n //= 2
    return Blocks(block_n, block_k)


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: Blocks | None = None,
) -> torch.Tensor:  # [M, K] x [N, K] -> [M, N]
    """`F.linear(x, weight, bias)` for M <= MAX_ROWS rows; `blocks` overrides the default
    split (`pick_blocks`, with two programs per SM)."""
    require(x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}")
    require(weight.dim() == 2, f"weight must be [N, K], got {tuple(weight.shape)}")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    require(rows <= MAX_ROWS, f"x has {rows} rows; this kernel takes at most {MAX_ROWS}")
    require(
        weight.shape[1] == in_features,
        f"weight is {tuple(weight.shape)} but x has {in_features} features",
    )
    require_dtype("x", x, FLOAT_DTYPES)
    require(weight.dtype == x.dtype, f"weight is {weight.dtype} but x is {x.dtype}")
    require_unit_last_stride("x", x)
    require_unit_last_stride("weight", weight)
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        require(
            bias.shape == (out_features,), f"bias must be [{out_features}], got {tuple(bias.shape)}"
        )
        require(bias.dtype == x.dtype, f"bias is {bias.dtype} but x is {x.dtype}")
        require(bias.is_contiguous(), "bias must be contiguous")
        tensors["bias"] = bias
    require_same_device(**tensors)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    if blocks is None:
        blocks = pick_blocks(rows, out_features, in_features, 2 * num_sms(x.device))
    grid = (triton.cdiv(out_features, blocks.block_n),)
    _small_batch_linear_kernel[grid](
        out,
        x,
        weight,
        weight if bias is None else bias,  # never read without HAS_BIAS
        rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        ROWS=triton.next_power_of_2(rows),
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps,
    )
    return out


__all__ = ["MAX_ROWS", "Blocks", "pick_blocks", "small_batch_linear"]
