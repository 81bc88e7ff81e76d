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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
