"""Glue between Tessera's step metadata and FlashInfer's paged-attention wrappers.

FlashInfer describes a batch with CSR arrays over the pages ("blocks") of a paged cache
whose layout ("NHD") is exactly ours:

    kv_cache [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)

For sequences with query_lens [3, 1], seq_lens [6, 9], block_size 4 and block tables
[[7, 2, _], [5, 0, 8]]:

    qo_indptr        [0, 3, 4]           query rows of sequence i: qo_indptr[i] : qo_indptr[i+1]
    kv_indptr        [0, 2, 5]           pages of sequence i: kv_indices[kv_indptr[i] : ...]
    kv_indices       [7, 2, 5, 0, 8]     physical block ids, in history order
    kv_last_page_len [2, 1]              tokens used in the last page (1 .. block_size)

Causal masking is aligned to the end of the history (query row r of a sequence with
history L and Q queries sees keys 0 .. L - Q + r), the same as the torch backend.

`build_paged_kv_plan` turns the host-side lists into these arrays without touching the
device; `gather_page_indices` picks the block ids out of the device block table with one
index (no host sync). `FlashInferWrappers` owns the workspace and the prefill/decode
wrappers: `plan()` once per step, `run()` once per layer. `GraphDecodeWrapper` is the
decode wrapper of one fixed batch size in FlashInfer's CUDA-graph mode: its page table
lives in buffers at fixed addresses that `plan()` rewrites on the host before every replay,
and the `run()` captured in a graph reads them. FlashInfer is optional
(`pip install tessera[gpu]`) and imported only when `FlashInferWrappers` is built.
This module never imports `engine/`.
"""

from __future__ import annotations

import builtins
import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace

# Every wrapper runs FlashInfer's FA2 kernels, decode included (its "tensor-core" decode is
# the FA2 prefill kernel with one query row per sequence). FlashInfer JIT-compiles one module
# per (query dtype, KV dtype, head dim, backend) on first use, about a minute each on a
# 16-core machine; with FA2 everywhere, prefill and decode share that one module. FA3 would
# only speed up prefill attention, a few percent of a prefill step at multimodal prompt
# lengths (hundreds to a few thousand tokens), for a second module per variant. Its decode is
# slower: 1.3x FA2's attention time at batch 1 and 4x at 128 on an H200 (docs/gpu.md,
# bench/gpu_decode.py's graphs-fa3 mode, which sets this name while its engine is built).
FLASHINFER_BACKEND = "fa2"


@dataclass(frozen=True)
class PagedKVPlan:
    """FlashInfer's CSR page table for one step, built on the host (all CPU tensors)."""

    qo_indptr: torch.Tensor  # [S + 1] int32
    kv_indptr: torch.Tensor  # [S + 1] int32
    kv_last_page_len: torch.Tensor  # [S] int32
    block_table_index: torch.Tensor  # [num_pages] int64, flat index into block_tables.view(-1)
    is_decode_only: bool  # every query_len == 1 (the decode wrapper applies)

    @property
    def num_seqs(self) -> int:
        return self.kv_last_page_len.shape[0]

    def pinned(self) -> PagedKVPlan:
        return PagedKVPlan(
            qo_indptr=self.qo_indptr.pin_memory(),
            kv_indptr=self.kv_indptr.pin_memory(),
            kv_last_page_len=self.kv_last_page_len.pin_memory(),
            block_table_index=self.block_table_index.pin_memory(),
            is_decode_only=self.is_decode_only,
        )


