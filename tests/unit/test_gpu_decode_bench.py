"""bench/gpu_decode.py's CPU smoke run: the bookkeeping a GPU run depends on."""

from __future__ import annotations

import json

import pytest

from bench import gpu_decode


def test_cpu_smoke_run_times_pure_decode_steps(tmp_path):
    # 4 prompts of 40 tokens through a 64-token budget: prefill takes several steps, so the
    # first prompts decode ahead of the last ones and must still have tokens left to time.
    # The tiny vocabulary ends in its special tokens, which the random prompts must avoid.
    out = tmp_path / "decode.json"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
        "--sizes", "tiny", "--model-root", str(tmp_path / "models"), "--modes", "eager",
        "graphs-openai-penalties",
        "--batch-sizes", "1", "4", "--context-len", "40", "--max-num-batched-tokens", "64",
        "--steps", "3", "--warmup-steps", "1", "--out", str(out),
        "--profile-dir", str(tmp_path / "profiles"), "--profile-batch-sizes", "4",
    ]  # fmt: skip
    assert gpu_decode.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["batch_size"]) for r in results] == [
        ("eager", 1), ("eager", 4), ("graphs-openai-penalties", 1),
        ("graphs-openai-penalties", 4),
    ]  # fmt: skip
    assert all(r["step_ms"] > 0 and r["forward_ms"] > 0 and r["floor_ms"] > 0 for r in results)
    assert results[1]["kv_bytes"] == 4 * results[0]["kv_bytes"]
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == [
        "tiny-eager-torch-b4.json.gz", "tiny-graphs-openai-penalties-torch-b4.json.gz"
    ]  # fmt: skip


def test_a_mixture_of_experts_floor_counts_the_experts_a_step_reads(tmp_path):
    """Of a mixture of experts the floor counts the experts that the step's tokens pick on
    average (E (1 - (1 - k / E)^B) of each sparse layer), not every expert."""
    assert gpu_decode.experts_read(128, 8, 1) == 8
    assert abs(gpu_decode.experts_read(128, 8, 32) - 111.8) < 0.05
    out, models = tmp_path / "decode.json", tmp_path / "models"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
        "--sizes", "tiny-qwen3-vl-moe", "--model-root", str(models), "--modes", "eager",
        "--batch-sizes", "1", "4", "--context-len", "8", "--steps", "2", "--warmup-steps", "1",
        "--out", str(out),
    ]  # fmt: skip
    assert gpu_decode.main(argv) == 0
    one, four = json.loads(out.read_text())["results"]
    text = json.loads((models / "tiny-qwen3-vl-moe" / "config.json").read_text())["text_config"]
    experts, top_k = text["num_experts"], text["num_experts_per_tok"]
    sparse = text["num_hidden_layers"] - len(text["mlp_only_layers"])
    per_expert = 3 * text["hidden_size"] * text["moe_intermediate_size"] * 4  # float32
    read = [gpu_decode.experts_read(experts, top_k, batch) for batch in (1, 4)]
    difference = sparse * per_expert * (read[1] - read[0])
    assert abs(four["weight_bytes"] - one["weight_bytes"] - difference) <= sparse


def test_the_setting_modes_set_their_setting_and_nothing_else():
    from engine.config import EngineConfig

    assert gpu_decode.MODE_SETTINGS == {
        "graphs-small-linear": {"small_batch_linear_rows": 8},
        "graphs-block64": {"block_size": 64},
    }
    for mode, settings in gpu_decode.MODE_SETTINGS.items():
        assert mode in gpu_decode.MODES
        EngineConfig(model="m", **settings)  # real settings, in range


@pytest.mark.parametrize("mode", [gpu_decode.UNFUSED_MODE, gpu_decode.TRITON_DECODE_MODE])
def test_the_switch_modes_switch_the_backends_built_inside_and_restore_the_defaults(
    monkeypatch, mode
):
    """flashinfer does not install here: a stand-in module holds the backend class."""
    import sys
    import types

    class Backend:
        fuse_rotary_kv_write = True
        triton_graph_decode = False

    module = types.ModuleType("engine.attention.flashinfer_backend")
    module.FlashInferAttentionBackend = Backend
    monkeypatch.setitem(sys.modules, "engine.attention.flashinfer_backend", module)
    assert mode in gpu_decode.MODES
    switches = gpu_decode.MODE_BACKEND_SWITCHES[mode]
    defaults = {name: getattr(Backend, name) for name in ("fuse_rotary_kv_write",
                                                           "triton_graph_decode")}  # fmt: skip
    with pytest.raises(RuntimeError), gpu_decode.backend_switches(switches):
        for name, value in switches.items():
            assert getattr(Backend, name) is value and value is not defaults[name]
        raise RuntimeError("the engine failed to build")
    assert {name: getattr(Backend, name) for name in defaults} == defaults


def test_the_fa3_mode_sets_flashinfers_backend_inside_and_restores_the_default():
    from kernels import flashinfer_glue

    assert gpu_decode.FA3_MODE in gpu_decode.MODES
    with gpu_decode.flashinfer_backend("graphs"):
        assert flashinfer_glue.FLASHINFER_BACKEND == "fa2"
    with pytest.raises(RuntimeError), gpu_decode.flashinfer_backend(gpu_decode.FA3_MODE):
        assert flashinfer_glue.FLASHINFER_BACKEND == "fa3"
        raise RuntimeError("the engine failed to build")
    assert flashinfer_glue.FLASHINFER_BACKEND == "fa2"
