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


def test_small_batch_linears_match_torch_path(tmp_path, monkeypatch):
    """`--small-batch-linear-rows 8` on top of the fused kernels: the decode steps of these
    four prompts (4 rows) run every projection through the matrix-vector kernel, prefill
    chunks through `F.linear`; float32 gives the torch path's tokens."""
    import kernels.triton.small_batch_linear as kernel
    from engine.models.small_batch_linear import use_small_batch_linears

    model_dir = make_tiny_model(tmp_path, seed=2, size="tiny")
    prompts = make_prompts()[:4]
    llm = LLM(str(model_dir), num_kv_blocks=128)
    expected = llm.generate(prompts, GREEDY)
    decoder = llm.engine.runner.model.model
    assert use_small_batch_linears(decoder, max_rows=8) == 4 * len(decoder.layers)
    monkeypatch.setattr(layers, "use_triton", lambda x: True)
    launches = []
    real_kernel = kernel.small_batch_linear
    monkeypatch.setattr(kernel, "small_batch_linear",
                        lambda *args: launches.append(1) or real_kernel(*args))  # fmt: skip
    ours = llm.generate(prompts, GREEDY)
    assert len(launches) >= 4 * len(decoder.layers) * (GREEDY.max_tokens - 1)
    assert [r.token_ids for r in ours] == [r.token_ids for r in expected]
    for mine, theirs in zip(ours, expected, strict=True):
        for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