def build_paged_kv_plan(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    block_table_width: int,
    *,
    pin_memory: bool = False,
) -> PagedKVPlan:
    """CSR arrays for sequences with these query lengths and histories (host lists).
    `pin_memory`: stage them in pinned memory, so copies to the GPU never stall the host."""
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"{len(query_lens)} query lengths but {len(seq_lens)} sequence lengths")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_pages = [-(-seq_len // block_size) for seq_len in seq_lens]
    for query_len, seq_len, pages in zip(query_lens, seq_lens, num_pages, strict=True):
        if not 1 <= query_len <= seq_len:
            raise ValueError(f"query_len {query_len} must be in 1..seq_len ({seq_len})")
        if pages > block_table_width:
            raise ValueError(f"seq_len {seq_len} needs {pages} blocks; the table holds fewer")
    # numpy, not per-row torch ops: this runs on the host every step (~20x faster at 128 rows).
    qo_indptr = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qo_indptr[1:])
    kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=kv_indptr[1:])
    last_page_len = (
        np.asarray(seq_lens, dtype=np.int32) - (kv_indptr[1:] - kv_indptr[:-1] - 1) * block_size
    )
    # Row i's pages are block_tables[i, 0:num_pages[i]] = flat entries i * width + j.
    row_starts = np.repeat(np.arange(len(seq_lens), dtype=np.int64) * block_table_width, num_pages)
    page_in_row = np.arange(kv_indptr[-1], dtype=np.int64) - np.repeat(kv_indptr[:-1], num_pages)
    plan = PagedKVPlan(
        qo_indptr=torch.from_numpy(qo_indptr),
        kv_indptr=torch.from_numpy(kv_indptr),
        kv_last_page_len=torch.from_numpy(last_page_len),
        block_table_index=torch.from_numpy(row_starts + page_in_row),
        is_decode_only=all(query_len == 1 for query_len in query_lens),
    )
    return plan.pinned() if pin_memory else plan


def gather_page_indices(
    block_tables: torch.Tensor,  # [S, max_blocks] int32, any device
    plan: PagedKVPlan,
) -> torch.Tensor:  # [num_pages] int32 on block_tables' device
    """kv_indices: the physical block ids of every sequence's pages, concatenated."""
    index = plan.block_table_index.to(block_tables.device, non_blocking=True)
    return block_tables.reshape(-1)[index].to(torch.int32)


def import_flashinfer() -> Any:
    """The flashinfer module, or ImportError naming the extra that installs it."""
    try:
        flashinfer = importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(
            "flashinfer is not installed; install the GPU extra: pip install 'tessera[gpu]'"
        ) from exc
    for name in PLANNING_MODULES:
        use_tensor_max_in(importlib.import_module(name))
    return flashinfer


# FlashInfer's modules whose plan() takes `max(lengths_tensor).item()` of host tensors.
PLANNING_MODULES = ("flashinfer.decode", "flashinfer.prefill")


def tensor_aware_max(*args: Any, **kwargs: Any) -> Any:
    """builtins.max, but one reduction for a single non-empty 1-D tensor.

    FlashInfer 0.6's plan() calls the builtin `max()` on a host tensor of sequence lengths:
    Python walks it row by row (an unbind, then a compare, a bool and an item per row).
    On the H100, at 128 decode rows, that was ~0.5 ms of host time per step, the largest
    host cost of a CUDA-graph decode step besides the graph launch (torch profile of
    `scripts/gpu_session.sh decode-2b`, 2026-11-26). `tensor.max()` returns the same 0-d
    tensor value in one op; every other call is the builtin's.
    """
    if len(args) == 1 and not kwargs:
        (values,) = args
        if isinstance(values, torch.Tensor) and values.dim() == 1 and values.numel() > 0:
            return values.max()
    return builtins.max(*args, **kwargs)


def use_tensor_max_in(module: Any) -> None:
    """Shadow the builtin `max` in one module's globals (name lookups try them first)."""
    module.max = tensor_aware_max


