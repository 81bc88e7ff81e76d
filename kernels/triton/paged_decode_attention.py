"""Triton kernels: decode attention (one query row per sequence) over the paged KV cache,
split along each history and merged.

    query [S, H, D], kv_cache [num_blocks, 2, block_size, KVH, D] (engine.attention.base),
    block_tables [S, W] int32, seq_lens [S] int32
    out[s, h] = softmax(q[s, h] . K[s, h // G]^T * scale) V[s, h // G]    over seq_lens[s] keys

Why: on an H200 FlashInfer's FA2 decode reads a 2B-shape batch of 128 histories of 512
tokens at 48% of the copy bandwidth (32.5 µs a layer, merge included, against a 15.7 µs
floor: a third of the step; docs/gpu.md, 2026-11-28), and at batch 1 its two kernels take
9.5 µs for 0.5 MB. This one reads the block tables and lengths the engine already keeps
on the device, so a CUDA graph needs no host plan before each replay.

Two launches:
1. grid (S, KVH, splits): a program attends the G = H / KVH query heads of one KV head
   (GQA: K and V are read once for the group, one [G, D] x [D, BLOCK_N] product a tile) over
   one split of one history, with an online softmax; it writes that split's normalised
   output and log-sum-exp (float32). A history of L keys is cut into splits of
   cdiv(L, splits) keys, rounded up to whole tiles, read on the device from its length, so
   short histories leave the last programs idle (they write nothing) and long ones get
   long splits.
2. grid (S, H): merges a row's splits by their log-sum-exps into the output's dtype.

`splits` depends only on the batch and the device (`num_splits_for`): one launch captured
in a CUDA graph serves any lengths. FP8 (E4M3) caches are dequantised with per-tensor
scales on load. Products accumulate in float32; the value
product takes the probabilities in the query's dtype, as FlashAttention does.

Torch reference: `kernels.reference.paged_decode_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPE
from kernels.triton import num_sms
from kernels.triton.checks import (
    FLOAT_DTYPES,
    require,
    require_dtype,
    require_fp8_scales,
    require_same_device,
    require_unit_last_stride,
)

BLOCK_N = 32  # keys a tile
MERGE_CHUNK = 16  # splits the merge reads at a time
MAX_SPLITS = 32
PROGRAMS_PER_SM = 4  # the split count aims at this many programs on each SM


def num_splits_for(num_seqs: int, num_kv_heads: int, sm_count: int) -> int:
    """Splits of each history: enough (sequence, KV head, split) programs to give every SM
    a few, at most MAX_SPLITS (more only adds partial output to merge)."""
    pairs = num_seqs * num_kv_heads
    return max(1, min(MAX_SPLITS, -(-PROGRAMS_PER_SM * sm_count // pairs)))


@triton.jit
def _split_length(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys of each split of a `seq_len`-key history: cdiv(seq_len, num_splits) rounded up
    to whole tiles."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _split_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    part_ptr,  # [S, H, splits, D] float32
    lse_ptr,  # [S, H, splits] float32
    k_scale_ptr,
    v_scale_ptr,
    q_stride_s,
    q_stride_h,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_offset,
    cache_stride_h,
    table_stride,
    part_stride_s,
    part_stride_h,
    part_stride_split,
    lse_stride_s,
    lse_stride_h,
    scale,
    group,  # query heads a KV head serves
    head_dim,
    num_splits,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens a block
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_FLOAT32: tl.constexpr,  # the CPU interpreter: its tl.dot misreads 16-bit floats
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    length = _split_length(seq_len, num_splits, BLOCK_N)
    start = split * length
    end = tl.minimum(start + length, seq_len)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * group + rows
    # A split past the history reads and writes nothing (compared as a vector: the
    # interpreter cannot mask with a condition broadcast from a scalar).
    active_rows = (rows < group) & (rows * 0 + start < seq_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(
        q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + dims[None, :],
        mask=active_rows[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, BLOCK_D]
    if DOT_FLOAT32:
        q = q.to(tl.float32)
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        blocks = tl.load(tables_ptr + seq * table_stride + keys // BLOCK_SIZE, mask=key_mask,
                         other=0)  # fmt: skip
        row = (blocks.to(tl.int64) * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_offset
               + kv_head * cache_stride_h)  # fmt: skip
        tile_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(cache_ptr + row[:, None] + dims[None, :], mask=tile_mask, other=0.0)
        v = tl.load(cache_ptr + cache_stride_kv + row[:, None] + dims[None, :], mask=tile_mask,
                    other=0.0)  # fmt: skip
        if IS_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        elif DOT_FLOAT32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK_N] float32
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_i = tl.where(active_rows, l_i, 1.0)  # no 0 / 0 where nothing is written
    out = acc / l_i[:, None]
    part = part_ptr + seq * part_stride_s + split * part_stride_split
    tl.store(part + heads[:, None] * part_stride_h + dims[None, :], out,
             mask=active_rows[:, None] & dim_mask[None, :])  # fmt: skip
    lse = lse_ptr + seq * lse_stride_s + split
    tl.store(lse + heads * lse_stride_h, m_i + tl.log(l_i), mask=active_rows)


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    seq_lens_ptr,
    out_ptr,
    part_stride_s,
    part_stride_h,
    part_stride_split,
    lse_stride_s,
    lse_stride_h,
    out_stride_s,
    out_stride_h,
    head_dim,
    num_splits,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    written = tl.cdiv(seq_len, _split_length(seq_len, num_splits, BLOCK_N))  # splits with keys
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    lse_row = lse_ptr + seq * lse_stride_s + head * lse_stride_h
    part_row = part_ptr + seq * part_stride_s + head * part_stride_h
    m = tl.full([], float("-inf"), tl.float32)
    for first in range(0, written, CHUNK):  # the largest log-sum-exp
        splits = first + tl.arange(0, CHUNK)
        lse = tl.load(lse_row + splits, mask=splits < written, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, 0))
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, written, CHUNK):
        splits = first + tl.arange(0, CHUNK)
        split_mask = splits < written
        lse = tl.load(lse_row + splits, mask=split_mask, other=float("-inf"))
        weights = tl.exp(lse - m)  # [CHUNK], 0 past the last split
        parts = tl.load(part_row + splits[:, None] * part_stride_split + dims[None, :],
                        mask=split_mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
        total += tl.sum(weights, 0)
        acc += tl.sum(weights[:, None] * parts, 0)
    out = acc / total
    tl.store(out_ptr + seq * out_stride_s + head * out_stride_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)  # fmt: skip


def paged_decode_attention(
    query: torch.Tensor,  # [S, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, W] int32
    seq_lens: torch.Tensor,  # [S] int32, each >= 1 and covered by its block table
    scale: float,
    k_scale: torch.Tensor | None = None,  # [1] float32, FP8 caches
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,  # default: num_splits_for(S, KVH, the device's SMs)
    block_n: int = BLOCK_N,  # keys a tile (16 or more, a power of 2)
    num_warps: int = 4,
    num_stages: int | None = None,  # software-pipelined tile loads (None: Triton's default)
) -> torch.Tensor:  # [S, H, D]
    """Attention of each sequence's one query row over its cached history (see the module
    docstring). `seq_lens` counts this step's key, already in the cache. `block_n`,
    `num_warps` and `num_stages` are for tuning (bench/gpu_decode_attention.py sweeps them)."""
    _check_args(query, kv_cache, block_tables, seq_lens, k_scale, v_scale)
    power_of_2 = block_n >= 16 and block_n & (block_n - 1) == 0
    require(power_of_2, f"block_n must be a power of 2 of at least 16, got {block_n}")
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_splits = num_splits or num_splits_for(num_seqs, num_kv_heads, num_sms(query.device))
    part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                       device=query.device)  # fmt: skip
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    is_fp8 = kv_cache.dtype == FP8_DTYPE
    unused = seq_lens  # any pointer: the FP8 scales are read only for an FP8 cache
    block_d = max(16, triton.next_power_of_2(head_dim))
    stages = {} if num_stages is None else {"num_stages": num_stages}
    _split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, seq_lens, part, lse,
        k_scale if is_fp8 else unused, v_scale if is_fp8 else unused,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        scale, group, head_dim, num_splits,
        BLOCK_SIZE=block_size, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, IS_FP8=is_fp8,
        DOT_FLOAT32=query.device.type == "cpu", num_warps=num_warps, **stages,
    )  # fmt: skip
    _merge_kernel[(num_seqs, num_heads)](
        part, lse, seq_lens, out,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), head_dim, num_splits,
        BLOCK_N=block_n, BLOCK_D=block_d, CHUNK=MERGE_CHUNK,
    )  # fmt: skip
    return out


def _check_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    require_dtype("query", query, FLOAT_DTYPES)
    require(query.dim() == 3, f"query must be [S, H, D], got {tuple(query.shape)}")
    require(kv_cache.dim() == 5 and kv_cache.shape[1] == 2,
            f"kv_cache must be [blocks, 2, block_size, KVH, D], got {tuple(kv_cache.shape)}")  # fmt: skip
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    require(kv_cache.shape[4] == head_dim, "kv_cache's head dim differs from the query's")
    require(num_heads % num_kv_heads == 0,
            f"{num_heads} query heads do not group over {num_kv_heads} KV heads")  # fmt: skip
    require(kv_cache.dtype in (query.dtype, FP8_DTYPE),
            f"kv_cache dtype {kv_cache.dtype} is neither the query's nor FP8")  # fmt: skip
    if kv_cache.dtype == FP8_DTYPE:  # one scale per tensor: the kernel reads element 0
        require_fp8_scales(k_scale, v_scale, kv_cache.device)
    require_dtype("block_tables", block_tables, (torch.int32,))
    require_dtype("seq_lens", seq_lens, (torch.int32,))
    require(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
            f"block_tables must be [{num_seqs}, W], got {tuple(block_tables.shape)}")  # fmt: skip
    require(tuple(seq_lens.shape) == (num_seqs,), f"seq_lens must be [{num_seqs}]")
    for name, tensor in (("query", query), ("kv_cache", kv_cache), ("block_tables", block_tables)):
        require_unit_last_stride(name, tensor)
    require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    require_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables,
                        seq_lens=seq_lens)  # fmt: skip


__all__ = ["num_splits_for", "paged_decode_attention"]
