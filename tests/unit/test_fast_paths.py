"""The CPU fast paths are exact rewrites of the reference math (parity depends on it)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.device_config import resolve_dtype
from engine.models.layers import RMSNorm, apply_rotary, apply_rotary_folded, rotary_tables
from engine.protocol import SamplingParams
from engine.request import Request


@pytest.mark.parametrize("hidden,tokens", [(96, 1), (128, 33), (896, 64)])
def test_fused_rms_norm_is_bit_identical_in_float32(hidden, tokens):
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    x = torch.randn(tokens, hidden) * 3
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(x), reference)


@pytest.mark.parametrize("hidden,tokens", [(64, 5), (896, 1), (896, 70)])
def test_bfloat16_rms_norm_keeps_the_hf_order(hidden, tokens):
    norm = RMSNorm(hidden, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16) * 3
    x32 = x.float()
    reference = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
        torch.bfloat16
    )
    assert torch.equal(norm(x), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_rotary_is_bit_identical(dtype):
    x = torch.randn(9, 6, 32).to(dtype)
    freqs = torch.randn(9, 16)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert torch.equal(apply_rotary_folded(x, *rotary_tables(cos, sin)), apply_rotary(x, cos, sin))


def _decode_metadata(seq_lens: list[int], block_size: int) -> AttentionMetadata:
    tables = [[i * 4 + j for j in range(4)] for i in range(len(seq_lens))]
    slots = [
        tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size
        for i, n in enumerate(seq_lens)
    ]
    return AttentionMetadata(
        num_seqs=len(seq_lens),
        query_lens=[1] * len(seq_lens),
        seq_lens=seq_lens,
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        is_decode_only=True,
    )


def test_step_plan_is_built_once_per_metadata():
    backend = TorchAttentionBackend()
    cache = torch.zeros(8, 2, 4, 2, 8)
    q, kv = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    metadata = _decode_metadata([3, 5], block_size=4)
    backend.forward(q, kv, kv, cache, metadata, 0.5)
    plan = backend._plan
    backend.forward(q, kv, kv, cache.clone(), metadata, 0.5)  # the next layer
    assert backend._plan is plan
    backend.forward(q, kv, kv, cache, _decode_metadata([4, 6], block_size=4), 0.5)
    assert backend._plan is not plan


def test_token_ids_between_prompt_decode_and_straddle():
    request = Request("r", [1, 2, 3], SamplingParams())
    request.output_token_ids += [7, 8]
    assert request.token_ids_between(0, 2) == [1, 2]
    assert request.token_ids_between(3, 5) == [7, 8]
    assert request.token_ids_between(4, 5) == [8]
    assert request.token_ids_between(1, 4) == [2, 3, 7]


def test_auto_dtype_policy():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, "float32") == torch.float32
    assert resolve_dtype("auto", cpu, None) == torch.float32
    assert resolve_dtype("auto", cuda, "float32") == torch.bfloat16
    assert resolve_dtype("float32", cpu, "bfloat16") == torch.float32
    assert resolve_dtype("auto", cpu, "bfloat16") in (torch.bfloat16, torch.float32)


def test_the_engine_runs_one_intra_op_thread_with_a_gpu_unless_told():
    """On a GPU the engine's host tensor work is small, and parallel regions stall behind
    a busy core; on a CPU the model itself runs on those threads. The engine process sets
    them at its start (engine.process.set_intra_op_threads)."""
    from engine.config import EngineConfig
    from engine.process import set_intra_op_threads

    threads = torch.get_num_threads()
    try:
        set_intra_op_threads(EngineConfig(model="unused", device="cpu"))
        assert torch.get_num_threads() == threads  # torch's default
        set_intra_op_threads(EngineConfig(model="unused", device="cuda"))
        assert torch.get_num_threads() == 1
        set_intra_op_threads(EngineConfig(model="unused", device="cuda", num_threads=2))
        assert torch.get_num_threads() == 2
        set_intra_op_threads(EngineConfig(model="unused", device="cpu", num_threads=3))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
