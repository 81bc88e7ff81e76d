"""Decode steps replayed from CUDA graphs captured at start-up.

A decode step of n sequences (one token each, no media rows) runs the graph captured for
the smallest batch size B >= n. Its inputs go into persistent buffers, padded to B rows;
the attention backend is planned on the host (`plan_cuda_graph`); one `replay()` then runs
the whole decoder (embedding, every layer, final norm). Logits and sampling stay eager.

    batch sizes   1 2 4 8 16 24 32 ... (multiples of 8 up to the largest)
    buffers       int64 [5, Bmax]: input_ids (row 0), positions (rows 1-3), slot_mapping
                  (row 4), filled by ONE copy per step;
                  seq_lens [Bmax], block_tables [Bmax, W] int32     W = ceil(max_seq_len / block)

    rows          0 .. n-1   the step's sequences
                  n .. B-1   padding: token 0 at position 0, history of 1 token kept in the
                             scratch block (the KV block past the scheduler's pool), which
                             they all overwrite and nobody reads

A step with more sequences than the largest graph, a history longer than `max_seq_len`, a
media row or a prefill chunk runs eagerly. Graphs are captured largest first into one
memory pool, so the pool is as large as the largest graph needs and no larger.

Without CUDA (`use_cuda_graphs=False`) `run` calls the forward on the same padded buffers
and static metadata instead of replaying: tests on CPU cover everything but the capture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.device_io import copy_to_device
from engine.step_inputs import InFlightTokens

logger = logging.getLogger(__name__)


# The torch backend pads every graph's keys to the bound, so its cost grows with it.
TORCH_BACKEND_GRAPH_MAX_SEQ_LEN = 8192


def graph_max_seq_len(setting: int | None, attention_backend: str, max_model_len: int) -> int:
    """The longest history a decode graph serves (`cuda_graph_max_seq_len`; longer ones
    decode eagerly: 16.8 against 3.3 ms a step for the 2B shape at batch 1 on the H100,
    2026-11-23). Unset: the whole context with FlashInfer, whose kernels read each
    sequence's own pages (the bound only sizes the block-table buffers), and
    TORCH_BACKEND_GRAPH_MAX_SEQ_LEN with the torch backend."""
    if setting is None:
        flashinfer = attention_backend == "flashinfer"
        setting = max_model_len if flashinfer else TORCH_BACKEND_GRAPH_MAX_SEQ_LEN
    return min(setting, max_model_len)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including `max_batch_size`."""
    if max_batch_size < 1:
        raise ValueError(f"cuda_graph_max_batch_size must be positive, got {max_batch_size}")
    sizes = [size for size in (1, 2, 4) if size < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step on the host: row i is sequence i's single new token."""

    input_ids: list[int]
    positions: torch.Tensor  # [3, n] int64 M-RoPE positions (CPU)
    slot_mapping: list[int]
    block_tables: list[list[int]]  # each sequence's block ids, history order
    seq_lens: list[int]  # history length including this token
    in_flight: InFlightTokens | None = None  # rows whose token the previous step samples

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)


@dataclass
class _CapturedGraph:
    graph: torch.cuda.CUDAGraph | None  # None without CUDA: run() calls the forward
    hidden: torch.Tensor | None  # [B, hidden] the graph's output buffer


