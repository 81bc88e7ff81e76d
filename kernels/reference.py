"""Torch references for every kernel in `kernels/`: the oracles the Triton kernels are tested
against, and the fallback where Triton is absent.

KV cache layout, one tensor per layer (FlashInfer's "NHD" paged layout):

    kv_cache [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
    slot s -> block s // block_size, offset s % block_size

FP8 E4M3 (`torch.float8_e4m3fn`, largest finite value 448) stores `x / scale`, clamped to
+-448 and rounded to nearest even; reading back multiplies by `scale`. A scale is a float32
tensor of shape [1] (per tensor) or [num_kv_heads] (per head), one for K and one for V.

This module imports only torch: `kernels/` never imports `engine/`.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(
    x: torch.Tensor,  # [..., num_kv_heads, head_dim] float
    scale: torch.Tensor,  # [1] or [num_kv_heads] float32
) -> torch.Tensor:  # same shape, float8_e4m3fn
    """x / scale (per tensor or per head), clamped to +-448, rounded to nearest even."""
    scaled = x.float() / scale.float().unsqueeze(-1)  # scale broadcasts over head_dim
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(
    x: torch.Tensor,  # [..., num_kv_heads, head_dim] float8_e4m3fn
    scale: torch.Tensor,  # [1] or [num_kv_heads] float32
) -> torch.Tensor:  # same shape, float32
    return x.float() * scale.float().unsqueeze(-1)


def write_kv_cache(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int
    k_scale: torch.Tensor | None = None,  # [1] or [KVH] float32, FP8 caches only
    v_scale: torch.Tensor | None = None,  # [1] or [KVH] float32, FP8 caches only
) -> None:
    """Writes token t's K/V into slot `slot_mapping[t]` of `kv_cache`, in place.

    For a bf16/fp16/fp32 cache this is a cast and a store (the same as the torch attention
    backend's own write through its plan rows); for a float8_e4m3fn cache K and V are quantized with their scales.
    """
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    block_ids = slots // block_size  # [T]
    offsets = slots % block_size  # [T]
    if kv_cache.dtype == FP8_DTYPE:
        if k_scale is None or v_scale is None:
            raise ValueError("an FP8 KV cache needs k_scale and v_scale")
        key = quantize_fp8(key, k_scale)
        value = quantize_fp8(value, v_scale)
    kv_cache[block_ids, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.to(kv_cache.dtype)


def scatter_rows(
    dst: torch.Tensor,  # [T, hidden]
    row_indices: torch.Tensor,  # [M] int, distinct rows of dst
    src: torch.Tensor,  # [M, hidden]
) -> None:
    """dst[row_indices[i]] = src[i], cast to dst's dtype, in place.

    Used to put encoder embeddings into the placeholder rows of a chunk:
    `embeds.masked_scatter(mask[:, None], src)` equals `scatter_rows(embeds,
    mask.nonzero()[:, 0], src)`.
    """
    dst[row_indices.long()] = src.to(dst.dtype)


def gather_rows(
    src: torch.Tensor,  # [T, hidden]
    row_indices: torch.Tensor,  # [S] int
) -> torch.Tensor:  # [S, hidden]
    """src[row_indices]: e.g. the last hidden state of each sampled sequence."""
    return src[row_indices.long()]


def last_token_indices(query_start_loc: torch.Tensor) -> torch.Tensor:  # [S] int64
    """Flat row of each sequence's last scheduled token: query_start_loc[1:] - 1."""
    return query_start_loc[1:].long() - 1


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    qo_indptr: torch.Tensor,  # [S + 1] int
    kv_indptr: torch.Tensor,  # [S + 1] int
    kv_indices: torch.Tensor,  # [num_pages] int
    kv_last_page_len: torch.Tensor,  # [S] int
    scale: float,
    k_scale: float = 1.0,  # dequantisation scales (FP8 caches)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention over FlashInfer's CSR page table (see `kernels.flashinfer_glue`),
    one sequence at a time: what FlashInfer's prefill/decode wrappers compute.

    Query row r of a sequence with Q queries and history L sees keys 0 .. L - Q + r.
    """
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    out = torch.empty_like(query)
    for i in range(kv_last_page_len.shape[0]):
        q_start, q_end = int(qo_indptr[i]), int(qo_indptr[i + 1])
        pages = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])].long()  # [P]
        seq_len = (len(pages) - 1) * block_size + int(kv_last_page_len[i])
        blocks = kv_cache[pages].float()  # [P, 2, block_size, KVH, D]
        keys = blocks[:, 0].flatten(0, 1)[:seq_len] * k_scale  # [L, KVH, D]
        values = blocks[:, 1].flatten(0, 1)[:seq_len] * v_scale  # [L, KVH, D]
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.repeat_interleave(group, dim=1)  # [L, H, D]
        q = query[q_start:q_end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale  # [H, Q, L]
        rows = torch.arange(q_end - q_start, device=query.device).unsqueeze(1)  # [Q, 1]
        cols = torch.arange(seq_len, device=query.device).unsqueeze(0)  # [1, L]
        visible = cols <= rows + (seq_len - (q_end - q_start))  # [Q, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = scores.softmax(dim=-1)  # [H, Q, L]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", weights, values).to(query.dtype)
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [S, H, D], one row per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, W] int
    seq_lens: torch.Tensor,  # [S] int
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [S, H, D]
    """Each sequence's one query row over the first `seq_lens[s]` keys of its block table:
    `paged_attention` over the CSR page table they make (the reference of
    kernels/triton/paged_decode_attention.py)."""
    block_size, device = kv_cache.shape[2], query.device
    lens = seq_lens.tolist()
    counts = [-(-n // block_size) for n in lens]
    pages = torch.cat([block_tables[i, :count] for i, count in enumerate(counts)])
    kv_indptr = torch.tensor([0, *itertools.accumulate(counts)], device=device)
    last_page_len = torch.tensor(
        [n - (count - 1) * block_size for n, count in zip(lens, counts, strict=True)],
        device=device,
    )
    qo_indptr = torch.arange(len(lens) + 1, device=device)
    return paged_attention(query, kv_cache, qo_indptr, kv_indptr, pages, last_page_len, scale,
                           k_scale, v_scale)  # fmt: skip


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [T, hidden]
    """transformers' Qwen2 RMSNorm: normalise in float32, round to x's dtype, scale."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused op, bit-identical to the lines below in float32 (checked in tests).
        return F.rms_norm(x, weight.shape, weight, eps)
    # The reference's order of roundings in three ops instead of eight (bit-identical,
    # checked in tests).
    normed = F.rms_norm(x.float(), weight.shape, None, eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, residual + x
    """The residual add of a decoder layer and the RMSNorm after it."""
    if residual is not None:
        x = residual + x
    return rms_norm(x, weight, eps), x


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELUActivation (CLIP's, and Qwen2-VL's vision MLP)."""
    return x * torch.sigmoid(1.702 * x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_folded(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, 1, D]
    signed_sin: torch.Tensor,  # [T, 1, D], rotate_half's sign folded into the first half
) -> torch.Tensor:  # [T, H, D]
    """Rotary embedding: rotate_half(x) * sin == roll(x, D/2) * signed_sin exactly."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """A linear layer summed in float64 and rounded once to the model dtype: the exact
    result that both cuBLAS and the small-batch kernel approximate (each sums in float32,
    in its own order)."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
