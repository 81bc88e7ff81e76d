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
