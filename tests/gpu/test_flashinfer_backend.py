"""FlashInfer backend vs the torch reference backend on random paged inputs (CUDA only)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")
pytest.importorskip("triton")

from engine.attention.base import AttentionMetadata, AttentionShape  # noqa: E402
from engine.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kernels import reference  # noqa: E402

DEVICE = torch.device("cuda")


def random_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                       dtype, seed=0):  # fmt: skip
    """`context_lens` cached tokens (random K/V in a shuffled block pool) plus `query_lens`
    new tokens per sequence. Returns q, k, v, kv_cache, metadata, all on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 5
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)  # [S, width]
    slots = []
    for row, (context, seq_len) in enumerate(zip(context_lens, seq_lens, strict=True)):
        blocks = [pool.pop() for _ in range(pages[row])]
        block_tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(context, seq_len)
        ]
    num_tokens = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    query = randn(num_tokens, num_heads, head_dim)  # [T, H, D]
    key = randn(num_tokens, num_kv_heads, head_dim)  # [T, KVH, D]
    value = randn(num_tokens, num_kv_heads, head_dim)  # [T, KVH, D]
    kv_cache = randn(num_blocks, 2, block_size, num_kv_heads, head_dim)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    metadata = AttentionMetadata(
        num_seqs=len(query_lens),
        query_lens=list(query_lens),
        seq_lens=seq_lens,
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        is_decode_only=all(n == 1 for n in query_lens),
    )
    return query, key, value, kv_cache, metadata


def shape_of(query, kv_cache, scale) -> AttentionShape:
    return AttentionShape(
        num_heads=query.shape[1],
        num_kv_heads=kv_cache.shape[3],
        head_dim=query.shape[2],
        block_size=kv_cache.shape[2],
        scale=scale,
        dtype=query.dtype,
        kv_cache_dtype=kv_cache.dtype,
    )


BATCHES = [
    ([1, 1, 1, 1], [0, 17, 40, 129]),  # decode only
    ([37, 1, 5, 1], [0, 63, 16, 200]),  # mixed prefill chunks and decodes
    ([128], [0]),  # one fresh prompt
]


# Head dim 128 and bf16 only: FlashInfer JIT-compiles a module (about a minute) per head dim
# and dtype, and these are the ones Qwen2-VL serves with. MHA and GQA share the module.
@pytest.mark.parametrize("query_lens,context_lens", BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 8, 128), (16, 2, 128)])
def test_matches_torch_backend(query_lens, context_lens, num_heads, num_kv_heads, head_dim):
    dtype = torch.bfloat16
    block_size = 16
    query, key, value, kv_cache, metadata = random_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = 1 / math.sqrt(head_dim)
    torch_cache = kv_cache.clone()
    expected = TorchAttentionBackend().forward(query, key, value, torch_cache, metadata, scale)
    backend = FlashInferAttentionBackend(shape_of(query, kv_cache, scale))
    out = backend.forward(query, key, value, kv_cache, metadata, scale)
    assert torch.equal(kv_cache, torch_cache)  # same cache write
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # A second layer of the same step reuses the plan and still agrees.
    out_again = backend.forward(query, key, value, kv_cache, metadata, scale)
    torch.testing.assert_close(out_again, out)


