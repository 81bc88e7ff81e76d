"""An FP8 (float8_e4m3fn, scale 1) KV cache against the float32 cache, greedy, in float32.

E4M3 keeps 3 mantissa bits (~3% relative error per K/V element), and the tiny random
checkpoints have flat next-token distributions (top token ~5%), so greedy continuations may
part where the float32 model is near a tie. The test holds the FP8 engine to: chosen-token
logprobs within LOGPROB_TOL while the tokens agree, and a first disagreement only where the
float32 run's own logprobs of the two tokens are within 2 * LOGPROB_TOL.
"""

from __future__ import annotations

import os
import sys

import pytest

from engine import LLM, SamplingParams
from engine.tiny_model import make_tiny_model

sys.path.insert(0, os.path.dirname(__file__))
from test_generate import make_prompts  # noqa: E402

NUM_NEW = 16
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=20)
# Measured (both checkpoints, both budgets): chosen-token |logprob diff| while tokens agree
# at most 0.51; float32 gap between the two tokens at a split at most 0.72 (the image prompt).
LOGPROB_TOL = 0.75
INDICES = [0, 1, 3, 4, 6]  # text, one image, raw text, a long text, a short text


@pytest.fixture(scope="module", params=[("tiny", 0), ("tiny2", 1)], ids=["tiny", "tiny2"])
def model_dir(request, tmp_path_factory):
    size, seed = request.param
    return make_tiny_model(tmp_path_factory.mktemp(f"fp8_{size}"), seed=seed, size=size)


@pytest.mark.parametrize("budget", [2048, 7])  # whole prompts; chunks that gather history
def test_fp8_cache_tracks_float32(model_dir, budget):
    prompts = [make_prompts()[i] for i in INDICES]
    options = dict(num_kv_blocks=128, dtype="float32", max_num_batched_tokens=budget)
    base = LLM(str(model_dir), **options).generate(prompts, GREEDY)
    fp8 = LLM(str(model_dir), kv_cache_dtype="fp8", **options).generate(prompts, GREEDY)
    num_agreed = 0
    for index, ours, theirs in zip(INDICES, fp8, base, strict=True):
        assert ours.error is None and theirs.error is None
        pairs = list(zip(ours.logprobs, theirs.logprobs, strict=True))
        agreed = next((n for n, (a, b) in enumerate(pairs) if a.token_id != b.token_id), NUM_NEW)
        num_agreed += agreed
        diffs = [abs(a.logprob - b.logprob) for a, b in pairs[:agreed]]
        print(f"prompt {index}: {agreed} tokens agree, max |diff| {max(diffs, default=0):.3f}")
        assert max(diffs, default=0.0) <= LOGPROB_TOL, f"prompt {index}"
        if agreed < NUM_NEW:
            ours_at, theirs_at = pairs[agreed]
            float32_top = dict(theirs_at.top)
            gap = theirs_at.logprob - float32_top.get(ours_at.token_id, float("-inf"))
            print(f"prompt {index}: float32 gap at the split {gap:.3f}")
            assert gap <= 2 * LOGPROB_TOL, f"prompt {index}: parted at a clear float32 choice"
    assert num_agreed >= NUM_NEW * len(INDICES) // 3
