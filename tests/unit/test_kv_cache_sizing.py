"""KV-cache sizing (engine/kv_cache_sizing.py): the arithmetic, the profiled step, the
settings. The CUDA measurement itself is tests/gpu/test_kv_cache_sizing_cuda.py."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.attention import get_attention_backend
from engine.config import EngineConfig
from engine.kv_cache_sizing import (
    GIB,
    DeviceMemoryUse,
    MemoryBudgetError,
    allocate_kv_caches,
    blocks_in,
    check_free_at_start,
    encoder_cache_bytes,
    kv_block_bytes,
    kv_cache_bytes,
    largest_frame_grid,
    profile_kv_cache_bytes,
    run_largest_step,
)
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.models.loader import load_model
from engine.multimodal.image_processor import ImageProcessorConfig, smart_resize
from engine.tiny_model import make_tiny_model
from server.settings import SettingsError, load_settings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv_sizing"))


def test_block_bytes_count_k_and_v_of_every_layer(model_dir):
    mc = ModelConfig.from_model_dir(model_dir)
    per_token = 2 * mc.num_key_value_heads * mc.head_dim * mc.num_hidden_layers
    assert kv_block_bytes(mc, 16, torch.bfloat16) == 16 * per_token * 2
    assert kv_block_bytes(mc, 16, torch.float8_e4m3fn) == 16 * per_token


def test_blocks_in_keeps_one_for_scratch_and_never_more_than_useful():
    assert blocks_in(10 * 1000, 1000, useful_blocks=100) == 9
    assert blocks_in(10 * 1000 + 999, 1000, useful_blocks=100) == 9
    assert blocks_in(10 * 1000, 1000, useful_blocks=4) == 4
    assert blocks_in(500, 1000, useful_blocks=4) == 1


def test_the_kv_cache_gets_the_budget_less_peak_and_non_torch_memory():
    use = DeviceMemoryUse(total=80 * GIB, used_at_start=GIB, torch_peak=6 * GIB, non_torch=GIB)
    assert kv_cache_bytes(use, 0.9, block_bytes=1 << 20) == int(0.9 * 80 * GIB) - 7 * GIB
    # Memory other processes held at the start is not this engine's to count.
    busy = DeviceMemoryUse(total=80 * GIB, used_at_start=30 * GIB, torch_peak=6 * GIB, non_torch=0)
    assert kv_cache_bytes(busy, 0.5, block_bytes=1 << 20) == 34 * GIB


def test_the_encoder_cache_is_kept_aside_at_its_full_width(tmp_path):
    config = EngineConfig(model="unused", encoder_cache_tokens=1000)
    qwen2_vl = ModelConfig.from_model_dir(make_tiny_model(tmp_path / "a", size="tiny"))
    qwen3_vl = ModelConfig.from_model_dir(make_tiny_model(tmp_path / "b", size="tiny-qwen3-vl"))
    text = ModelConfig.from_model_dir(make_tiny_model(tmp_path / "c", size="tiny-qwen2"))
    assert encoder_cache_bytes(qwen2_vl, config, torch.bfloat16) == 1000 * 128 * 2
    assert encoder_cache_bytes(qwen3_vl, config, torch.bfloat16) == 1000 * 128 * 3 * 2
    assert encoder_cache_bytes(text, config, torch.bfloat16) == 0
    use = DeviceMemoryUse(total=80 * GIB, used_at_start=0, torch_peak=6 * GIB, non_torch=0)
    assert kv_cache_bytes(use, 0.5, 1 << 20, reserved=GIB) == 33 * GIB
    with pytest.raises(MemoryBudgetError, match="encoder-cache-tokens"):
        kv_cache_bytes(use, 0.5, 1 << 20, reserved=34 * GIB)


def test_no_room_for_the_kv_cache_is_an_error_naming_the_fixes():
    use = DeviceMemoryUse(total=24 * GIB, used_at_start=GIB, torch_peak=21 * GIB, non_torch=GIB)
    with pytest.raises(MemoryBudgetError) as raised:
        kv_cache_bytes(use, 0.9, block_bytes=1 << 20)
    message = str(raised.value)
    assert "21.00 GiB" in message and "--gpu-memory-utilization" in message
    assert "--kv-cache-memory-gib" in message and "--max-num-batched-tokens" in message
    # Room for exactly two blocks (one to use, the scratch block) is enough.
    tight = DeviceMemoryUse(total=100 << 20, used_at_start=0, torch_peak=48 << 20, non_torch=0)
    assert kv_cache_bytes(tight, 0.5, block_bytes=1 << 20) == 2 << 20
    with pytest.raises(MemoryBudgetError):
        kv_cache_bytes(tight, 0.49, block_bytes=1 << 20)


def test_too_little_free_memory_at_start_is_an_error():
    check_free_at_start(80 * GIB, 8 * GIB, 0.9)
    with pytest.raises(MemoryBudgetError, match="only 71.0 GiB is free"):
        check_free_at_start(80 * GIB, 9 * GIB, 0.9)


@pytest.mark.parametrize("max_pixels", [448 * 448, 12845056, 1280 * 28 * 28, 56 * 56])
def test_the_largest_frame_is_one_the_image_processor_can_make(max_pixels):
    config = ImageProcessorConfig(max_pixels=max_pixels, min_pixels=56 * 56)
    t, h, w = largest_frame_grid(config)
    side = h * config.patch_size
    assert t == 1 and h == w and side % config.factor == 0 and side * side <= max_pixels
    assert smart_resize(side, side, factor=config.factor, min_pixels=56 * 56,
                        max_pixels=max_pixels) == (side, side)  # fmt: skip
    assert (side + config.factor) ** 2 > max_pixels  # and no larger square fits


def observe(model, monkeypatch) -> dict:
    """Records what each part of `model` is given: patches and tokens of the vision tower,
    prompt rows of the decoder, rows of the logits."""
    seen = {}
    model.visual.register_forward_hook(
        lambda _m, args, out: seen.update(patches=args[0].shape[0], tokens=out.shape[0])
    )
    model.model.register_forward_hook(lambda _m, _args, out: seen.update(prompt=out.shape[0]))
    compute_logits = model.compute_logits

    def counting_logits(hidden):
        seen.setdefault("logits", []).append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", counting_logits)
    return seen


def test_the_profiled_step_runs_the_vision_tower_prompt_and_sampler_at_their_limits(
    model_dir, monkeypatch
):
    """On CPU the step runs the same code as on CUDA (only the memory reads are CUDA's);
    the hooks check that it is the largest step the settings allow."""
    config = EngineConfig(
        model=str(model_dir), max_num_batched_tokens=300, max_encoder_tokens_per_step=600,
        max_num_seqs=7,
    )  # fmt: skip
    model = load_model(
        str(model_dir), dtype=torch.float32, device=torch.device("cpu"),
        attention=get_attention_backend("torch"),
    )  # fmt: skip
    image_config = ImageProcessorConfig.from_model_dir(model_dir)
    assert largest_frame_grid(image_config) == (1, 32, 32)  # 448x448: 256 tokens a frame
    seen = observe(model, monkeypatch)
    run_largest_step(model, config, image_config, max_model_len=4096, kv_cache_dtype=torch.float32)
    # 600 // 256 = 2 frames; the whole token budget as one prompt; max_num_seqs rows sampled,
    # then one slice of prompt-logprobs scoring (256 rows)
    assert seen == {"patches": 2 * 32 * 32, "tokens": 2 * 256, "prompt": 300, "logits": [7, 256]}
    # A context shorter than the token budget bounds the prompt; one frame always runs.
    seen.clear()
    small = config.replace(max_encoder_tokens_per_step=10)
    run_largest_step(model, small, image_config, max_model_len=64, kv_cache_dtype=torch.float32)
    assert seen == {"patches": 32 * 32, "tokens": 256, "prompt": 64, "logits": [7, 64]}


class ScriptedProbe:
    """CudaMemoryProbe's interface with the readings of an 80 GB device (no CUDA here)."""

    def __init__(self, use: DeviceMemoryUse) -> None:
        self.use = use
        self.calls: list[str] = []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def read(self) -> DeviceMemoryUse:
        self.calls.append("read")
        return self.use

    def release_cached(self) -> None:
        self.calls.append("release_cached")


def test_profiling_reads_the_peak_around_the_largest_step(model_dir, monkeypatch):
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=64, max_num_seqs=3,
                          gpu_memory_utilization=0.5)  # fmt: skip
    model = load_model(
        str(model_dir), dtype=torch.float32, device=torch.device("cpu"),
        attention=get_attention_backend("torch"),
    )  # fmt: skip
    seen = observe(model, monkeypatch)
    use = DeviceMemoryUse(total=80 * GIB, used_at_start=GIB, torch_peak=5 * GIB, non_torch=GIB)
    probe = ScriptedProbe(use)
    model.model.register_forward_hook(lambda *_: probe.calls.append("prompt"))
    num_bytes, read = profile_kv_cache_bytes(
        probe, model, config, max_model_len=4096, kv_cache_dtype=torch.float32, block_bytes=1024
    )
    assert probe.calls == ["reset_peak", "prompt", "read", "release_cached"]
    assert seen["prompt"] == 64 and seen["logits"] == [3, 64]
    # A full encoder cache (16384 rows of the tiny model's width, float32) is kept aside.
    assert (num_bytes, read) == (34 * GIB - 16384 * 128 * 4, use)


