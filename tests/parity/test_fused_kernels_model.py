"""The decoder through the fused Triton kernels (add + RMSNorm, rotary in place, SiLU * up)
equals the torch path it replaces on CUDA. Here on CPU under TRITON_INTERPRET=1, by forcing
`use_triton`: float32, so both must give the same greedy tokens and near-equal logprobs."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from engine.models import layers  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.parity.test_generate import make_prompts  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("size,seed", [("tiny", 0), ("tiny2", 1)])
def test_fused_kernel_decoder_matches_torch_path(tmp_path, monkeypatch, size, seed):
    model_dir = make_tiny_model(tmp_path, seed=seed, size=size)
    prompts = make_prompts()[:4]  # text and images, one and two pictures
    llm = LLM(str(model_dir), num_kv_blocks=128)
    expected = llm.generate(prompts, GREEDY)
    calls = []

    def forced(x):
        calls.append(1)
        return True

    monkeypatch.setattr(layers, "use_triton", forced)
    fused = llm.generate(prompts, GREEDY)
    assert calls, "the fused kernels were not used"
    for ours, theirs in zip(fused, expected, strict=True):
        assert ours.error is None
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