def test_a_wide_query_group_splits_its_prefill_within_the_workspace():
    """Qwen3-VL-30B-A3B's 32 query heads over 4 KV heads: a prefill whose split-KV tiles
    fill the device's CTAs needed more than FlashInfer's recommended 128 MiB workspace on
    an H200, and failed "Buffer overflow when allocating memory for batch_prefill_tmp_s".
    A 512-token prompt is 32 tiles of 128 packed query rows; on 132 SMs (66 tiles) its keys
    split in two, 64 tiles, whose partial outputs alone take the 128 MiB."""
    query, key, value, kv_cache, metadata = random_paged_batch(
        [512], [0], 32, 4, 128, 16, torch.bfloat16
    )
    expected = TorchAttentionBackend().forward(
        query, key, value, kv_cache.clone(), metadata, 1 / math.sqrt(128)
    )
    backend = FlashInferAttentionBackend(shape_of(query, kv_cache, 1 / math.sqrt(128)))
    out = backend.forward(query, key, value, kv_cache, metadata, 1 / math.sqrt(128))
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_replans_for_a_new_step():
    backend = None
    for seed, (query_lens, context_lens) in enumerate(BATCHES):
        query, key, value, kv_cache, metadata = random_paged_batch(
            query_lens, context_lens, 8, 2, 128, 16, torch.bfloat16, seed=seed
        )
        backend = backend or FlashInferAttentionBackend(shape_of(query, kv_cache, 0.125))
        expected = TorchAttentionBackend().forward(
            query, key, value, kv_cache.clone(), metadata, 0.125
        )
        out = backend.forward(query, key, value, kv_cache, metadata, 0.125)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("query_lens,context_lens", BATCHES[:2])
