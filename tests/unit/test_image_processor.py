"""Image processor: config parsing, smart_resize, patch layout, content hashes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from engine.errors import InvalidRequest, MediaError, ModelLoadError
from engine.multimodal.hashing import bytes_content_hash, image_content_hash
from engine.multimodal.image_processor import (
    ImageProcessorConfig,
    num_image_tokens,
    process_image,
    smart_resize,
)

CONFIG = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=224 * 224)


def _random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# ---------------------------------------------------------------------- config


def _write(tmp_path, data: dict):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(data))
    return ImageProcessorConfig.from_model_dir(tmp_path)


def test_config_from_min_max_pixels(tmp_path):
    config = _write(tmp_path, {"min_pixels": 1000, "max_pixels": 5000, "patch_size": 16})
    assert (config.min_pixels, config.max_pixels, config.patch_size) == (1000, 5000, 16)
    assert config.merge_size == 2 and config.temporal_patch_size == 2


def test_config_from_transformers5_size_dict(tmp_path):
    data = {
        "size": {"shortest_edge": 2000, "longest_edge": 9000},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.25, 0.25, 0.25],
        "rescale_factor": 0.5,
        "merge_size": 3,
    }
    config = _write(tmp_path, data)
    assert (config.min_pixels, config.max_pixels) == (2000, 9000)
    assert config.image_mean == (0.5, 0.5, 0.5) and config.image_std == (0.25, 0.25, 0.25)
    assert config.rescale_factor == 0.5 and config.merge_size == 3 and config.factor == 42


def test_config_top_level_pixels_override_size(tmp_path):
    data = {"size": {"shortest_edge": 2000, "longest_edge": 9000}, "max_pixels": 7000}
    config = _write(tmp_path, data)
    assert (config.min_pixels, config.max_pixels) == (2000, 7000)


def test_config_missing_or_invalid(tmp_path):
    with pytest.raises(ModelLoadError):
        ImageProcessorConfig.from_model_dir(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        ImageProcessorConfig.from_model_dir(tmp_path)
    with pytest.raises(ModelLoadError):
        _write(tmp_path, {"min_pixels": 10, "max_pixels": 5})


def test_with_overrides():
    assert CONFIG.with_overrides() is CONFIG
    smaller = CONFIG.with_overrides(max_pixels=112 * 112)
    assert smaller.max_pixels == 112 * 112 and smaller.min_pixels == CONFIG.min_pixels
    assert CONFIG.max_pixels == 224 * 224  # frozen original untouched
    with pytest.raises(InvalidRequest) as info:
        CONFIG.with_overrides(max_pixels=10)
    assert info.value.param == "max_pixels"


# ---------------------------------------------------------------------- smart_resize


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (224, 224, (224, 224)),  # already on the grid
        (30, 20, (84, 56)),  # tiny: scaled up to min_pixels
        (2000, 3000, (168, 252)),  # huge: scaled down under max_pixels
        (60, 1000, (28, 896)),  # extreme aspect ratio
        (1, 1, (56, 56)),
    ],
)
def test_smart_resize(height, width, expected):
    got = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=224 * 224)
    assert got == expected
    resized_height, resized_width = got
    assert resized_height % 28 == 0 and resized_width % 28 == 0
    assert 56 * 56 <= resized_height * resized_width <= 224 * 224


def test_smart_resize_rejects_extreme_aspect_ratio():
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(10, 2010, factor=28, min_pixels=3136, max_pixels=50176)
    smart_resize(10, 2000, factor=28, min_pixels=3136, max_pixels=50176)  # 200:1 is allowed


# ---------------------------------------------------------------------- process_image


def test_process_image_shapes():
    processed = process_image(_random_image(300, 200), CONFIG)
    t, h, w = processed.grid_thw
    assert t == 1 and h % 2 == 0 and w % 2 == 0
    assert processed.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    assert processed.pixel_values.dtype == torch.float32
    assert processed.num_tokens == h * w // 4 == num_image_tokens(200, 300, CONFIG)


def test_patch_layout_merge_order_and_temporal_repeat():
    # A 56x56 image (no resize) whose pixel value encodes its 14x14 patch index: the rows
    # must come in merge order (0,0) (0,1) (1,0) (1,1) (0,2) ... and repeat each patch
    # over the temporal axis.
    config = ImageProcessorConfig(
        min_pixels=56 * 56,
        max_pixels=56 * 56,
        image_mean=(0.0, 0.0, 0.0),
        image_std=(1.0, 1.0, 1.0),
        rescale_factor=1.0,
    )
    patch_index = np.arange(16, dtype=np.uint8).reshape(4, 4)  # [grid_h, grid_w]
    pixels = np.repeat(np.repeat(patch_index, 14, axis=0), 14, axis=1)  # [56, 56]
    pixels = np.stack([pixels, pixels + 100, pixels + 200], axis=-1)  # [56, 56, 3]
    processed = process_image(Image.fromarray(pixels), config)
    assert processed.grid_thw == (1, 4, 4) and processed.num_tokens == 4
    rows = processed.pixel_values.reshape(16, 3, 2, 14, 14)  # [patch, C, T, P, P]
    expected_order = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    for row, patch in enumerate(expected_order):
        for channel in range(3):
            assert torch.all(rows[row, channel] == patch + 100 * channel)
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])


def test_normalisation_values():
    image = Image.new("RGB", (28, 28), (255, 0, 128))
    processed = process_image(image, CONFIG.with_overrides(min_pixels=784, max_pixels=784))
    first = processed.pixel_values.reshape(-1, 3, 2 * 14 * 14)[0]  # [C, T*P*P]
    for channel, value in enumerate((255, 0, 128)):
        expected = (value / 255 - CONFIG.image_mean[channel]) / CONFIG.image_std[channel]
        assert torch.allclose(first[channel], torch.tensor(expected), atol=1e-6)


@pytest.mark.parametrize(
    "config",
    [CONFIG, ImageProcessorConfig(image_mean=(0.5, 0.25, 0.1), image_std=(0.5, 0.3, 0.7))],
)
def test_normalisation_is_bit_exact_for_every_level(config):
    # transformers rescales in float64, casts to float32 and normalises in float32; the
    # lookup table must give exactly those float32 values, for every level and channel.
    config = config.with_overrides(min_pixels=784, max_pixels=784)
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    for level in range(256):
        colour = np.array([level, 255 - level, (level * 7) % 256], dtype=np.uint8)
        scaled = (colour.astype(np.float64) * config.rescale_factor).astype(np.float32)
        expected = torch.from_numpy((scaled - mean) / std)  # [C]
        image = Image.new("RGB", (28, 28), tuple(int(v) for v in colour))
        rows = process_image(image, config).pixel_values.reshape(-1, 3, 2 * 14 * 14)
        assert torch.equal(rows, expected[None, :, None].expand_as(rows)), level


def test_grayscale_image_is_processed_as_rgb():
    processed = process_image(Image.new("L", (64, 64), 90), CONFIG)
    rows = processed.pixel_values.reshape(-1, 3, 392)
    assert processed.grid_thw == (1, 4, 4)
    assert torch.all(rows[:, 0] != rows[:, 1])  # same grey, different per-channel mean/std


# ---------------------------------------------------------------------- hashing


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_image_hash_same_image_same_hash():
    first, second = _random_image(40, 30, seed=1), _random_image(40, 30, seed=1)
    assert process_image(first, CONFIG).content_hash == process_image(second, CONFIG).content_hash


def test_image_hash_names_the_resized_pixels():
    """What the encoder sees decides: the hash is of the resized pixels, so an image that
    smart_resize keeps as it is hashes as its pixels, and two images that resize to the
    same pixels share a hash (and rightly their encoder rows)."""
    kept = _random_image(56, 56, seed=3)  # a multiple of 28 inside the pixel bounds
    assert process_image(kept, CONFIG).content_hash == image_content_hash(pixels(kept), CONFIG)
    grey = [Image.new("RGB", size, (90, 120, 30)) for size in ((112, 112), (140, 140))]
    bounded = CONFIG.with_overrides(max_pixels=56 * 56)
    hashes = {process_image(image, bounded).content_hash for image in grey}
    assert len(hashes) == 1
    with pytest.raises(ValueError, match="uint8"):
        image_content_hash(pixels(kept).astype(np.float32), CONFIG)


def test_image_hash_changes_with_pixels_size_and_parameters():
    image = _random_image(56, 28, seed=1)
    base = image_content_hash(pixels(image), CONFIG)
    assert image_content_hash(pixels(_random_image(56, 28, seed=2)), CONFIG) != base
    # Same bytes, other shape.
    reshaped = Image.frombytes("RGB", (28, 56), image.tobytes())
    assert image_content_hash(pixels(reshaped), CONFIG) != base
    for changed in (
        CONFIG.with_overrides(max_pixels=112 * 112),
        CONFIG.with_overrides(min_pixels=28 * 28),
        ImageProcessorConfig(min_pixels=3136, max_pixels=50176, image_mean=(0.5, 0.5, 0.5)),
        ImageProcessorConfig(min_pixels=3136, max_pixels=50176, merge_size=1),
    ):
        assert image_content_hash(pixels(image), changed) != base


def test_bytes_hash():
    assert bytes_content_hash(b"abc", kind="image_features") == bytes_content_hash(
        memoryview(b"abc"), kind="image_features"
    )
    assert bytes_content_hash(b"abc", kind="image_features") != bytes_content_hash(
        b"abc", kind="video_features"
    )
    assert bytes_content_hash(b"abc", kind="image_features") != bytes_content_hash(
        b"abd", kind="image_features"
    )
    assert len(bytes_content_hash(b"", kind="x")) == 64
