"""bench/gpu_vision.py: its FLOP count (the floor a GPU run is judged against) and its CPU
smoke run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import gpu_vision
from bench.gpu_decode import ensure_model
from engine.attention import get_attention_backend
from engine.models.loader import load_model


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_bench")
    ensure_model(root, "tiny", "cpu")
    return root


@pytest.fixture(scope="module")
def model(model_root):
    return load_model(str(model_root / "tiny"), dtype=torch.float32, device=torch.device("cpu"),
                      attention=get_attention_backend("torch"))  # fmt: skip


@pytest.mark.parametrize(
    ("size", "grids"),
    [
        # Qwen2-VL: frames of two lengths and a two-frame video.
        ("tiny", [(1, 4, 4), (1, 4, 6), (2, 4, 4)]),
        # Qwen2.5-VL: window blocks attend within windows (edge ones smaller), block 1 frames.
        ("tiny-qwen2.5-vl", [(1, 10, 6), (1, 4, 4), (3, 6, 2)]),
    ],
)
def test_tower_flops_equal_what_torch_counts(model_root, size, grids):
    # PyTorch's FlopCounterMode counts every matmul the tower runs; under the math SDPA
    # kernel attention is matmuls too.
    ensure_model(model_root, size, "cpu")
    model = load_model(str(model_root / size), dtype=torch.float32, device=torch.device("cpu"),
                       attention=get_attention_backend("torch"))  # fmt: skip
    vision = model.config.vision
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), vision.patch_dim)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as count:
        model.encode_images(pixels, torch.tensor(grids))
    assert gpu_vision.tower_flops(vision, grids) == count.get_total_flops()


def test_frame_grid_rejects_sizes_the_processor_never_makes(model):
    vision = model.config.vision
    assert gpu_vision.frame_grid(vision, 56) == (1, 4, 4)
    with pytest.raises(ValueError, match="multiple of 28"):
        gpu_vision.frame_grid(vision, 50)


def test_cpu_smoke_run_times_both_towers_on_the_same_weights(model_root, tmp_path):
    out = tmp_path / "vision.json"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--size", "tiny",
        "--model-root", str(model_root), "--images", "1", "2", "--image-size", "56",
        "--iters", "1", "--out", str(out),
        "--profile-dir", str(tmp_path / "profiles"), "--profile-images", "2",
    ]  # fmt: skip
    assert gpu_vision.main(argv) == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    # The forced SDPA kernels are CUDA-only and left out on CPU.
    assert [(r["impl"], r["num_images"]) for r in results] == [
        ("tessera", 1), ("transformers", 1), ("tessera", 2), ("transformers", 2),
    ]  # fmt: skip
    assert all(r["call_ms"] > 0 and r["floor_ms"] > 0 and r["error"] is None for r in results)
    assert results[2]["flops"] == 2 * results[0]["flops"]
    # Same weights, same inputs: the towers agree to float32 rounding.
    assert all(diff < 1e-4 for diff in payload["max_rel_diff_vs_hf"].values())
    assert [p.name for p in (tmp_path / "profiles").iterdir()] == ["tiny-vision-2x56.json.gz"]