def test_a_largest_step_that_runs_out_of_memory_names_the_settings(model_dir):
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=64)
    model = load_model(
        str(model_dir), dtype=torch.float32, device=torch.device("cpu"),
        attention=get_attention_backend("torch"),
    )  # fmt: skip

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    model.model.register_forward_pre_hook(out_of_memory)  # as the device would, mid-step
    probe = ScriptedProbe(DeviceMemoryUse(total=GIB, used_at_start=0, torch_peak=0, non_torch=0))
    with pytest.raises(MemoryBudgetError, match="max_num_batched_tokens=64") as raised:
        profile_kv_cache_bytes(probe, model, config, max_model_len=4096,
                               kv_cache_dtype=torch.float32, block_bytes=1024)  # fmt: skip
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


def test_on_cpu_an_unset_size_is_two_gib_and_a_set_one_wins(model_dir):
    options = dict(model=str(model_dir), device="cpu", max_num_seqs=4096, dtype="float32")
    default = ModelRunner(EngineConfig(**options))
    mc = default.model_config
    block = kv_block_bytes(mc, 16, torch.float32)
    assert default.num_kv_blocks == 2 * GIB // block - 1
    small = ModelRunner(EngineConfig(**options, kv_cache_memory_gib=0.01))
    assert small.num_kv_blocks == int(0.01 * GIB) // block - 1
    exact = ModelRunner(EngineConfig(**options, kv_cache_memory_gib=0.01, num_kv_blocks=5))
    assert exact.num_kv_blocks == 5


