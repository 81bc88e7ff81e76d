"""The CUDA-graph decode path (engine/cuda_graphs.py) on CPU: the same persistent buffers,
padding rows, scratch block and static attention metadata, run eagerly instead of replayed.
Greedy tokens must equal the eager engine's (which tests/parity/test_generate.py holds equal
to transformers), logprobs within float32 noise. The capture itself runs in tests/gpu.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.cuda_graphs import graph_batch_sizes, graph_max_seq_len
from engine.tiny_model import make_tiny_model

NUM_PROMPTS = 7


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("graphs"), seed=3)


def prompts() -> list:
    pixels = (np.arange(84 * 112 * 3).reshape(84, 112, 3) * 7) % 251
    image = Image.fromarray(pixels.astype(np.uint8))
    chat_with_image = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}],
            }
        ]
    }
    words = "the quick brown fox jumps over the lazy dog again and again"
    texts = [" ".join(words.split()[: 2 + 3 * i]) for i in range(NUM_PROMPTS - 1)]
    return [chat_with_image, *texts]


def generate(llm: LLM) -> list:
    """Different lengths, so the decode batch shrinks from 7 to 1 as requests finish."""
    return llm.generate(prompts(), [greedy(8 + 4 * i) for i in range(NUM_PROMPTS)])


def test_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 33]
    with pytest.raises(ValueError, match="positive"):
        graph_batch_sizes(0)


def test_flashinfer_graphs_serve_the_whole_context_by_default():
    """Decode steps past the bound run eagerly (16.8 against 3.3 ms a step for the 2B
    shape on the H100). FlashInfer's graphs read each sequence's own pages, so unset, the
    bound is the context; the torch backend pads keys to it, so it keeps 8192."""
    assert graph_max_seq_len(None, "flashinfer", 32768) == 32768
    assert graph_max_seq_len(None, "torch", 32768) == 8192
    assert graph_max_seq_len(None, "torch", 2048) == 2048
    assert graph_max_seq_len(4096, "flashinfer", 32768) == 4096
    assert graph_max_seq_len(65536, "flashinfer", 32768) == 32768


@pytest.mark.parametrize(
    "max_batch_size,max_seq_len",
    [
        (4, 8192),  # 7 sequences: eager until 4 or fewer decode; 3 pad to 4
        (16, 8192),  # every decode step in a graph, padded 7 -> 8
        (16, 40),  # histories past 40 tokens fall back to eager mid-generation
    ],
)
def test_graph_path_equals_eager(model_dir, monkeypatch, max_batch_size, max_seq_len):
    options = dict(dtype="float32", max_num_seqs=16, block_size=8)
    expected = generate(LLM(str(model_dir), **options))

    llm = LLM(
        str(model_dir),
        **options,
        cuda_graph_max_batch_size=max_batch_size,
        cuda_graph_max_seq_len=max_seq_len,
    )
    llm.engine.runner.enable_decode_graphs(use_cuda_graphs=False)
    graphs = llm.engine.runner.decode_graphs
    batch_sizes = []
    real_run = graphs.run
    monkeypatch.setattr(
        graphs, "run", lambda inputs: batch_sizes.append(inputs.num_seqs) or real_run(inputs)
    )
    got = generate(llm)

    assert batch_sizes, "no decode step went through the graph path"
    assert max(batch_sizes) <= max_batch_size
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        torch.testing.assert_close(
            [lp.logprob for lp in have.logprobs],
            [lp.logprob for lp in want.logprobs],
            atol=1e-5,
            rtol=0,
        )
    if max_seq_len < 100:
        assert len(batch_sizes) < len(expected[-1].token_ids) - 1  # some steps ran eagerly


def test_padding_rows_only_touch_the_scratch_block(model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=8, block_size=8)
    runner = llm.engine.runner
    scheduler_blocks = [cache[: runner.num_kv_blocks].clone() for cache in runner.kv_caches]
    runner.enable_decode_graphs(use_cuda_graphs=False)
    # Capture ran padding-only batches of every size: the pool itself must be untouched.
    for before, cache in zip(scheduler_blocks, runner.kv_caches, strict=True):
        assert torch.equal(before, cache[: runner.num_kv_blocks])
        assert cache[runner.num_kv_blocks].abs().sum() > 0  # the scratch block was written


def test_qwen3_vl_goes_through_the_graph_path_as_eagerly(tmp_path, monkeypatch):
    """Qwen3's q/k head norms and interleaved M-RoPE on the padded, static-buffer path
    (the picture's deepstack rows are prefill's: decode steps carry none)."""
    model_dir = make_tiny_model(tmp_path, seed=3, size="tiny-qwen3-vl")
    options = dict(dtype="float32", max_num_seqs=16, block_size=8)
    expected = generate(LLM(str(model_dir), **options))
    llm = LLM(str(model_dir), **options, cuda_graph_max_batch_size=16)
    llm.engine.runner.enable_decode_graphs(use_cuda_graphs=False)
    graphs = llm.engine.runner.decode_graphs
    steps = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda inputs: steps.append(1) or real_run(inputs))
    got = generate(llm)
    assert steps, "no decode step went through the graph path"
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
