"""The attention backend interface and the per-step metadata it consumes.

Batches are flat: the scheduled tokens of all sequences are concatenated
(no padding across requests). Sequence i owns query rows
`query_start_loc[i] : query_start_loc[i+1]`; its KV history after this step is
`seq_lens[i]` tokens long, stored in the blocks listed in `block_tables[i]`.
Its new tokens are the *last* `query_len` positions of that history, so
attention is causal with an offset of `seq_lens[i] - query_len`.

KV cache layout, one tensor per layer (FlashInfer's "NHD" paged layout):
    [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
Token t of the flat batch is written at slot `slot_mapping[t]`, i.e. block
`slot // block_size`, offset `slot % block_size`.

CUDA graphs (engine/cuda_graphs.py) replay decode steps over *static* metadata: its
tensors are persistent buffers rewritten before every replay, `graph_max_seq_len` bounds
every replayed history, and its host lists describe only the capture-time batch. A backend
must not plan from such metadata inside `forward`; the graph runner calls
`plan_cuda_graph` on the host before every warm-up, capture and replay instead, with the
step's real host lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.models.layers import apply_rotary_folded

if TYPE_CHECKING:
    from engine.model_config import ModelConfig


@dataclass(frozen=True)
class AttentionShape:
    """What every layer's attention looks like; fixed for a model and engine. Backends that
    plan ahead (FlashInfer) need it before the first forward."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per KV-cache block
    scale: float  # softmax scale
    dtype: torch.dtype  # query / output dtype (the model's)
    kv_cache_dtype: torch.dtype

    @classmethod
    def of_model(
        cls,
        model_config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
    ) -> AttentionShape:
        """The shape of `model_config`'s layers (under tensor parallelism, of its shard)."""
        return cls(
            num_heads=model_config.num_attention_heads,
            num_kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            block_size=block_size,
            scale=model_config.head_dim**-0.5,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )


@dataclass(frozen=True)
class AttentionMetadata:
    num_seqs: int
    query_lens: list[int]  # host copy, len num_seqs
    seq_lens: list[int]  # host copy, len num_seqs (history incl. this step's tokens)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, device
    seq_lens_tensor: torch.Tensor  # [num_seqs] int32, device
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    is_decode_only: bool  # every query_len == 1
    # Set on the static metadata of a captured decode graph: the bound on every seq_len
    # replayed through it (the key length a backend with static shapes pads to).
    graph_max_seq_len: int | None = None

    @property
    def is_cuda_graph(self) -> bool:
        return self.graph_max_seq_len is not None

    @property
    def max_seq_len(self) -> int:
        """Host bound on every history of the step (static for CUDA-graph metadata)."""
        if self.graph_max_seq_len is not None:
            return self.graph_max_seq_len
        return max(self.seq_lens)


class AttentionBackend(Protocol):
    """Runs attention for one layer: writes this step's K/V into the cache, then
    attends each sequence's queries over its whole KV history."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def rotate_and_forward(
        self,
        qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim]: q heads, k heads
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim] (engine.models.layers.rotary_tables)
        signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Rotary on q and k, then `forward`: `RotateThenForward`, or the same with the
        rotation and the K/V write fused (the FlashInfer backend). qk may be rotated in
        place."""
        ...

    def plan_cuda_graph(self, metadata: AttentionMetadata) -> None:
        """Prepares the decode graph of `metadata.num_seqs` rows for its next run (warm-up,
        capture or replay), on the host, outside the graph. `metadata` holds the graph's
        static tensors (already filled for this run) and the run's real host lists."""
        ...


class RotateThenForward:
    """`AttentionBackend.rotate_and_forward` unfused, for a backend with `forward`: rotate
    q and k together (one kernel on CUDA, in place in qk), then `forward`."""

    def rotate_and_forward(self, qk, value, cos, signed_sin, kv_cache, metadata, scale):
        qk = apply_rotary_folded(qk, cos, signed_sin)
        num_kv_heads = value.shape[1]
        query, key = qk.split([qk.shape[1] - num_kv_heads, num_kv_heads], dim=1)
        return self.forward(query, key, value, kv_cache, metadata, scale)  # type: ignore[attr-defined]