class DecodeGraphRunner:
    """Owns the persistent input buffers and one captured decode graph per batch size."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],  # per layer [num_blocks + 1, 2, block_size, KVH, D]
        attention: AttentionBackend,
        *,
        max_batch_size: int,
        max_seq_len: int,
        block_size: int,
        scratch_block: int,
        use_cuda_graphs: bool,
    ) -> None:
        if max_seq_len < 1:
            raise ValueError(f"cuda_graph_max_seq_len must be positive, got {max_seq_len}")
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.block_size = block_size
        self.width = -(-max_seq_len // block_size)  # block-table columns
        self.max_seq_len = self.width * block_size
        self.scratch_block = scratch_block
        self.use_cuda_graphs = use_cuda_graphs
        device = kv_caches[0].device
        size = self.batch_sizes[-1]
        # One int64 buffer for the per-token inputs, so a step fills them with one copy.
        self._token_inputs = torch.zeros(5, size, dtype=torch.long, device=device)  # [5, Bmax]
        self._input_ids = self._token_inputs[0]  # [Bmax]
        self._positions = self._token_inputs[1:4]  # [3, Bmax]
        self._slot_mapping = self._token_inputs[4]  # [Bmax]
        self._seq_lens = torch.ones(size, dtype=torch.int32, device=device)  # [Bmax]
        self._block_tables = torch.zeros(size, self.width, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, _CapturedGraph] = {}

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        return (
            bool(self._graphs)
            and num_seqs <= self.max_batch_size
            and (max_seq_len <= self.max_seq_len)
        )

    def capture(self) -> None:
        """Warms up and captures every batch size, largest first (one shared pool)."""
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        for size in reversed(self.batch_sizes):
            metadata = self._fill(_padding_inputs(0), size)
            self.attention.plan_cuda_graph(metadata)
            # Warm-up, outside the graph: lazy initialisation (cuBLAS handles, Triton
            # compilation, FlashInfer modules) must not happen during capture.
            self._forward(metadata, size)
            if not self.use_cuda_graphs:
                self._graphs[size] = _CapturedGraph(None, None)
                continue
            torch.cuda.synchronize()
            self.attention.plan_cuda_graph(metadata)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(metadata, size)
            self._graphs[size] = _CapturedGraph(graph, hidden)
        if self.use_cuda_graphs:
            torch.cuda.synchronize()
            logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def run(self, inputs: DecodeInputs) -> torch.Tensor:  # [n, hidden]
        """The decoder's output rows for `inputs` (a view of the graph's output buffer,
        valid until the next run)."""
        num_seqs = inputs.num_seqs
        size = next(size for size in self.batch_sizes if size >= num_seqs)
        metadata = self._fill(inputs, size)
        self.attention.plan_cuda_graph(metadata)
        captured = self._graphs[size]
        if captured.graph is None:
            return self._forward(metadata, size)[:num_seqs]
        captured.graph.replay()
        assert captured.hidden is not None
        return captured.hidden[:num_seqs]

    def _forward(self, metadata: AttentionMetadata, size: int) -> torch.Tensor:  # [B, hidden]
        return self.model.forward(
            self._input_ids[:size], self._positions[:, :size], self.kv_caches, metadata
        )

    def _fill(self, inputs: DecodeInputs, size: int) -> AttentionMetadata:
        """Copies `inputs` padded to `size` rows into the buffers (non-blocking on CUDA);
        returns the graph's static metadata with this run's host lists."""
        num_seqs, num_padding = inputs.num_seqs, size - inputs.num_seqs
        # Every column of the int64 buffer (padding past `size` too): one contiguous copy.
        token_inputs = np.zeros((5, self.max_batch_size), dtype=np.int64)  # ids, pos 0, 0
        token_inputs[0, :num_seqs] = inputs.input_ids
        token_inputs[1:4, :num_seqs] = inputs.positions.numpy()
        token_inputs[4, :num_seqs] = inputs.slot_mapping
        token_inputs[4, num_seqs:] = self.scratch_block * self.block_size
        seq_lens = inputs.seq_lens + [1] * num_padding
        tables = np.full((size, self.width), self.scratch_block, dtype=np.int32)
        for row, block_ids in enumerate(inputs.block_tables):  # numpy: ~1 us a row
            tables[row, : len(block_ids)] = block_ids
        copy_to_device(self._token_inputs, torch.from_numpy(token_inputs))
        if inputs.in_flight is not None:
            inputs.in_flight.write_into(self._input_ids)
        copy_to_device(self._seq_lens[:size], torch.tensor(seq_lens, dtype=torch.int32))
        copy_to_device(self._block_tables[:size], torch.from_numpy(tables))
        return AttentionMetadata(
            num_seqs=size,
            query_lens=[1] * size,
            seq_lens=seq_lens,
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens_tensor=self._seq_lens[:size],
            block_tables=self._block_tables[:size],
            slot_mapping=self._slot_mapping[:size],
            is_decode_only=True,
            graph_max_seq_len=self.max_seq_len,
        )


def _padding_inputs(num_seqs: int) -> DecodeInputs:
    """`num_seqs` rows of nothing: the capture-time batch, all padding once padded."""
    return DecodeInputs([], torch.zeros(3, num_seqs, dtype=torch.long), [], [], [])
