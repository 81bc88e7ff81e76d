"""Qwen2-VL image preprocessing: resize, rescale, normalise, cut into merged patches.

Output matches `transformers`' Qwen2-VL PIL image processor exactly (same resize filter,
same float64 rescale then float32 normalise, same patch order), so the vision encoder sees
the same `pixel_values` whether a request came through Tessera or through `transformers`.

Patch layout, for one image resized to (H, W) with patch P, merge M, temporal patch T:

    grid_h = H / P, grid_w = W / P              (both multiples of M)
    rows   = grid_h * grid_w, ordered (gh/M, gw/M, M, M): the M*M patches that the merger
             fuses into one LLM token are consecutive rows
    row    = [C, T, P, P] flattened; a still image is repeated T times along T

The server sends the patches as uint8 levels (`ProcessedImage.pixel_levels`, a quarter of
float32's bytes over ZMQ and in the processed-image cache); the engine normalises them on
its device with `normalize_pixels`, a lookup in a per-channel table of 256 values that
reproduces transformers' rescale-then-normalise arithmetic bit for bit.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engine.errors import InvalidRequest, MediaError, ModelLoadError
from engine.multimodal.hashing import image_content_hash
from engine.multimodal.media import convert_rgb
from engine.protocol import PixelNormalization

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Image preprocessing parameters of one model, read from preprocessor_config.json.

    `min_pixels` / `max_pixels` bound the resized area (in pixels); `resample` is a PIL
    resampling filter id (3 = bicubic, what Qwen2-VL uses).
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # added field: PIL filter id, 3 = bicubic

    def __post_init__(self) -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError("patch_size, temporal_patch_size and merge_size must be >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std must have 3 values (RGB)")

    @property
    def normalization(self) -> PixelNormalization:
        return PixelNormalization(self.rescale_factor, self.image_mean, self.image_std)

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this (one merged token covers factor^2 px)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, data: dict) -> ImageProcessorConfig:
        """Parse a preprocessor_config.json dict (transformers 4.x or 5.x layout)."""
        defaults = cls()
        size = data.get("size") or {}
        # transformers: `size` first, then top-level min/max_pixels override it.
        min_pixels = size.get("shortest_edge", size.get("min_pixels", defaults.min_pixels))
        max_pixels = size.get("longest_edge", size.get("max_pixels", defaults.max_pixels))
        if data.get("min_pixels") is not None:
            min_pixels = data["min_pixels"]
        if data.get("max_pixels") is not None:
            max_pixels = data["max_pixels"]
        return cls(
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(data.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(data.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(data.get("merge_size", defaults.merge_size)),
            image_mean=_three_floats(data.get("image_mean", defaults.image_mean)),
            image_std=_three_floats(data.get("image_std", defaults.image_std)),
            rescale_factor=float(data.get("rescale_factor", defaults.rescale_factor)),
            resample=int(data.get("resample", defaults.resample)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        path = Path(model_dir) / "preprocessor_config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls.from_dict(data)
        except FileNotFoundError as exc:
            raise ModelLoadError("the model folder has no preprocessor_config.json") from exc
        except (ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"preprocessor_config.json is invalid: {exc}") from exc

    def with_overrides(
        self, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> ImageProcessorConfig:
        """A copy with per-request pixel bounds; bad bounds raise `InvalidRequest`."""
        changes = {}
        if min_pixels is not None:
            changes["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            changes["max_pixels"] = int(max_pixels)
        if not changes:
            return self
        try:
            return replace(self, **changes)
        except ValueError as exc:
            param = "max_pixels" if max_pixels is not None else "min_pixels"
            raise InvalidRequest(str(exc), param=param) from exc


def _three_floats(values) -> tuple[float, float, float]:
    if isinstance(values, (int, float)):
        values = [values] * 3
    a, b, c = (float(v) for v in values)
    return (a, b, c)


def smart_resize(
    height: int,
    width: int,
    *,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    what: str = "image",
) -> tuple[int, int]:
    """Qwen2-VL's target size: sides multiples of `factor`, area within
    [min_pixels, max_pixels], aspect ratio kept as closely as possible. `what` the errors
    name: a video's frames are resized here too."""
    if height < 1 or width < 1:
        raise MediaError(f"{what} has an empty side ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"{what} aspect ratio must be at most {MAX_ASPECT_RATIO}:1, got {width}x{height}"
        )
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        resized_height = max(factor, math.floor(height / beta / factor) * factor)
        resized_width = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_height * resized_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * beta / factor) * factor
        resized_width = math.ceil(width * beta / factor) * factor
    return resized_height, resized_width


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision encoder.

    `pixel_levels` rows are patches in merge order (see the module docstring), as the
    image's uint8 levels; `normalization` turns them into the encoder's input.
    `num_tokens` is how many placeholder tokens the image takes in the prompt.
    """

    pixel_levels: torch.Tensor  # [grid_t * grid_h * grid_w, C * T * P * P] uint8
    normalization: PixelNormalization
    grid_thw: tuple[int, int, int]
    num_tokens: int
    content_hash: str
    # Videos: seconds of video one temporal patch spans (Qwen2.5-VL's M-RoPE spacing).
    second_per_grid_t: float = 1.0
    # Videos: when each temporal patch was shot, in seconds (Qwen3-VL writes it before it).
    frame_seconds: tuple[float, ...] = ()

    @property
    def pixel_values(self) -> torch.Tensor:
        """The normalised float32 values (what transformers' processor returns)."""
        return normalize_pixels(self.pixel_levels, self.normalization)


def num_image_tokens(height: int, width: int, config: ImageProcessorConfig) -> int:
    """Placeholder count of an image of this size, without processing it."""
    resized_height, resized_width = smart_resize(
        height,
        width,
        factor=config.factor,
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
    )
    return (resized_height // config.factor) * (resized_width // config.factor)


def process_image(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """Resize, normalise and patchify one image (any PIL mode; converted to RGB first)."""
    rgb = convert_rgb(image)
    width, height = rgb.size
    resized_height, resized_width = smart_resize(
        height,
        width,
        factor=config.factor,
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
    )
    resized = np.asarray(rgb.resize((resized_width, resized_height), resample=config.resample))
    patches, grid_h, grid_w = frame_patches(resized, config)  # [rows, C, P*P]
    # A still image fills every temporal slot with the same patch: [rows, C, T, P*P].
    levels = np.repeat(patches[:, :, None], config.temporal_patch_size, axis=2)
    return ProcessedImage(
        pixel_levels=torch.from_numpy(levels.reshape(len(levels), -1)),
        normalization=config.normalization,
        grid_thw=(1, grid_h, grid_w),
        num_tokens=grid_h * grid_w // config.merge_size**2,
        content_hash=image_content_hash(resized, config),
    )


@functools.lru_cache(maxsize=16)
def normalization_table(normalization: PixelNormalization) -> torch.Tensor:
    """[C * 256] float32 on the host: the normalised value of every uint8 level, channel
    by channel.

    Computed with transformers' arithmetic (rescale in float64, cast to float32, then
    normalise in float32), so looking a level up gives bit for bit what that arithmetic
    gives on the pixel.
    """
    levels = np.arange(256, dtype=np.float64)[:, None]  # [256, 1]
    scaled = (levels * normalization.rescale_factor).astype(np.float32)
    mean = np.asarray(normalization.mean, dtype=np.float32)
    std = np.asarray(normalization.std, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero std: the engine refuses it
        table = (scaled - mean) / std  # [256, C]
    return torch.from_numpy(np.ascontiguousarray(table.T).reshape(-1))


@functools.lru_cache(maxsize=64)
def _level_lookup(
    normalization: PixelNormalization, row_width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [C * 256] float32, column offsets [row_width] int32) on `device`: a level in
    column j of a row is looked up at `offset[j] + level` (rows are C equal channel runs)."""
    channels = len(normalization.mean)
    offsets = torch.arange(channels, dtype=torch.int32).repeat_interleave(row_width // channels)
    return normalization_table(normalization).to(device), (offsets * 256).to(device)


def normalize_pixels(levels: torch.Tensor, normalization: PixelNormalization) -> torch.Tensor:
    """uint8 levels [rows, C * T * P * P] (any device) -> float32 normalised values there."""
    if levels.dtype != torch.uint8 or levels.dim() != 2:
        raise MediaError(f"pixel levels must be a 2-D uint8 tensor, got {levels.dtype}")
    channels = len(normalization.mean)
    if channels != len(normalization.std) or levels.shape[1] % channels:
        raise MediaError(
            f"a normalization for {channels} channels does not fit rows of {levels.shape[1]}"
        )
    table, offsets = _level_lookup(normalization, levels.shape[1], levels.device)
    # int32 indices and one flat index_select: on one CPU thread 1.3 ms for a 448x448
    # image, where int64 advanced indexing (`table[levels.long() + offsets]`) takes ~15.
    indices = torch.add(levels, offsets)  # uint8 + int32 -> int32 [rows, C * T * P * P]
    return torch.index_select(table, 0, indices.view(-1)).view(levels.shape)


def frame_patches(image: np.ndarray, config: ImageProcessorConfig) -> tuple[np.ndarray, int, int]:
    """[H, W, C] -> ([grid_h * grid_w, C, P * P] in merge order, grid_h, grid_w), dtype kept:
    the spatial layout of one frame, shared by images and video frames."""
    height, width, channels = image.shape
    patch, merge = config.patch_size, config.merge_size
    grid_h, grid_w = height // patch, width // patch
    blocks = image.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch, channels)
    # [gh/M, M, P, gw/M, M, P, C] -> [gh/M, gw/M, M, M, C, P, P]
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    flat = np.ascontiguousarray(blocks).reshape(grid_h * grid_w, channels, patch * patch)
    return flat, grid_h, grid_w
