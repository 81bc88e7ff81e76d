"""TorchAttentionBackend against dense per-sequence attention over the full K/V history."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import check_attention_backend, get_attention_backend
from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.reference import FP8_DTYPE, dequantize_fp8, quantize_fp8

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_attention(q, k, v, scale):
    """q [Q, H, D]; k, v [L, KVH, D]; the queries are the last Q of the L positions."""
    q_len, seq_len = q.shape[0], k.shape[0]
    groups = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Q, L]
    visible = torch.arange(seq_len)[None, :] <= torch.arange(q_len)[:, None] + seq_len - q_len
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def fp8_round_trip(x):
    one = torch.ones(1)
    return dequantize_fp8(quantize_fp8(x, one), one)


class Pool:
    """Sequences over a shuffled block pool; each `step` checks one batch against dense attention."""

    def __init__(self, block_size, num_blocks=40, dtype=torch.float32):
        self.block_size = block_size
        self.cache = torch.zeros(num_blocks, 2, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.history = {}  # seq -> (k [L, KVH, D], v, blocks)
        self.gen = torch.Generator().manual_seed(1)

    def step(self, plan, backend=None, scale=None):
        """plan: list of (seq id, number of new tokens). Returns (backend out, dense out)."""
        backend = backend or TorchAttentionBackend()
        scale = scale or 1 / math.sqrt(HEAD_DIM)
        qs, ks, vs, slots, qlens, slens, tables, expected = [], [], [], [], [], [], [], []
        for seq, n in plan:
            k_old, v_old, blocks = self.history.get(
                seq,
                (
                    torch.zeros(0, NUM_KV_HEADS, HEAD_DIM),
                    torch.zeros(0, NUM_KV_HEADS, HEAD_DIM),
                    [],
                ),
            )
            q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=self.gen)
            k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
            v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
            k_all, v_all = torch.cat([k_old, k]), torch.cat([v_old, v])
            if self.cache.dtype == FP8_DTYPE:  # what an FP8 cache (scale 1) gives back
                k_all, v_all = fp8_round_trip(k_all), fp8_round_trip(v_all)
            while len(blocks) * self.block_size < len(k_all):
                blocks.append(self.free.pop())
            self.history[seq] = (k_all, v_all, blocks)
            start = len(k_old)
            slots += [
                blocks[j // self.block_size] * self.block_size + j % self.block_size
                for j in range(start, start + n)
            ]
            qs.append(q), ks.append(k), vs.append(v)
            qlens.append(n), slens.append(len(k_all)), tables.append(blocks)
            expected.append(dense_attention(q, k_all, v_all, scale))
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            num_seqs=len(plan),
            query_lens=qlens,
            seq_lens=slens,
            query_start_loc=torch.tensor([0] + qlens).cumsum(0).to(torch.int32),
            seq_lens_tensor=torch.tensor(slens, dtype=torch.int32),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            is_decode_only=all(n == 1 for n in qlens),
        )
        dtype = torch.float32 if self.cache.dtype == FP8_DTYPE else self.cache.dtype
        out = backend.forward(
            torch.cat(qs).to(dtype),
            torch.cat(ks).to(dtype),
            torch.cat(vs).to(dtype),
            self.cache,
            meta,
            scale,
        )
        return out, torch.cat(expected)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_chunked_prefill_mixed_and_decode_match_dense(block_size):
    pool = Pool(block_size)
    steps = [
        [(0, 5), (1, 1)],  # two fresh prefills (one of length 1)
        [(0, 7), (1, 1), (2, 3)],  # chunk over history + a decode + a new sequence
        [(0, 1), (1, 1), (2, 1)],  # all-decode fast path, ragged histories
        [(2, 1), (0, 1)],  # order differs from block-table order of earlier steps
        [(1, 4), (0, 1)],  # mixed again
        [(0, 1), (2, 6), (1, 1)],  # two batched decodes around a prefill chunk
    ]
    for plan in steps:
        out, expected = pool.step(plan)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kv_written_at_slots():
    pool = Pool(block_size=4)
    pool.step([(0, 6)])
    k_all, v_all, blocks = pool.history[0]
    for j in range(6):
        block, offset = blocks[j // 4], j % 4
        assert torch.equal(pool.cache[block, 0, offset], k_all[j])
        assert torch.equal(pool.cache[block, 1, offset], v_all[j])


def test_decode_ignores_garbage_beyond_history():
    pool = Pool(block_size=4)
    pool.step([(0, 2), (1, 9)])
    pool.cache[pool.history[0][2][0], :, 3:] = 1e4  # slot past seq 0's history after the decode
    out, expected = pool.step([(0, 1), (1, 1)])  # seq 0 has 3 tokens; slot 3 must be masked
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache():
    pool = Pool(block_size=4, dtype=torch.bfloat16)
    out, expected = pool.step([(0, 5), (1, 2)])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=5e-2)
    out, expected = pool.step([(0, 1), (1, 1)])
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=5e-2)


def test_fp8_cache_matches_dense_over_round_tripped_kv():
    pool = Pool(block_size=4, dtype=FP8_DTYPE)
    steps = [
        [(0, 5), (1, 2)],  # fresh prefills: attend over the new K/V round-tripped
        [(0, 3), (1, 1), (2, 6)],  # chunk over history, a decode, a new sequence
        [(0, 1), (1, 1), (2, 1)],  # all-decode fast path
    ]
    for plan in steps:
        out, expected = pool.step(plan)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    k_all, _, blocks = pool.history[2]
    assert pool.cache.dtype == FP8_DTYPE
    assert torch.equal(pool.cache[blocks[1], 0, 1].float(), k_all[5])  # stored as x / 1


def _one_sequence(query_len: int, seq_len: int, slots: list[int]) -> AttentionMetadata:
    """One sequence in blocks [3, 1] of a 4-slot-block cache."""
    return AttentionMetadata(
        num_seqs=1,
        query_lens=[query_len],
        seq_lens=[seq_len],
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        seq_lens_tensor=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([[3, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        is_decode_only=query_len == 1,
    )


def test_fp8_scales_divide_on_write_and_multiply_on_read():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, h, HEAD_DIM, generator=gen) for h in (NUM_HEADS, 2, 2))
    k, v = k * 8, v / 8  # scales matched to the magnitudes, as calibration would choose
    cache = torch.zeros(4, 2, 4, NUM_KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE)
    meta = _one_sequence(query_len=6, seq_len=6, slots=[12, 13, 14, 15, 4, 5])
    k_scale, v_scale = torch.tensor([2.0]), torch.tensor([0.125])
    backend = TorchAttentionBackend(k_scale=2.0, v_scale=0.125)
    out = backend.forward(q, k, v, cache, meta, 0.5)
    assert torch.equal(cache[1, 0, 1].float(), quantize_fp8(k[5], k_scale).float())
    assert torch.equal(cache[3, 1, 2].float(), quantize_fp8(v[2], v_scale).float())
    k_read = dequantize_fp8(quantize_fp8(k, k_scale), k_scale)
    v_read = dequantize_fp8(quantize_fp8(v, v_scale), v_scale)
    torch.testing.assert_close(out, dense_attention(q, k_read, v_read, 0.5), atol=1e-5, rtol=1e-5)
    # A decode over that history reads the same values back from the cache.
    meta = _one_sequence(query_len=1, seq_len=7, slots=[6])
    out = backend.forward(q[:1], k[:1], v[:1], cache, meta, 0.5)
    k_read, v_read = torch.cat([k_read, k_read[:1]]), torch.cat([v_read, v_read[:1]])
    torch.testing.assert_close(
        out, dense_attention(q[:1], k_read, v_read, 0.5), atol=1e-5, rtol=1e-5
    )


def test_factory():
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope")


@pytest.mark.parametrize(
    "name,device,dtype,message",
    [
        ("nope", "cpu", torch.float32, "unknown attention backend 'nope'"),
        ("flashinfer", "cpu", torch.bfloat16, "needs a CUDA device.*--attention-backend torch"),
        ("flashinfer", "cuda", torch.float32, "float16 and bfloat16 kernels only, not float32"),
    ],
)
def test_backend_checks_name_the_fix(name, device, dtype, message):
    with pytest.raises(ValueError, match=message):
        check_attention_backend(name, torch.device(device), dtype)


def test_backend_checks_pass_what_runs():
    check_attention_backend("torch", torch.device("cpu"), torch.float32)
    check_attention_backend("flashinfer", torch.device("cuda"), torch.bfloat16)


def test_engine_refuses_flashinfer_on_cpu_at_start_up(tmp_path):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path)
    config = EngineConfig(model=str(model_dir), device="cpu", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(config)