def test_fp8_cache_matches_dequantized_reference(query_lens, context_lens):
    query, key, value, kv_cache, metadata = random_paged_batch(
        query_lens, context_lens, 8, 2, 128, 16, torch.bfloat16
    )
    k_scale, v_scale = 4.0 / 448, 4.0 / 448
    fp8_cache = torch.empty_like(kv_cache, dtype=reference.FP8_DTYPE)
    fp8_cache[:, 0] = reference.quantize_fp8(
        kv_cache[:, 0], torch.full((1,), k_scale, device=DEVICE)
    )
    fp8_cache[:, 1] = reference.quantize_fp8(
        kv_cache[:, 1], torch.full((1,), v_scale, device=DEVICE)
    )
    backend = FlashInferAttentionBackend(
        shape_of(query, fp8_cache, 1 / math.sqrt(128)), k_scale=k_scale, v_scale=v_scale
    )
    out = backend.forward(query, key, value, fp8_cache, metadata, 1 / math.sqrt(128))
    # Reference: the torch backend over the dequantized cache (read after the FP8 write),
    # with the new K/V as they round-trip through FP8.
    k_scales = torch.tensor([k_scale], device=DEVICE)
    v_scales = torch.tensor([v_scale], device=DEVICE)
    dequantized = fp8_cache.float()
    dequantized[:, 0] *= k_scale
    dequantized[:, 1] *= v_scale
    key_fp8 = reference.dequantize_fp8(reference.quantize_fp8(key, k_scales), k_scales)
    value_fp8 = reference.dequantize_fp8(reference.quantize_fp8(value, v_scales), v_scales)
    expected = TorchAttentionBackend().forward(
        query.float(), key_fp8, value_fp8, dequantized, metadata, 1 / math.sqrt(128)
    )
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_graph_decode_replays_new_page_tables():
    """One decode graph of 4 rows, captured once, replayed over two different batches whose
    buffers and plan change between replays: each replay equals the torch backend."""
    num_heads, num_kv_heads, head_dim, block_size, width = 8, 2, 128, 16, 16
    scale = 1 / math.sqrt(head_dim)
    query_lens = [1, 1, 1, 1]
    static = random_paged_batch(query_lens, [3, 40, 100, 7], num_heads, num_kv_heads,
                                head_dim, block_size, torch.bfloat16, seed=1)  # fmt: skip
    query, key, value, kv_cache, _ = static
    buffers = {
        "block_tables": torch.zeros(4, width, dtype=torch.int32, device=DEVICE),
        "seq_lens": torch.ones(4, dtype=torch.int32, device=DEVICE),
        "slot_mapping": torch.zeros(4, dtype=torch.int64, device=DEVICE),
    }

    def static_metadata(seq_lens):
        return AttentionMetadata(
            num_seqs=4,
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=torch.arange(5, dtype=torch.int32, device=DEVICE),
            seq_lens_tensor=buffers["seq_lens"],
            block_tables=buffers["block_tables"],
            slot_mapping=buffers["slot_mapping"],
            is_decode_only=True,
            graph_max_seq_len=width * block_size,
        )

    def load(batch):
        buffers["block_tables"].zero_()
        buffers["block_tables"][:, : batch.block_tables.shape[1]] = batch.block_tables
        buffers["seq_lens"].copy_(batch.seq_lens_tensor)
        buffers["slot_mapping"].copy_(batch.slot_mapping)
        return static_metadata(batch.seq_lens)

    backend = FlashInferAttentionBackend(shape_of(query, kv_cache, scale))
    static_q, static_k, static_v = query.clone(), key.clone(), value.clone()
    cache = torch.zeros(kv_cache.shape[0] + 64, *kv_cache.shape[1:], dtype=kv_cache.dtype,
                        device=DEVICE)  # fmt: skip
    metadata = load(static[4])
    backend.plan_cuda_graph(metadata)
    backend.forward(static_q, static_k, static_v, cache, metadata, scale)  # warm-up
    torch.cuda.synchronize()
    backend.plan_cuda_graph(metadata)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(static_q, static_k, static_v, cache, metadata, scale)
    for seed, context_lens in [(2, [0, 17, 129, 200]), (3, [63, 1, 5, 31])]:
        q, k, v, batch_cache, batch = random_paged_batch(
            query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
            torch.bfloat16, seed=seed,
        )  # fmt: skip
        cache[: batch_cache.shape[0]] = batch_cache
        expected = TorchAttentionBackend().forward(q, k, v, batch_cache.clone(), batch, scale)
        static_q.copy_(q), static_k.copy_(k), static_v.copy_(v)
        backend.plan_cuda_graph(load(batch))
        graph.replay()
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_back_to_back_plans_while_the_device_is_busy():
    """Overlap scheduling plans step N+1 before the device has reached step N. FlashInfer's
    plan() stages its tables in one pinned host buffer per wrapper and queues the copy to
    the device, so planning again must wait for the previous copy, or step N runs with
    step N+1's tables. Two decode batches (same wrapper, different shapes) are planned and
    run while the device is still busy with earlier work."""
    scale = 1 / math.sqrt(128)
    batches = [
        random_paged_batch(query_lens, context_lens, 8, 2, 128, 16, torch.bfloat16, seed=seed)
        for seed, (query_lens, context_lens) in enumerate(
            [([1, 1, 1, 1], [0, 17, 40, 129]), ([1, 1], [300, 5])], start=20
        )
    ]
    expected = [
        TorchAttentionBackend().forward(q, k, v, cache.clone(), metadata, scale)
        for q, k, v, cache, metadata in batches
    ]
    backend = FlashInferAttentionBackend(shape_of(batches[0][0], batches[0][3], scale))
    backend.forward(*batches[0], scale)  # kernels loaded outside the busy stretch
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second: the step still running
    outputs = [  # a new metadata object is a new step: planned again
        backend.forward(q, k, v, cache, dataclasses.replace(metadata), scale)
        for q, k, v, cache, metadata in batches
    ]
    torch.cuda.synchronize()
    for out, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("query_lens,context_lens", BATCHES[:2])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, reference.FP8_DTYPE], ids=["bf16", "fp8"])
def test_fused_rotary_kv_write_equals_the_two_kernels(query_lens, context_lens, cache_dtype):
    """`rotate_and_forward` with rotary and the K/V write in one kernel: the same cache bytes
    and the same attention output as rotating first and writing in `forward`."""
    from engine.models.layers import rotary_tables

    query, key, value, kv_cache, metadata = random_paged_batch(
        query_lens, context_lens, 12, 2, 128, 16, torch.bfloat16
    )
    kv_cache = kv_cache.to(cache_dtype)
    angles = torch.rand(query.shape[0], 64, device=DEVICE) * 500
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = rotary_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
    scale = 0.125
    outputs, caches = [], []
    for fused in (True, False):
        qk = torch.cat((query, key), dim=1)  # [T, H + KVH, D]
        cache = kv_cache.clone()
        backend = FlashInferAttentionBackend(shape_of(query, cache, scale), 0.02, 0.03)
        backend.fuse_rotary_kv_write = fused
        outputs.append(backend.rotate_and_forward(qk, value, cos, sin, cache, metadata, scale))
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert torch.equal(outputs[0], outputs[1])
