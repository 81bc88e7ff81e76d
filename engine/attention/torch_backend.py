"""Reference attention backend: paged KV cache gathered with indexing, then attention.

Runs on CPU and GPU and is the oracle other backends are tested against.

    cache  [num_blocks, 2, block_size, KVH, D]
    slot s -> block s // block_size, offset s % block_size

Sequence i with block table [7, 2, 9] and block_size 4 keeps its history at
    slots 28..31 | 8..11 | 36..39          (token j -> block_table[j // 4], j % 4)
and its `query_len` new tokens are the last rows of that history, so query row
r may see keys 0 .. (seq_len - query_len) + r.

Seen as rows of [KVH, D] (`cache.view(-1, KVH, D)`), K of slot s is row
`(s // block_size) * 2 * block_size + s % block_size` and V is `block_size` rows later:

    row  0 .. B-1   block 0 K      row 2B .. 3B-1  block 1 K     ...
    row  B .. 2B-1  block 0 V      row 3B .. 4B-1  block 1 V

Everything that depends only on the step's metadata (those row indices, the key
masks) is computed once, on the first layer's call, and reused by every layer
(`StepPlan`). Per layer there is one index write for the new K/V, one gather of
the decode rows' histories and one SDPA over them (padded to the longest history
with a boolean key mask); each prefill chunk takes one SDPA of its own, over its
own new K/V when it starts the sequence (no gather needed). On CPU every op costs
microseconds of dispatch whatever its size, so a decode step's op count matters
as much as its arithmetic.

An FP8 cache (`torch.float8_e4m3fn`) stores `x / scale` with per-tensor K and V scales
(kernels/reference.py does the arithmetic). Index ops run on its bytes (a uint8 view: CPU
has no float8 index_copy_); gathered rows are dequantized to the query dtype. A chunk that
is the whole history attends over its new K/V round-tripped through FP8 too, so its output
equals what a cache read would give (as FlashInfer, which always reads the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, RotateThenForward
from engine.device_io import to_device
from kernels.reference import FP8_DTYPE, dequantize_fp8, quantize_fp8


@dataclass(frozen=True)
class DecodePlan:
    """The decode rows of one step: one query row per sequence, histories padded to L keys."""

    query_rows: torch.Tensor | None  # [S] int64 rows of the flat batch; None = all rows, in order
    key_index: torch.Tensor  # [S * KVH * L] int64 rows of `cache.view(-1, D)`, [S, KVH, L] order
    value_index: torch.Tensor  # [S * KVH * L] int64, likewise for V
    visible: torch.Tensor  # [S, 1, 1, L] bool: True for keys of the history, False for padding


@dataclass(frozen=True)
class PrefillPlan:
    """One chunk of more than one query row."""

    start: int  # first row in the flat batch
    query_len: int
    key_rows: torch.Tensor | None  # [L] int64 K rows; None = the chunk is the whole history
    mask: torch.Tensor | None  # [Q, L] bool causal mask with offset; None = plain causal


@dataclass(frozen=True)
class StepPlan:
    """Per-step index tensors shared by every layer."""

    write_rows: torch.Tensor  # [T] int64 K row of each new token in the flat cache view
    value_write_rows: torch.Tensor  # [T] int64 V rows (`write_rows + block_size`)
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


@dataclass(frozen=True)
class Fp8Scales:
    """Per-tensor dequantisation scales of an FP8 cache, as [1] float32 tensors."""

    key: torch.Tensor  # [1] float32
    value: torch.Tensor  # [1] float32


class TorchAttentionBackend(RotateThenForward):
    """`engine.attention.base.AttentionBackend` in plain PyTorch (any device, any float dtype).

    `k_scale`/`v_scale` are the per-tensor scales of an FP8 (float8_e4m3fn) cache; other
    caches ignore them.
    """

    name = "torch"

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.k_scale = k_scale
        self.v_scale = v_scale
        self._scale_tensors: dict[torch.device, Fp8Scales] = {}
        # The metadata of the current step and its plan: every layer of a step gets the
        # same metadata object, so the plan is built once per step.
        self._plan_metadata: AttentionMetadata | None = None
        self._plan: StepPlan | None = None

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        plan = self._step_plan(metadata, kv_cache.shape[2], kv_cache.shape[3])
        block_size = kv_cache.shape[2]
        rows = kv_cache.view(-1, kv_cache.shape[3], kv_cache.shape[4])  # [N * 2 * B, KVH, D]
        fp8 = self._scales_on(kv_cache.device) if kv_cache.dtype == FP8_DTYPE else None
        if fp8 is not None:
            key, value = quantize_fp8(key, fp8.key), quantize_fp8(value, fp8.value)
            rows = rows.view(torch.uint8)  # the FP8 bytes: index ops exist for uint8
            key, value = key.view(torch.uint8), value.view(torch.uint8)
        rows.index_copy_(0, plan.write_rows, key.to(rows.dtype))
        rows.index_copy_(0, plan.value_write_rows, value.to(rows.dtype))
        if plan.decode is not None and not plan.prefills:
            return paged_decode(query, rows, plan.decode, block_size, scale, fp8)
        out = torch.empty_like(query)
        for chunk in plan.prefills:
            end = chunk.start + chunk.query_len
            q = query[chunk.start : end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            if chunk.key_rows is None:  # the chunk is the whole history: no gather needed
                keys, values = key[chunk.start : end], value[chunk.start : end]  # [L, KVH, D]
            else:
                keys = rows.index_select(0, chunk.key_rows)  # [L, KVH, D]
                values = rows.index_select(0, chunk.key_rows + block_size)
            keys = read_cached(keys, fp8.key if fp8 else None, query.dtype)
            values = read_cached(values, fp8.value if fp8 else None, query.dtype)
            o = F.scaled_dot_product_attention(
                q,
                keys.transpose(0, 1).unsqueeze(0),  # [1, KVH, L, D]
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=scale,
                enable_gqa=True,
            )  # [1, H, Q, D]
            out[chunk.start : end] = o.squeeze(0).transpose(0, 1)
        if plan.decode is not None:
            decode = plan.decode
            decoded = paged_decode(
                query.index_select(0, decode.query_rows), rows, decode, block_size, scale, fp8
            )  # [S, H, D]
            out.index_copy_(0, decode.query_rows, decoded)
        return out

    def _scales_on(self, device: torch.device) -> Fp8Scales:
        """The FP8 scales as [1] float32 tensors on `device`, made once per device."""
        if device not in self._scale_tensors:
            self._scale_tensors[device] = Fp8Scales(
                torch.tensor([self.k_scale], dtype=torch.float32, device=device),
                torch.tensor([self.v_scale], dtype=torch.float32, device=device),
            )
        return self._scale_tensors[device]

    def plan_cuda_graph(self, metadata: AttentionMetadata) -> None:
        """Forgets the cached plan, so the next `forward` builds it from the (static)
        tensors again: under capture those index ops become part of the graph, and every
        replay recomputes them from the buffers it was given."""
        self._plan_metadata = None
        self._plan = None

    def _step_plan(
        self, metadata: AttentionMetadata, block_size: int, num_kv_heads: int
    ) -> StepPlan:
        if self._plan_metadata is not metadata or self._plan is None:
            self._plan = build_step_plan(metadata, block_size, num_kv_heads)
            self._plan_metadata = metadata
        return self._plan


def build_step_plan(metadata: AttentionMetadata, block_size: int, num_kv_heads: int) -> StepPlan:
    """Index tensors and masks of one step (see the module docstring for the row layout)."""
    device = metadata.slot_mapping.device
    write_rows = cache_rows(metadata.slot_mapping, block_size)  # [T]
    value_write_rows = write_rows + block_size
    if metadata.is_decode_only:
        decode = decode_plan(metadata, None, block_size, num_kv_heads)
        return StepPlan(write_rows, value_write_rows, decode, [])
    prefills: list[PrefillPlan] = []
    decode_rows: list[int] = []  # flat row of each decode sequence
    decode_seqs: list[int] = []
    start = 0
    for i, (query_len, seq_len) in enumerate(
        zip(metadata.query_lens, metadata.seq_lens, strict=True)
    ):
        if query_len == 1:
            decode_rows.append(start)
            decode_seqs.append(i)
        elif query_len > 1:
            key_rows = mask = None
            if seq_len != query_len:  # history before the chunk: gather it from the cache
                positions = torch.arange(seq_len, device=device)  # [L]
                blocks = metadata.block_tables[i].long()[positions // block_size]  # [L]
                key_rows = blocks * (2 * block_size) + positions % block_size  # [L]
                mask = causal_mask(query_len, seq_len, device)  # [Q, L]
            prefills.append(PrefillPlan(start, query_len, key_rows, mask))
        start += query_len
    decode = None
    if decode_seqs:
        decode = decode_plan(metadata, (decode_rows, decode_seqs), block_size, num_kv_heads)
    return StepPlan(write_rows, value_write_rows, decode, prefills)


def decode_plan(
    metadata: AttentionMetadata,
    subset: tuple[list[int], list[int]] | None,
    block_size: int,
    num_kv_heads: int,
) -> DecodePlan:
    """Gather rows and key mask for the decode sequences (`subset` = (flat rows, seq indices),
    None = every sequence, one row each)."""
    device = metadata.slot_mapping.device
    block_tables, seq_lens_tensor = metadata.block_tables, metadata.seq_lens_tensor
    query_rows = None
    if subset is not None:
        rows, seqs = subset
        query_rows = to_device(rows, torch.long, device)
        seq_index = to_device(seqs, torch.long, device)
        block_tables, seq_lens_tensor = block_tables[seq_index], seq_lens_tensor[seq_index]
        max_len = max(metadata.seq_lens[i] for i in seqs)
    else:
        max_len = metadata.max_seq_len  # static for a CUDA graph: keys padded to the bound
    positions = torch.arange(max_len, device=device)  # [L]
    visible = positions.unsqueeze(0) < seq_lens_tensor.unsqueeze(1)  # [S, L]
    blocks = block_tables.long()[:, positions // block_size]  # [S, L]
    key_rows = blocks * (2 * block_size) + positions % block_size  # [S, L] rows of [KVH, D]
    # Padding points at the sequence's first key: a real, finite row, masked out below.
    key_rows = torch.where(visible, key_rows, key_rows[:, :1])
    heads = torch.arange(num_kv_heads, device=device).view(1, -1, 1)  # [1, KVH, 1]
    key_index = (key_rows.unsqueeze(1) * num_kv_heads + heads).view(-1)  # [S * KVH * L]
    value_index = key_index + block_size * num_kv_heads
    return DecodePlan(query_rows, key_index, value_index, visible[:, None, None, :])


def paged_decode(
    query: torch.Tensor,  # [S, H, D], one row per sequence
    rows: torch.Tensor,  # [N * 2 * B, KVH, D] the cache as rows
    plan: DecodePlan,
    block_size: int,
    scale: float,
    fp8: Fp8Scales | None = None,  # set when `rows` are the uint8 bytes of an FP8 cache
) -> torch.Tensor:  # [S, H, D]
    """Attention of one query row per sequence over its gathered history.

    GQA without repeating K/V: the H query heads are viewed as [KVH, H / KVH], so the
    G heads sharing a KV head are G query rows of one SDPA "head" over [S, KVH, L, D].
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = rows.shape[1]
    head_rows = rows.view(-1, head_dim)  # [N * 2 * B * KVH, D]
    # index_select, not advanced indexing: on CPU it is ~20x faster for this gather.
    keys = head_rows.index_select(0, plan.key_index).view(num_seqs, num_kv_heads, -1, head_dim)
    values = head_rows.index_select(0, plan.value_index).view(keys.shape)  # [S, KVH, L, D]
    if fp8 is not None:  # dequantize as [S, L, KVH, D], the layout the scales broadcast over
        keys = read_cached(keys.transpose(1, 2), fp8.key, query.dtype).transpose(1, 2)
        values = read_cached(values.transpose(1, 2), fp8.value, query.dtype).transpose(1, 2)
    groups = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        groups,  # [S, KVH, G, D]
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=plan.visible,  # [S, 1, 1, L]
        scale=scale,
    )  # [S, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)  # CUDA SDPA may return it transposed


def read_cached(
    x: torch.Tensor,  # [..., KVH, D] cache dtype, or the uint8 bytes of FP8 values
    scale: torch.Tensor | None,  # [1] float32 for FP8 bytes; None = a plain float cache
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., KVH, D] dtype
    """Cached K or V rows as `dtype`: a cast, or FP8 bytes dequantized with their scale."""
    if scale is None:
        return x.to(dtype)
    return dequantize_fp8(x.view(FP8_DTYPE), scale).to(dtype)


def cache_rows(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] int64 K row of each slot in `cache.view(-1, KVH, D)`; V is `block_size` rows later."""
    slots = slot_mapping.long()
    return (slots // block_size) * (2 * block_size) + slots % block_size


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[Q, L] bool: query row r sees keys 0 .. (seq_len - query_len) + r."""
    offset = seq_len - query_len
    rows = torch.arange(query_len, device=device).unsqueeze(1)  # [Q, 1]
    cols = torch.arange(seq_len, device=device).unsqueeze(0)  # [1, L]
    return cols <= rows + offset
