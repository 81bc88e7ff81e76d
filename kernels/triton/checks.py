"""Argument checks shared by the Triton launchers (shapes, dtypes, devices, strides).

A failed check is a bug in the caller, never bad user input, so it raises
`KernelArgumentError` (a ValueError) with a message naming the argument.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the launchers accept


class KernelArgumentError(ValueError):
    """A tensor handed to a kernel launcher has the wrong shape, dtype, device or strides."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelArgumentError(message)


def require_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    require(
        tensor.dtype in allowed,
        f"{name} has dtype {tensor.dtype}; expected one of {', '.join(map(str, allowed))}",
    )


def require_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: tensor.device for name, tensor in tensors.items()}
    require(
        len(set(devices.values())) == 1,
        f"tensors are on different devices: {devices}",
    )


def require_unit_last_stride(name: str, tensor: torch.Tensor) -> None:
    """The kernels vectorise over the last dim, so it must be contiguous."""
    require(
        tensor.shape[-1] <= 1 or tensor.stride(-1) == 1,
        f"{name} must be contiguous in its last dim (stride {tensor.stride(-1)})",
    )


def require_fp8_scales(
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    device: torch.device,
    num_kv_heads: int | None = None,
) -> None:
    """An FP8 KV cache's scales: float32, contiguous, on the cache's `device`, each [1] (one
    per tensor), or [num_kv_heads] where the kernel also takes one per head."""
    if k_scale is None or v_scale is None:
        raise KernelArgumentError("an FP8 KV cache needs its scales, k_scale and v_scale")
    require(k_scale.shape == v_scale.shape, "k_scale and v_scale must have the same shape")
    sizes = (1,) if num_kv_heads is None else (1, num_kv_heads)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        require_dtype(name, scale, (torch.float32,))
        require(
            scale.dim() == 1 and scale.numel() in sizes and scale.is_contiguous(),
            f"{name} must be {' or '.join(f'[{size}]' for size in sizes)}, "
            f"got {tuple(scale.shape)}",
        )
        require(scale.device == device, f"{name} is not on the cache's device")