def test_the_start_up_line_says_when_the_cache_is_capped_at_what_can_be_used(model_dir, caplog):
    """A line "0.50 GiB ... from 2.0 GiB" looked wrong without the reason (fuzz86)."""
    options = dict(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256)
    with caplog.at_level(logging.INFO, logger="engine.kv_cache_sizing"):
        capped = ModelRunner(EngineConfig(**options, max_num_seqs=2))
        full = ModelRunner(EngineConfig(**options, max_num_seqs=4096, kv_cache_memory_gib=0.01))
    assert capped.num_kv_blocks == 2 * 256 // 16
    lines = [record.getMessage() for record in caplog.records]
    capped_line, full_line = [line for line in lines if "KV cache:" in line]
    assert "from 2.0 GiB, capped at max_num_seqs x max_model_len" in capped_line
    assert full_line.endswith("from 0.01 GiB") and full.num_kv_blocks < 4096 * 256 // 16


@pytest.mark.parametrize(
    "flags", [["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "1.5"],
              ["--kv-cache-memory-gib", "0"]],
)  # fmt: skip
def test_bad_memory_settings_are_usage_errors(flags):
    with pytest.raises(SettingsError, match=flags[0].removeprefix("--").replace("-", "_")):
        load_settings(["--model", "m", *flags], {})
    assert load_settings(["--model", "m", "--gpu-memory-utilization", "1"], {})


def test_a_cache_shorter_than_the_context_is_a_start_up_warning(model_dir, caplog):
    options = dict(model=str(model_dir), device="cpu", max_model_len=64)
    with caplog.at_level("WARNING", logger="engine.model_runner"):
        ModelRunner(EngineConfig(**options, num_kv_blocks=4))  # 64 tokens: enough
        assert not caplog.records
        ModelRunner(EngineConfig(**options, num_kv_blocks=3))
    assert "holds 48 tokens, fewer than max_model_len=64" in caplog.text


def test_a_kv_cache_too_big_for_memory_is_an_error_naming_num_kv_blocks(model_dir, monkeypatch):
    """It was the allocator's traceback (fuzz62): refused before allocating on a CPU, and
    caught as it allocates on a GPU (CUDA's OutOfMemoryError, imitated here)."""
    mc = ModelConfig.from_model_dir(model_dir)
    cpu = torch.device("cpu")
    needs = (10**10 + 1) * kv_block_bytes(mc, 16, torch.float32)
    with pytest.raises(MemoryBudgetError, match=f"num_kv_blocks=10000000000 needs {needs} bytes"):
        allocate_kv_caches(mc, 10**10 + 1, 16, torch.float32, cpu)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "zeros", out_of_memory)
    with pytest.raises(MemoryBudgetError, match="num_kv_blocks=3 needs .* more than the cpu"):
        allocate_kv_caches(mc, 4, 16, torch.float32, cpu)
