"""FlashInfer glue on CPU: the CSR page table it builds from step metadata, read back by a
torch implementation of FlashInfer's semantics, must give the torch backend's attention.
(The real FlashInfer kernels are compared in tests/gpu/test_flashinfer_backend.py.)
"""

from __future__ import annotations

import importlib.util
import math
import types
from unittest import mock

import pytest
import torch

from engine.attention import get_attention_backend
from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from kernels import reference
from kernels.flashinfer_glue import (
    DEFAULT_WORKSPACE_BYTES,
    PlanGeometry,
    build_paged_kv_plan,
    gather_page_indices,
    split_kv_workspace_bytes,
    use_tensor_max_in,
)


def random_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                       seed=0):  # fmt: skip
    """Sequences with `context_lens` tokens already cached (random K/V anywhere in a shuffled
    block pool) and `query_lens` new tokens each. Returns q, k, v, kv_cache, metadata."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 3
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(pages)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)  # [S, width]
    slots = []
    for row, (context, seq_len) in enumerate(zip(context_lens, seq_lens, strict=True)):
        blocks = [pool.pop() for _ in range(pages[row])]
        block_tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(context, seq_len)
        ]
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)  # [T, H, D]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)  # [T, KVH, D]
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)  # [T, KVH, D]
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    metadata = AttentionMetadata(
        num_seqs=len(query_lens),
        query_lens=list(query_lens),
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        is_decode_only=all(n == 1 for n in query_lens),
    )
    return query, key, value, kv_cache, metadata


def test_plan_matches_the_documented_example():
    plan = build_paged_kv_plan([3, 1], [6, 9], block_size=4, block_table_width=3)
    block_tables = torch.tensor([[7, 2, 0], [5, 0, 8]], dtype=torch.int32)
    assert plan.qo_indptr.tolist() == [0, 3, 4]
    assert plan.kv_indptr.tolist() == [0, 2, 5]
    assert plan.kv_last_page_len.tolist() == [2, 1]
    assert gather_page_indices(block_tables, plan).tolist() == [7, 2, 5, 0, 8]
    assert not plan.is_decode_only
    assert plan.num_seqs == 2
    assert build_paged_kv_plan([1, 1], [4, 5], 4, 2).kv_last_page_len.tolist() == [4, 1]
    assert build_paged_kv_plan([1, 1], [4, 5], 4, 2).is_decode_only


@pytest.mark.parametrize(
    "query_lens,seq_lens,width,message",
    [
        ([1], [1, 2], 2, "sequence lengths"),
        ([3], [2], 2, "query_len"),
        ([0], [2], 2, "query_len"),
        ([1], [9], 2, "blocks"),
    ],
)
def test_plan_rejects_inconsistent_lengths(query_lens, seq_lens, width, message):
    with pytest.raises(ValueError, match=message):
        build_paged_kv_plan(query_lens, seq_lens, block_size=4, block_table_width=width)


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1], [0, 5, 16]),  # decode only
        ([7, 1, 3, 1], [0, 9, 4, 31]),  # mixed prefill chunks and decodes
        ([16], [16]),  # a chunk that starts and ends on block boundaries
    ],
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_csr_page_table_reproduces_torch_backend(query_lens, context_lens, num_heads, num_kv_heads):
    head_dim, block_size = 16, 8
    query, key, value, kv_cache, metadata = random_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed=num_heads
    )
    scale = 1 / math.sqrt(head_dim)
    torch_cache = kv_cache.clone()
    expected = TorchAttentionBackend().forward(query, key, value, torch_cache, metadata, scale)

    reference.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    assert torch.equal(kv_cache, torch_cache)
    plan = build_paged_kv_plan(
        metadata.query_lens, metadata.seq_lens, block_size, metadata.block_tables.shape[1]
    )
    assert plan.is_decode_only == metadata.is_decode_only
    out = reference.paged_attention(
        query,
        kv_cache,
        plan.qo_indptr,
        plan.kv_indptr,
        gather_page_indices(metadata.block_tables, plan),
        plan.kv_last_page_len,
        scale,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fp8_scales_dequantize_in_the_reference():
    query, key, value, kv_cache, metadata = random_paged_batch([3, 1], [2, 6], 4, 2, 16, 4)
    scale, k_scale, v_scale = 0.25, 0.01, 0.02
    fp8_cache = reference.quantize_fp8(kv_cache, torch.tensor([k_scale]))
    fp8_cache[:, 1] = reference.quantize_fp8(kv_cache[:, 1], torch.tensor([v_scale]))
    reference.write_kv_cache(
        key,
        value,
        fp8_cache,
        metadata.slot_mapping,
        torch.tensor([k_scale]),
        torch.tensor([v_scale]),
    )
    dequantized = fp8_cache.float()
    dequantized[:, 0] *= k_scale
    dequantized[:, 1] *= v_scale
    plan = build_paged_kv_plan(
        metadata.query_lens, metadata.seq_lens, 4, metadata.block_tables.shape[1]
    )
    args = (plan.qo_indptr, plan.kv_indptr, gather_page_indices(metadata.block_tables, plan),
            plan.kv_last_page_len, scale)  # fmt: skip
    out = reference.paged_attention(query, fp8_cache, *args, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, reference.paged_attention(query, dequantized, *args))


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer present")
def test_flashinfer_backend_unavailable_without_flashinfer():
    with pytest.raises(ValueError, match="flashinfer"):
        get_attention_backend("flashinfer")


PLANNER_SOURCE = """
def longest(lengths):
    return max(lengths).item()

