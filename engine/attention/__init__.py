"""Attention backends behind one interface (`engine.attention.base.AttentionBackend`)."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata

ATTENTION_BACKENDS = ("torch", "flashinfer")


def get_attention_backend(name: str) -> AttentionBackend:
    """Builds the backend named `name` ("torch" or "flashinfer"); imports it lazily."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "flashinfer":
        try:
            from engine.attention.flashinfer_backend import FlashInferAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention backend 'flashinfer' is not available: {exc}") from exc
        return FlashInferAttentionBackend()
    raise ValueError(
        f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
    )


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
