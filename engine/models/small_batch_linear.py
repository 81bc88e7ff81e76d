"""The decoder's linear layers with a small-batch path (CUDA, `--small-batch-linear-rows`).

A decode step of a few sequences multiplies a few rows by every weight of the decoder:
the Triton kernel of `kernels/triton/small_batch_linear.py` does that as a
matrix-vector product, where cuBLAS ran the Qwen2-VL-2B shape's small projections at a
third of the H100's bandwidth. `SmallBatchLinear` takes the kernel for inputs of at most
`max_rows` rows on CUDA and `F.linear` otherwise (prefill chunks, larger batches, CPU),
so a decode graph captured at a batch size up to `max_rows` holds the kernel and the
others hold cuBLAS. The weight and bias stay the loaded parameters: nothing is copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import layers


class SmallBatchLinear(nn.Module):
    """`nn.Linear` for inference, with the small-batch kernel below `max_rows` rows."""

    def __init__(self, linear: nn.Linear, max_rows: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features if self.in_features else 0
        if 0 < rows <= self.max_rows and layers.use_triton(x):
            from kernels.triton.small_batch_linear import small_batch_linear

            flat = x.reshape(rows, self.in_features)
            return small_batch_linear(flat, self.weight, self.bias).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"small batches up to {self.max_rows} rows"
        )


def use_small_batch_linears(decoder: nn.Module, max_rows: int) -> int:
    """Replaces every `nn.Linear` in `decoder` by a `SmallBatchLinear`; returns how many."""
    return layers.replace_linears(decoder, lambda linear: SmallBatchLinear(linear, max_rows))