def biggest(*args, **kwargs):
    return max(*args, **kwargs)
"""


def test_planning_max_reduces_a_tensor_in_one_op_and_is_the_builtin_otherwise():
    """FlashInfer's plan() writes `max(kv_lens_host).item()`; the builtin walks the tensor
    row by row (~0.5 ms a step at 128 rows on the H100). The shadowing `max` must not
    iterate a tensor, and must answer every call as the builtin does."""
    planner = types.ModuleType("planner")
    exec(PLANNER_SOURCE, planner.__dict__)
    lengths = torch.tensor([5, 512, 7, 511], dtype=torch.int32)
    never_iterate = mock.patch.object(torch.Tensor, "__iter__", side_effect=AssertionError)
    with never_iterate, pytest.raises(AssertionError):
        planner.longest(lengths)  # the builtin iterates

    use_tensor_max_in(planner)
    with never_iterate:
        assert planner.longest(lengths) == 512
    assert planner.biggest([3, 9, 4]) == 9
    assert planner.biggest(7, 128) == 128
    assert planner.biggest([], default=-1) == -1
    assert planner.biggest(["ab", "c"], key=len) == "ab"
    assert planner.biggest(torch.tensor([[1, 2], [3, 4]]).flatten()).item() == 4
    with pytest.raises(ValueError):
        planner.biggest([])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def geometry(num_qo_heads: int, num_kv_heads: int, head_dim: int = 128) -> PlanGeometry:
    return PlanGeometry(num_qo_heads, num_kv_heads, head_dim, 16, head_dim**-0.5,
                        torch.bfloat16, torch.bfloat16)  # fmt: skip


def test_split_kv_workspace_follows_flashinfers_tile_arithmetic():
    """Qwen3-VL-30B-A3B's 32 query heads over 4 KV heads on 132 SMs: 66 split tiles of 128
    rows, 32 x 66 x 128 x 129 floats, past the recommended 128 MiB that failed on the H200
    (its 64 tiles took exactly 128 MiB for the partial outputs, nothing for the
    log-sum-exps). Qwen2-VL's 2B (12 over 2) and 7B (28 over 4) shapes fit in it."""
    moe = split_kv_workspace_bytes(geometry(32, 4), num_sms=132, max_graph_batch=128)
    assert moe == 4 * 32 * 66 * 128 * 129 + 32 > DEFAULT_WORKSPACE_BYTES
    for heads, kv_heads in [(12, 2), (28, 4)]:
        needed = split_kv_workspace_bytes(geometry(heads, kv_heads), 132, max_graph_batch=256)
        assert needed <= DEFAULT_WORKSPACE_BYTES
    # A decode graph of 512 rows pads to its own tiles: 8 x 512 packed rows in tiles of 16,
    # plus one per row after the first, more than the eager plan's 66 tiles of 128.
    wide = split_kv_workspace_bytes(geometry(32, 4), num_sms=132, max_graph_batch=512)
    assert wide == 4 * 32 * (256 + 511) * 16 * 129 + 32 > moe


def test_no_graphs_and_older_gpus_size_their_own_plans():
    """Without decode graphs (enforce_eager) only the eager plans count: a 1024-row graph
    term took 387 MiB where 133 were enough (fuzz57). Before sm80 a decode tile is 64
    query rows, not 16: Qwen2-VL-7B's 256-row graphs on a T4's 40 SMs need 249 MiB."""
    moe = geometry(32, 4)
    eager = split_kv_workspace_bytes(moe, num_sms=132, max_graph_batch=0)
    assert eager == split_kv_workspace_bytes(moe, num_sms=132, max_graph_batch=1)
    assert split_kv_workspace_bytes(moe, 132, max_graph_batch=1024) > 2 * eager
    turing = split_kv_workspace_bytes(geometry(28, 4), 40, max_graph_batch=256, compute_major=7)
    assert turing == 4 * 28 * (ceil_div(256 * 7, 64) + 255) * 64 * 129 + 32


def test_an_eager_engine_sizes_every_ranks_workspace_without_graphs():
    """The model runner passed 0 under --enforce-eager, but tensor-parallel shard workers
    passed the graph batch (engine/shard_worker.py): the rule now lives in the config both
    read."""
    from engine.config import EngineConfig

    assert EngineConfig(model="m", enforce_eager=True, max_num_seqs=64).max_graph_batch == 0
    assert EngineConfig(model="m", max_num_seqs=64).max_graph_batch == 64
    capped = EngineConfig(model="m", max_num_seqs=64, cuda_graph_max_batch_size=16)
    assert capped.max_graph_batch == 16
