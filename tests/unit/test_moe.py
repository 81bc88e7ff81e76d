"""The mixture-of-experts MLP's two ways to run its experts (engine/models/moe.py): the
grouped matmuls equal transformers' loop over experts within float32 rounding (often
exactly: the matmul kernels' blocking depends on the thread count) and within bfloat16's,
with experts nobody picked and experts every token picked; widths grouped_mm refuses
fall back to the loop. Against transformers itself:
tests/parity/test_text_models_parity.py and test_qwen3_vl_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model_config import MoEConfig
from engine.models.moe import SparseMoE, runs_without_sync

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch lacks grouped_mm")


def moe(hidden: int, width: int, dtype: torch.dtype, num_experts: int = 8, top_k: int = 2):
    config = MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=width,
                       normalize=True, sparse_layers=(0,))  # fmt: skip
    module = SparseMoE(hidden, config).to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * hidden**-0.5)
    return module


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_grouped_experts_equal_the_loop_within_float32_rounding(num_tokens):
    module = moe(64, 48, torch.float32)
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    experts = torch.stack([torch.randperm(8)[:2] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, 2)
    with torch.no_grad():
        grouped = module.experts.grouped(x, experts, weights)
        looped = module.experts.loop(x, experts, weights)
        torch.testing.assert_close(grouped, looped, atol=1e-6, rtol=1e-5)
        everyone_same = torch.tensor([[3, 5]] * num_tokens)  # six experts go unpicked
        torch.testing.assert_close(module.experts.grouped(x, everyone_same, weights),
                                   module.experts.loop(x, everyone_same, weights),
                                   atol=1e-6, rtol=1e-5)  # fmt: skip
        wrong = module.experts.grouped(x, experts.flip(1), weights)  # weights swapped
        assert not torch.allclose(wrong, looped, atol=1e-3)


def test_grouped_experts_track_the_loop_in_bfloat16():
    module = moe(64, 48, torch.bfloat16)
    x = torch.randn(16, 64).bfloat16()
    experts = torch.stack([torch.randperm(8)[:2] for _ in range(16)])
    weights = torch.rand(16, 2).bfloat16()
    with torch.no_grad():
        grouped = module.experts.grouped(x, experts, weights).float()
        looped = module.experts.loop(x, experts, weights).float()
    torch.testing.assert_close(grouped, looped, atol=3e-2, rtol=3e-2)


def test_the_path_by_dtype_and_width(monkeypatch):
    """float32 on a CPU runs transformers' loop (the parity tests' arithmetic); bfloat16
    runs grouped."""
    for dtype, expected in ((torch.float32, "loop"), (torch.bfloat16, "grouped")):
        module = moe(64, 48, dtype)
        called = []
        for name in ("loop", "grouped"):
            real = getattr(module.experts, name)
            monkeypatch.setattr(module.experts, name,
                                lambda *a, _n=name, _r=real, _c=called: _c.append(_n) or _r(*a))  # fmt: skip
        with torch.no_grad():
            module(torch.randn(4, 64).to(dtype))
        assert called == [expected], dtype


def test_widths_grouped_mm_refuses_run_the_loop(monkeypatch):
    module = moe(60, 42, torch.bfloat16)  # 42 x 2 bytes is no multiple of 16
    called = []
    monkeypatch.setattr(module.experts, "grouped", lambda *a: called.append(1))
    x = torch.randn(4, 60).bfloat16()
    with torch.no_grad():
        out = module(x)
    assert not called and out.shape == (4, 60)
    assert module.experts.use_grouped  # the shape was refused, not the operator


def test_only_cuda_decodes_a_mixture_of_experts_in_graphs():
    """The runner captures decode graphs where `runs_without_sync` holds: any model without
    experts; never a CPU (tests/gpu/test_engine_gpu.py probes a GPU)."""
    assert runs_without_sync(torch.nn.Linear(4, 4), torch.bfloat16, torch.device("cpu"))
    model = torch.nn.Sequential(moe(64, 48, torch.bfloat16))
    assert not runs_without_sync(model, torch.bfloat16, torch.device("cpu"))
