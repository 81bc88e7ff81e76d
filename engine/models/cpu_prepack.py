"""Linear layers with weights reordered once into oneDNN's blocked layout (CPU only).

`F.linear` on a CPU bfloat16 weight already runs through oneDNN, but it reorders
the plain [out, in] weight into the kernel's blocked layout on every call. For the
small row counts of decode steps that reorder costs more than the matmul: on this
project's 2-core AVX512-BF16 machine the four matmuls of a 0.5B-shaped decoder layer
take 2.75 ms at 8 rows with `F.linear` and 1.2 ms prepacked (`bench/cpu_linear.py`). The results are bit-identical for
bfloat16 and float16 (same kernel, same accumulation order), so the swap is made for
those dtypes only; float32 stays on MKL's `F.linear`, which is what transformers
uses and what the float32 parity tests compare against.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers import replace_linears

PREPACK_DTYPES = (torch.bfloat16, torch.float16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where `PrepackedLinear` is available and bit-identical to `F.linear`."""
    if device.type != "cpu" or dtype not in PREPACK_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


class PrepackedLinear(nn.Module):
    """`nn.Linear` for inference on CPU, weight held in oneDNN's blocked layout.

    The packed weight is an opaque mkldnn tensor: it cannot be read back as [out, in]
    or moved between devices, so the swap happens after loading, as the last step.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # The batch-size hint only picks the blocking; any row count works afterwards.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_linears(model: nn.Module) -> int:
    """Replaces every `nn.Linear` in `model` by a `PrepackedLinear`; returns how many."""
    return replace_linears(model, PrepackedLinear)
