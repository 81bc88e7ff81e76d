"""Small building blocks shared by the model files: norms, activations, rotary helpers.

Plain PyTorch, no state beyond parameters. The numerics follow the Hugging Face
reference implementations exactly (e.g. RMSNorm in float32, rotary "rotate half"
layout) so parity tests can hold tight tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from kernels import triton as triton_kernels


def use_triton(x: torch.Tensor) -> bool:
    """The fused Triton kernels of kernels/triton/ replace chains of small torch ops on
    CUDA; on CPU the torch ops are the transformers reference, bit for bit."""
    return x.is_cuda and triton_kernels.is_available()


def replace_linears(model: nn.Module, replacement: Callable[[nn.Linear], nn.Module]) -> int:
    """Replaces every plain `nn.Linear` in `model` by `replacement(linear)`; returns how
    many (the inference-only linears of `cpu_prepack` and `small_batch_linear`)."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, replacement(child))
    return len(swaps)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.add_forward(x, None)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(residual + x), residual + x
        """The residual add before the norm, fused with it on CUDA (one kernel, not up to
        nine); without a residual, the norm of x and x."""
        if use_triton(x):
            from kernels.triton.rms_norm import add_rms_norm

            return add_rms_norm(x, self.weight, self.eps, residual)
        return reference.add_rms_norm(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * intermediate] gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        if use_triton(x):
            from kernels.triton.silu_and_mul import silu_and_mul

            return silu_and_mul(x)
        return reference.silu_and_mul(x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): one Triton kernel on CUDA instead of three torch ops, each
    of which reads and writes the vision MLP's whole [rows, 4 x embed] activation."""
    if use_triton(x):
        from kernels.triton.quick_gelu import quick_gelu as triton_quick_gelu

        return triton_quick_gelu(x)
    return reference.quick_gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "silu": F.silu,
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary. x [T, H, D]; cos, sin [T, D] (already in x's dtype)."""
    cos = cos.unsqueeze(-2)  # [T, 1, D]
    sin = sin.unsqueeze(-2)  # [T, 1, D]
    return x * cos + rotate_half(x) * sin


def rotary_tables(
    cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 1, D] each
    """Per-step tables for `apply_rotary_folded`: cos, and sin with rotate_half's sign folded
    in (first half negated). Build once per step, use in every layer. cos, sin [T, D]."""
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # [T, D]
    return cos.unsqueeze(-2), signed_sin.unsqueeze(-2)


def apply_rotary_folded(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """`apply_rotary` with tables from `rotary_tables`: x [T, H, D]; cos, signed_sin [T, 1, D].

    rotate_half(x) * sin == roll(x, D/2) * signed_sin exactly (negation is exact), in
    four ops instead of eight. On CUDA one Triton kernel rotates x in place (it may be a
    view, e.g. the q and k heads of a fused QKV output, which then stays whole) and returns
    it; elsewhere a new tensor is returned and x is left as it was."""
    if use_triton(x):
        from kernels.triton.rotary import rotary_folded_

        return rotary_folded_(x, cos, signed_sin)
    return reference.rotary_folded(x, cos, signed_sin)


def rope_inv_freq(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """[dim // 2] float32 inverse frequencies 1 / theta^(2i / dim)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:  # [D/2] float32 -> [D/2] float32
    """Llama 3.1's rotary scaling: a frequency whose wavelength is longer than
    original_max / low_freq_factor is divided by `factor`, one shorter than
    original_max / high_freq_factor is kept, and those between blend the two by where
    original_max / wavelength falls between the two factors."""
    wavelength = 2 * math.pi / inv_freq
    slowed = inv_freq / factor
    blend = (original_max_position_embeddings / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - blend) * slowed + blend * inv_freq
    is_long = wavelength > original_max_position_embeddings / low_freq_factor
    is_short = wavelength < original_max_position_embeddings / high_freq_factor
    return torch.where(is_long, slowed, torch.where(is_short, inv_freq, blended))


def scatter_rows(
    dst: torch.Tensor,  # [T, hidden]
    rows: torch.Tensor,  # [M] int64, distinct rows of dst
    src: torch.Tensor,  # [M, hidden], dst's dtype
) -> None:
    """dst[rows[i]] = src[i] in place: encoder rows into their placeholder rows. On CUDA the
    Triton kernel (kernels/triton/embedding_scatter.py) when Triton is installed."""
    if use_triton(dst):
        from kernels.triton.embedding_scatter import scatter_rows as triton_scatter_rows

        triton_scatter_rows(dst, rows, src)
    else:
        dst.index_copy_(0, rows, src)
