"""Prepacked oneDNN linears are exact stand-ins for `F.linear` where they are used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu_prepack import PrepackedLinear, can_prepack, prepack_linears

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not can_prepack(CPU, torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)


def test_only_half_precision_cpu_weights_are_prepacked():
    assert not can_prepack(CPU, torch.float32)  # float32 stays on MKL, as in transformers
    assert not can_prepack(torch.device("meta"), torch.bfloat16)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 8, 70, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_is_bit_identical_to_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    packed = PrepackedLinear(linear)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        # Non-contiguous rows (a slice of a wider tensor) and a leading batch dim work too.
        wide = torch.randn(rows, 150, dtype=torch.bfloat16)[:, :96]
        assert torch.equal(packed(wide), F.linear(wide, linear.weight, linear.bias))
        assert torch.equal(
            packed(x.view(1, rows, 96)), F.linear(x, linear.weight, linear.bias)[None]
        )


@needs_bf16
def test_prepack_linears_swaps_every_linear_and_keeps_the_rest():
    model = nn.Sequential(
        nn.Linear(8, 16, dtype=torch.bfloat16),
        nn.LayerNorm(16, dtype=torch.bfloat16),
        nn.Sequential(nn.Linear(16, 4, bias=False, dtype=torch.bfloat16)),
    )
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        assert prepack_linears(model) == 2
        assert isinstance(model[0], PrepackedLinear) and isinstance(model[2][0], PrepackedLinear)
        assert isinstance(model[1], nn.LayerNorm)
        assert torch.equal(model(x), expected)


@needs_bf16
def test_bf16_engine_output_is_unchanged_by_prepacking(tmp_path, monkeypatch):
    """The whole bf16 engine (vision tower, decoder, LM head) gives bit-identical greedy
    tokens and logprobs with and without prepacked linears."""
    import numpy as np
    from PIL import Image

    import engine.model_runner as model_runner
    from engine import LLM, SamplingParams
    from engine.models.cpu_prepack import PrepackedLinear
    from engine.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "tiny", seed=3, size="tiny"))
    pixels = (np.arange(84 * 112 * 3).reshape(84, 112, 3) * 7 % 251).astype(np.uint8)
    image_prompt = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": Image.fromarray(pixels)},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ]
    }
    prompts = ["the quick brown fox", image_prompt]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)

    def run() -> tuple[list, list, bool]:
        llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=64)
        results = llm.generate(prompts, greedy)
        layer = llm.engine.runner.model.model.layers[0]
        return (
            [r.token_ids for r in results],
            [[lp.logprob for lp in r.logprobs] for r in results],
            isinstance(layer.mlp.gate_up_proj, PrepackedLinear),
        )

    tokens, logprobs, packed = run()
    monkeypatch.setattr(model_runner, "can_prepack", lambda device, dtype: False)
    plain_tokens, plain_logprobs, plain_packed = run()
    assert packed and not plain_packed
    assert tokens == plain_tokens
    assert logprobs == plain_logprobs
