"""process_image vs transformers' Qwen2-VL PIL image processor: same pixel_values, same grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine.multimodal.image_processor import ImageProcessorConfig, process_image, smart_resize

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    smart_resize as hf_smart_resize,
)

CONFIG = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=448 * 448)


def _hf_processor(config: ImageProcessorConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        rescale_factor=config.rescale_factor,
    )


def _image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "RGB":
        return rgb
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
        rgba = rgb.convert("RGBA")
        rgba.putalpha(alpha)
        return rgba
    if mode == "P":
        return rgb.quantize(colors=32)
    if mode == "P+transparency":
        palette = rgb.quantize(colors=32)
        palette.info["transparency"] = 3
        return palette
    if mode == "CMYK":
        return Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "CMYK")
    return rgb.convert(mode)  # L, LA, 1


CASES = [
    (20, 30, "RGB"),  # tiny: upscaled to min_pixels
    (3000, 2000, "RGB"),  # huge: downscaled to max_pixels
    (1000, 60, "RGB"),  # extreme aspect ratio
    (60, 1000, "RGB"),
    (224, 224, "RGB"),  # already on the grid: resize is a no-op
    (1, 1, "RGB"),
    (333, 517, "L"),  # grayscale
    (300, 200, "RGBA"),
    (123, 457, "P"),  # palette
    (99, 101, "P+transparency"),
    (64, 80, "LA"),
    (640, 480, "1"),
    (100, 140, "CMYK"),
]


@pytest.mark.parametrize(("width", "height", "mode"), CASES)
def test_matches_transformers(width, height, mode):
    image = _image(width, height, mode, seed=width * 7 + height)
    expected = _hf_processor(CONFIG)(images=[image], return_tensors="pt")
    got = process_image(image, CONFIG)
    assert got.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert got.pixel_values.shape == expected["pixel_values"].shape
    assert torch.allclose(got.pixel_values, expected["pixel_values"].float(), atol=1e-5, rtol=0)
    t, h, w = got.grid_thw
    assert got.num_tokens == t * h * w // CONFIG.merge_size**2


def test_matches_transformers_with_other_geometry():
    config = ImageProcessorConfig(
        min_pixels=32 * 32,
        max_pixels=320 * 320,
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    )
    image = _image(517, 389, "RGB", seed=5)
    expected = _hf_processor(config)(images=[image], return_tensors="pt")
    got = process_image(image, config)
    assert got.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert torch.allclose(got.pixel_values, expected["pixel_values"].float(), atol=1e-5, rtol=0)


def test_smart_resize_matches_transformers():
    rng = np.random.default_rng(0)
    for _ in range(500):
        height, width = (int(v) for v in rng.integers(1, 5000, size=2))
        if max(height, width) / min(height, width) > 200:
            continue
        for factor, min_pixels, max_pixels in ((28, 3136, 200704), (32, 1024, 1_003_520)):
            ours = smart_resize(
                height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
            )
            assert ours == hf_smart_resize(height, width, factor, min_pixels, max_pixels)
