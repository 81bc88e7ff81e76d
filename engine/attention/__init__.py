"""Attention backends behind one interface (`engine.attention.base.AttentionBackend`)."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata

ATTENTION_BACKENDS = ("torch", "flashinfer")


def get_attention_backend(
    name: str, k_scale: float = 1.0, v_scale: float = 1.0
) -> AttentionBackend:
    """Builds the backend named `name` ("torch" or "flashinfer"); imports it lazily.
    `k_scale`/`v_scale` are the per-tensor scales of an FP8 KV cache (others ignore them)."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(k_scale, v_scale)
    if name == "flashinfer":
        try:
            from engine.attention.flashinfer_backend import FlashInferAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention backend 'flashinfer' is not available: {exc}") from exc
        return FlashInferAttentionBackend(k_scale, v_scale)
    raise ValueError(
        f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
    )


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
