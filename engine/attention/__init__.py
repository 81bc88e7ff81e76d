"""Attention backends behind one interface (`engine.attention.base.AttentionBackend`)."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from engine.config import ATTENTION_BACKENDS

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def check_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raises ValueError, naming the fix, when backend `name` cannot run this model."""
    if name not in ATTENTION_BACKENDS:
        raise _unknown_backend(name)
    if name != "flashinfer":
        return
    if device.type != "cuda":
        raise ValueError(
            f"attention_backend 'flashinfer' needs a CUDA device, not {device.type!r}; "
            "use --attention-backend torch"
        )
    if dtype not in FLASHINFER_DTYPES:
        raise ValueError(
            f"attention_backend 'flashinfer' has float16 and bfloat16 kernels only, not "
            f"{str(dtype).removeprefix('torch.')}; use --dtype bfloat16 or "
            "--attention-backend torch"
        )


def get_attention_backend(
    name: str,
    shape: AttentionShape | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    max_graph_batch: int = 1,
) -> AttentionBackend:
    """Builds the backend named `name` ("torch" or "flashinfer"); imports it lazily.
    `shape` is required by backends that plan ahead (flashinfer). `k_scale`/`v_scale` are
    the per-tensor scales of an FP8 KV cache (others ignore them). flashinfer sizes its
    workspace for decode graphs of up to `max_graph_batch` rows."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(k_scale, v_scale)
    if name == "flashinfer":
        try:
            from engine.attention.flashinfer_backend import FlashInferAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention backend 'flashinfer' is not available: {exc}") from exc
        if shape is None:
            raise ValueError("attention backend 'flashinfer' needs the model's AttentionShape")
        return FlashInferAttentionBackend(shape, k_scale, v_scale, max_graph_batch=max_graph_batch)
    raise _unknown_backend(name)


def _unknown_backend(name: str) -> ValueError:
    return ValueError(
        f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
    )


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "check_attention_backend",
    "get_attention_backend",
]