@dataclass(frozen=True)
class PlanGeometry:
    """Everything a plan needs besides the page table; fixed for a model."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    scale: float  # softmax scale
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


def split_kv_workspace_bytes(
    geometry: PlanGeometry, num_sms: int, max_graph_batch: int, compute_major: int = 9
) -> int:
    """The most float workspace FlashInfer 0.6's FA2 plans take for this geometry: the
    partial outputs and log-sum-exps of split-KV work tiles, `num_qo_heads x tiles x
    cta_tile_q x (head_dim + 1)` floats (`PrefillPlanImpl` in its scheduler.cuh).

    An eager plan splits only while its tiles fit in `2 x num_sms / num_kv_heads` (two
    CTAs an SM), each tile up to 128 query rows. A CUDA-graph decode plan of B rows always
    splits and pads to `max(that, ceil(B x group / cta_tile_q) + B - 1)` tiles
    (`max_graph_batch` 0: no graphs). Qwen3-VL-30B-A3B's 32 query heads over 4 KV heads
    ask for 133 MiB on an H200's 132 SMs: FlashInfer's recommended 128 MiB failed its first
    prefill (docs/gpu.md, 2026-11-28).
    """
    group = geometry.num_qo_heads // geometry.num_kv_heads
    split_tiles = 2 * num_sms // geometry.num_kv_heads
    eager_tile = _cta_tile_q(1 << 30, geometry.head_dim, compute_major)
    eager_rows = split_tiles * eager_tile
    graph_rows = 0
    if max_graph_batch:
        graph_tile = _cta_tile_q(group, geometry.head_dim, compute_major)
        graph_tiles = -(-max_graph_batch * group // graph_tile) + max_graph_batch - 1
        graph_rows = max(split_tiles, graph_tiles) * graph_tile
    floats = geometry.num_qo_heads * max(eager_rows, graph_rows) * (geometry.head_dim + 1)
    return 4 * floats + 2 * 16  # each of the two buffers starts 16-byte aligned


def _cta_tile_q(packed_qo_len: int, head_dim: int, compute_major: int) -> int:
    """FlashInfer's query rows a CTA takes (`FA2DetermineCtaTileQ`, for head dims under 512
    whose smallest tile fits shared memory, as every model here); before sm80, 64 rows
    even for a few."""
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 or compute_major < 8 else 16


def _plan_decode(
    wrapper: Any, plan: PagedKVPlan, kv_indices: torch.Tensor, geometry: PlanGeometry
) -> None:
    wrapper.plan(
        plan.kv_indptr,
        kv_indices,
        plan.kv_last_page_len,
        geometry.num_qo_heads,
        geometry.num_kv_heads,
        geometry.head_dim,
        geometry.block_size,
        pos_encoding_mode="NONE",  # RoPE / M-RoPE is applied before the cache write
        q_data_type=geometry.q_dtype,
        kv_data_type=geometry.kv_dtype,
        sm_scale=geometry.scale,
    )


class GraphDecodeWrapper:
    """FlashInfer's decode wrapper in CUDA-graph mode for one batch size.

    The page table (indptr [B + 1], indices [max_pages], last_page_len [B]) lives in
    buffers allocated here, at addresses a captured graph keeps. `plan()` runs on the host
    before every warm-up, capture and replay: it writes this step's table into the buffers
    and FlashInfer's split-KV schedule into its workspace (fixed-size in graph mode, so any
    history fits the captured launch). `run()` is what a graph captures.

    Split-KV stays on at every batch size, although at 128 rows of the 2B shape its merge
    kernel only copies (3.3 us a layer): FlashInfer 0.6.18's graph mode pads the grid and
    masks the padding blocks only when it splits. Planned with `disable_split_kv=True`,
    the padding blocks read stale work indices: an illegal memory access in tests/gpu on
    the H100 (2026-11-26); the step also measured 3.42 ms at 128 rows against 3.32 split.
    """

    def __init__(
        self,
        workspace: torch.Tensor,
        batch_size: int,
        max_pages: int,
    ) -> None:
        flashinfer = import_flashinfer()
        device = workspace.device
        self.batch_size = batch_size
        self.max_pages = max_pages
        self._indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
        self._indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self._last_page_len = torch.ones(batch_size, dtype=torch.int32, device=device)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            kv_layout="NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            backend=FLASHINFER_BACKEND,
            paged_kv_indptr_buffer=self._indptr,
            paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=self._last_page_len,
        )

    def plan(self, plan: PagedKVPlan, kv_indices: torch.Tensor, geometry: PlanGeometry) -> None:
        if plan.num_seqs != self.batch_size or not plan.is_decode_only:
            raise ValueError(
                f"a graph wrapper of batch size {self.batch_size} got {plan.num_seqs} "
                "sequences" + ("" if plan.is_decode_only else " with prefill chunks")
            )
        if kv_indices.shape[0] > self.max_pages:
            raise ValueError(f"{kv_indices.shape[0]} pages exceed the {self.max_pages} planned")
        _plan_decode(self._wrapper, plan, kv_indices, geometry)

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor,
            k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:  # fmt: skip
        return self._wrapper.run(query, kv_cache, k_scale=k_scale, v_scale=v_scale)


class FlashInferWrappers:
    """FlashInfer's batch prefill (ragged queries, paged KV) and batch decode wrappers over
    one shared workspace, planned once per step and run once per layer.

    A decode-only step uses the decode wrapper; any step with a prefill chunk runs all its
    rows (decode rows included) through the prefill wrapper, which handles query_len 1 too.
    """

    def __init__(self, device: torch.device, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES):
        self._flashinfer = import_flashinfer()
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", backend=FLASHINFER_BACKEND
        )
        self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_tensor_cores=True, backend=FLASHINFER_BACKEND
        )
        self._is_decode_only = False

    def plan(
        self,
        plan: PagedKVPlan,
        kv_indices: torch.Tensor,  # [num_pages] int32, device
        geometry: PlanGeometry,
    ) -> None:
        self._is_decode_only = plan.is_decode_only
        if plan.is_decode_only:
            _plan_decode(self._decode, plan, kv_indices, geometry)
            return
        self._prefill.plan(
            plan.qo_indptr,
            plan.kv_indptr,
            kv_indices,
            plan.kv_last_page_len,
            geometry.num_qo_heads,
            geometry.num_kv_heads,
            geometry.head_dim,
            geometry.block_size,
            causal=True,
            pos_encoding_mode="NONE",
            sm_scale=geometry.scale,
            q_data_type=geometry.q_dtype,
            kv_data_type=geometry.kv_dtype,
        )

    @property
    def workspace(self) -> torch.Tensor:
        """The float workspace, shared with the graph wrappers (one step runs at a time)."""
        return self._workspace

    def run(
        self,
        query: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        k_scale: float | None = None,  # FP8 caches: dequantisation scale of K
        v_scale: float | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        wrapper = self._decode if self._is_decode_only else self._prefill
        return wrapper.run(query, kv_cache, k_scale=k_scale, v_scale=v_scale)


def compile_kernels(device: torch.device, geometry: PlanGeometry) -> None:
    """JIT-compile (or load from FlashInfer's cache) the one module this geometry runs on,
    by planning and running a two-token prefill over a one-page cache. Serving starts
    without it; it moves the first request's compile wait to wherever this is called."""
    wrappers = FlashInferWrappers(device, workspace_bytes=16 * 1024 * 1024)
    plan = build_paged_kv_plan([2], [2], geometry.block_size, 1, pin_memory=True)
    cache = torch.zeros(1, 2, geometry.block_size, geometry.num_kv_heads, geometry.head_dim,
                        dtype=geometry.kv_dtype, device=device)  # fmt: skip
    block_tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    wrappers.plan(plan, gather_page_indices(block_tables, plan), geometry)
    query = torch.zeros(2, geometry.num_qo_heads, geometry.head_dim, dtype=geometry.q_dtype,
                        device=device)  # fmt: skip
    wrappers.run(query, cache)
    torch.cuda.synchronize(device)
