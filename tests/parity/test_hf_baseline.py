"""bench/hf_baseline.py: transformers generate() in static batches, on the tiny checkpoint.

Structure only, no timing thresholds: one TTFT per request, exactly N tokens each, a later
batch's first token after the earlier batch ended; and the batched, left-padded greedy
tokens equal Tessera's, so the baseline decodes the same requests the same way.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from bench.datasets import DatasetConfig, make_requests  # noqa: E402
from bench.hf_baseline import (  # noqa: E402
    BaselineConfig,
    conversation,
    format_baseline,
    main,
    run_baseline,
)
from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402

NUM_NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf_baseline"), seed=0)


def test_batches_structure_and_tokens(tiny):
    dataset = DatasetConfig(dataset="image", num_requests=6, input_len=16, image_size=(112, 84))
    config = BaselineConfig(
        model_dir=str(tiny), dataset=dataset, batch_size=4, max_new_tokens=NUM_NEW
    )
    result = run_baseline(config)

    assert len(result.ttfts_s) == len(result.records) == 6
    assert [r.num_output_tokens for r in result.records] == [NUM_NEW] * 6
    assert [len(ids) for ids in result.token_ids] == [NUM_NEW] * 6
    first, second = result.records[:4], result.records[4:]
    assert min(r.ttft_s for r in second) >= max(r.e2e_s for r in first)
    assert min(r.ttft_s for r in second) > max(r.ttft_s for r in first)
    for record in result.records:
        assert 0 < record.ttft_s <= record.e2e_s <= result.duration_s
        assert len(record.itl_s) == NUM_NEW - 1
    assert result.output_throughput > 0
    assert "Output token throughput" in format_baseline(config, result)

    # Left padding and batching change nothing: the same prompts (padding not counted) and
    # the same greedy tokens as Tessera's.
    prompts = []
    for request in make_requests(dataset):
        item = conversation(request)
        image, text = item.images[0], item.messages[0]["content"][1]
        prompts.append(
            {"messages": [{"role": "user", "content": [{"type": "image", "image": image}, text]}]}
        )
    greedy = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    ours = LLM(str(tiny), num_kv_blocks=128).generate(prompts, greedy)
    assert [len(r.prompt_token_ids) for r in ours] == [r.num_prompt_tokens for r in result.records]
    assert [tuple(r.token_ids) for r in ours] == list(result.token_ids)


def test_cli_writes_the_serving_benchmark_json(tiny, tmp_path, capsys):
    out = tmp_path / "baseline.json"
    argv = [str(tiny), "--dataset", "text", "--num-requests", "3", "--batch-size", "2"]
    argv += ["--max-new-tokens", "3", "--input-len", "8", "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["backend"] == "transformers"
    assert data["summary"]["completed"] == 3
    assert data["summary"]["total_output_tokens"] == 9
    ttfts = [request["ttft_s"] for request in data["requests"]]
    assert ttfts[0] == ttfts[1] < ttfts[2]
