"""Reference attention backend: paged KV cache gathered with indexing, then SDPA.

Runs on CPU and GPU and is the oracle other backends are tested against.

    cache  [num_blocks, 2, block_size, KVH, D]
    slot s -> block s // block_size, offset s % block_size

Sequence i with block table [7, 2, 9] and block_size 4 keeps its history at
    slots 28..31 | 8..11 | 36..39          (token j -> block_table[j // 4], j % 4)
and its `query_len` new tokens are the last rows of that history, so query row
r may see keys 0 .. (seq_len - query_len) + r.

Decode rows (query_len 1) take one batched SDPA over their sequences, padded to
the longest history with a key mask; each prefill chunk takes one SDPA of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata


class TorchAttentionBackend:
    """`engine.attention.base.AttentionBackend` in plain PyTorch (any device, any float dtype)."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        if metadata.is_decode_only:
            return decode_attention(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.seq_lens_tensor,
                scale,
            )
        return self._mixed(query, kv_cache, metadata, scale)

    def _mixed(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:  # [T, H, D]
        """Decode rows of the step go through one batched call; each prefill chunk alone."""
        block_size = kv_cache.shape[2]
        out = torch.empty_like(query)
        decode_rows: list[int] = []  # flat row of each decode sequence
        decode_seqs: list[int] = []
        start = 0
        for i in range(metadata.num_seqs):
            query_len, seq_len = metadata.query_lens[i], metadata.seq_lens[i]
            if query_len == 1:
                decode_rows.append(start)
                decode_seqs.append(i)
            elif query_len > 1:
                num_blocks = -(-seq_len // block_size)
                block_ids = metadata.block_tables[i : i + 1, :num_blocks].long()  # [1, NB]
                keys, values = gather_kv(
                    kv_cache, block_ids, seq_len, query.dtype
                )  # [1, KVH, L, D]
                q = query[start : start + query_len].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
                mask = causal_mask(query_len, seq_len, query.device)  # [Q, L]
                o = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
                )  # [1, H, Q, D]
                out[start : start + query_len] = o.squeeze(0).transpose(0, 1)
            start += query_len
        if decode_rows:
            rows = torch.tensor(decode_rows, device=query.device)
            seqs = torch.tensor(decode_seqs, device=query.device)
            out[rows] = decode_attention(
                query[rows],
                kv_cache,
                metadata.block_tables[seqs],
                [metadata.seq_lens[i] for i in decode_seqs],
                metadata.seq_lens_tensor[seqs],
                scale,
            )
        return out


def decode_attention(
    query: torch.Tensor,  # [S, H, D], one row per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: list[int],  # host copy
    seq_lens_tensor: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:  # [S, H, D]
    """One SDPA over all sequences, histories padded to the longest with a key mask."""
    block_size = kv_cache.shape[2]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    block_ids = block_tables[:, :num_blocks].long()  # [S, NB]
    keys, values = gather_kv(kv_cache, block_ids, max_len, query.dtype)  # [S, KVH, L, D]
    positions = torch.arange(max_len, device=query.device)  # [L]
    mask = positions.unsqueeze(0) < seq_lens_tensor.unsqueeze(1)  # [S, L]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [S, H, 1, D]
        keys,
        values,
        attn_mask=mask[:, None, None, :],  # [S, 1, 1, L]
        scale=scale,
        enable_gqa=True,
    )  # [S, H, 1, D]
    return out.squeeze(2)


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    block_size = kv_cache.shape[2]
    block_ids = slot_mapping // block_size  # [T]
    offsets = slot_mapping % block_size  # [T]
    kv_cache[block_ids, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    block_ids: torch.Tensor,  # [S, NB] int64
    length: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values [S, KVH, length, D]
    blocks = kv_cache[block_ids].to(dtype)  # [S, NB, 2, block_size, KVH, D]
    num_seqs, num_blocks, _, block_size, num_kv_heads, head_dim = blocks.shape
    blocks = blocks.transpose(1, 2).reshape(
        num_seqs, 2, num_blocks * block_size, num_kv_heads, head_dim
    )
    blocks = blocks[:, :, :length].permute(1, 0, 3, 2, 4)  # [2, S, KVH, L, D]
    return blocks[0], blocks[1]


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[Q, L] bool: query row r sees keys 0 .. (seq_len - query_len) + r."""
    offset = seq_len - query_len
    rows = torch.arange(query_len, device=device).unsqueeze(1)  # [Q, 1]
    cols = torch.arange(seq_len, device=device).unsqueeze(0)  # [1, L]
    return cols <= rows + offset
