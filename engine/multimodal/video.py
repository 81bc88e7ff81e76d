"""Video inputs: decode untrusted bytes with PyAV, sample frames, preprocess like Qwen2-VL.

The result is what `transformers`' `Qwen2VLVideoProcessor` gives for the same frames with
`do_sample_frames=True, fps=..., max_frames=..., cap_pixels_per_frame=True,
max_video_tokens=...` (Qwen3-VL: what its `Qwen3VLVideoProcessor` gives, `qwen3_*` below):

* **Sampling** (`sample_frame_indices`): `fps` frames per second of video, at least
  `min_frames`, at most `max_frames` and the video's own frame count, rounded down to a
  multiple of the temporal patch size; indices `arange(0, total, total / n)`, truncated.
  Qwen3-VL: int(seconds x `fps`) frames in the same bounds, not rounded to the patch,
  indices `linspace(0, total - 1, n)` rounded; each temporal patch's time goes into the
  prompt (`temporal_patch_seconds`).
* **Resize**: every frame to the `smart_resize` size of the first (bounds from the model's
  video config, the upper one shared out of a whole-video token budget as transformers'
  `cap_pixels_per_frame=True, max_video_tokens=...` does; Qwen3-VL's bounds hold the whole
  video's t x h x w, `qwen3_video_size`), bicubic with antialiasing on
  uint8 through `torch.nn.functional.interpolate` (the kernel torchvision's uint8 resize
  runs on CPU, so the levels are identical).
* **Patches**: each frame cut as an image is (`frame_patches`), then consecutive frames
  pair up along the temporal patch (T = 2): row layout [C, T, P, P], rows ordered
  (t, gh/M, gw/M, M, M); an odd frame count repeats the last.

Levels stay uint8 (`ProcessedImage.pixel_levels`); the engine normalises them with the
image path's table. transformers' video processor normalises with a fused float32 formula,
so its values can differ from ours in the last bit; the levels are equal.

Decoding untrusted bytes (containers, limits, frame by frame): engine/multimodal/video_decode.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import MediaError, ModelLoadError
from engine.model_config import is_qwen3_vl
from engine.multimodal.hashing import video_content_hash
from engine.multimodal.image_processor import (
    ImageProcessorConfig,
    ProcessedImage,
    frame_patches,
    smart_resize,
)

# transformers' Qwen2VLVideoProcessor default (used when the model folder says nothing).
DEFAULT_MIN_FRAMES = 4
# The server's defaults (--video-fps, --max-video-frames, --max-video-tokens).
DEFAULT_FPS = 2.0
DEFAULT_MAX_FRAMES = 32
DEFAULT_MAX_TOKENS = 16384


@dataclass(frozen=True)
class VideoConfig:
    """How a video becomes encoder input: frame sampling plus the per-frame image settings.

    `frame` carries patch geometry, normalisation and the per-frame pixel bounds: the
    model's `video_preprocessor_config.json` if it has one, else its image settings (what
    `transformers.AutoVideoProcessor` reads too).
    """

    frame: ImageProcessorConfig
    fps: float = DEFAULT_FPS  # frames sampled per second of video
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # a whole video's budget; None = no budget
    qwen3: bool = False  # Qwen3-VL's frame sampling and sizing (the model's config.json)

    def __post_init__(self) -> None:
        if not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(
                f"need 1 <= min_frames <= max_frames, got {self.min_frames}, {self.max_frames}"
            )

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        fps: float = DEFAULT_FPS,
        max_frames: int = DEFAULT_MAX_FRAMES,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
    ) -> VideoConfig:
        """The model's video settings; `fps`, `max_frames` and `max_tokens` are the server's."""
        image_config = ImageProcessorConfig.from_model_dir(model_dir)
        limits = {"fps": fps, "max_frames": max_frames, "max_tokens": max_tokens,
                  "qwen3": _is_qwen3_vl(Path(model_dir))}  # fmt: skip
        path = Path(model_dir) / "video_preprocessor_config.json"
        if not path.is_file():
            return cls(image_config, min_frames=min(DEFAULT_MIN_FRAMES, max_frames), **limits)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            frame = ImageProcessorConfig.from_dict(data)
            min_frames = min(int(data.get("min_frames", DEFAULT_MIN_FRAMES)), max_frames)
            return cls(frame, min_frames=min_frames, **limits)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"video_preprocessor_config.json is invalid: {exc}") from exc

    def qwen3_max_pixels(self) -> int:
        """Qwen3-VL's bound on the whole video's t x h x w (its config's own bound is on the
        whole video too): with `max_tokens`, 90% of that many tokens' pixels, as
        `frame_max_pixels` shares them out for Qwen2-VL, so that `--max-video-tokens`
        bounds one video's tokens on every model. (transformers' Qwen3-VL processor reads
        its `max_video_tokens` per frame, which let a video cost up to frames/2 times the
        flag; at the defaults neither binds: the model's bound is 12288 tokens.)"""
        frame = self.frame
        if self.max_tokens is None:
            return frame.max_pixels
        budget = int(self.max_tokens * frame.factor * frame.factor * 0.9)
        return max(min(frame.max_pixels, budget * frame.temporal_patch_size), frame.min_pixels)

    def frame_max_pixels(self, num_frames: int) -> int:
        """Per-frame pixel bound for a video of `num_frames` sampled frames.

        With `max_tokens`, each frame gets an even share of 90% of that many tokens' pixels
        (two frames share a token), never less than 1.05 x `min_pixels`: transformers'
        `cap_pixels_per_frame=True, max_video_tokens=max_tokens` (qwen-vl-utils' rule).
        It bounds what one request can cost: without it a 32-frame 4K clip is ~800 MB of
        levels and ~250k tokens before the context check refuses it."""
        frame = self.frame
        if self.max_tokens is None:
            return frame.max_pixels
        total_pixels = int(self.max_tokens * frame.factor * frame.factor * 0.9)
        share = total_pixels * frame.temporal_patch_size // max(num_frames, 1)
        return max(min(frame.max_pixels, share), int(frame.min_pixels * 1.05))


def sample_frame_indices(
    total_frames: int, video_fps: float | None, config: VideoConfig
) -> list[int]:
    """Which frames to keep, as transformers' `Qwen2VLVideoProcessor.sample_frames` picks
    them with `fps`. Without a frame rate, `max_frames` frames spread evenly. A video
    shorter than one temporal patch keeps all its frames (the last is repeated later)."""
    patch = config.frame.temporal_patch_size
    if total_frames <= 0:
        return []
    if config.qwen3:
        return _qwen3_frame_indices(total_frames, video_fps, config)
    max_frames = math.floor(min(config.max_frames, total_frames) / patch) * patch
    if video_fps is not None and video_fps > 0:
        wanted = total_frames / video_fps * config.fps
    else:
        wanted = config.max_frames
    num_frames = min(max(wanted, config.min_frames), max_frames, total_frames)
    num_frames = math.floor(num_frames / patch) * patch
    if num_frames <= 0:
        return list(range(min(total_frames, config.max_frames)))
    # The same float arithmetic as transformers (float32 arange, truncated to int).
    indices = torch.arange(0, total_frames, total_frames / num_frames).int().tolist()
    return indices[:num_frames]


def _qwen3_frame_indices(total_frames: int, video_fps: float | None, config: VideoConfig):
    """Qwen3VLVideoProcessor.sample_frames with `fps` (a file without a frame rate counts as
    24 fps there)."""
    wanted = int(total_frames / (video_fps or 24.0) * config.fps)
    num_frames = min(max(wanted, config.min_frames), config.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int).tolist()


def _is_qwen3_vl(model_dir: Path) -> bool:
    """engine/model_config.is_qwen3_vl of the folder's config.json (False without one)."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and is_qwen3_vl(raw)


def second_per_grid_t(
    num_sampled: int, total_frames: int, video_fps: float | None, config: VideoConfig
) -> float:
    """Seconds of video one temporal patch spans: transformers' `temporal_patch_size /
    VideoMetadata.sampled_fps` (sampled frames / total frames x the file's frame rate),
    which Qwen2.5-VL's processor hands its model as `second_per_grid_ts`. Without a frame
    rate the frames count as sampled at `config.fps`."""
    sampled_fps = config.fps
    if video_fps and total_frames > 0 and num_sampled > 0:
        sampled_fps = num_sampled / total_frames * video_fps
    return config.frame.temporal_patch_size / sampled_fps


def temporal_patch_seconds(
    frame_indices: list[int], video_fps: float | None, config: VideoConfig
) -> tuple[float, ...]:
    """When each temporal patch was shot: the mean of its first and last frame's times
    (index / the file's frame rate, or `config.fps` without one), a last short patch
    repeating its last frame, as transformers' `Qwen3VLProcessor._calculate_timestamps`."""
    patch = config.frame.temporal_patch_size
    indices = list(frame_indices)
    indices += indices[-1:] * (-len(indices) % patch)
    times = [index / (video_fps or config.fps) for index in indices]
    return tuple((times[i] + times[i + patch - 1]) / 2 for i in range(0, len(times), patch))


def frame_size(height: int, width: int, num_frames: int, config: VideoConfig) -> tuple[int, int]:
    """(height, width) every frame of a `num_frames`-frame video of this size is resized to.
    Apply it to source sizes only: where the pixel bounds are close (a tight token budget),
    `smart_resize` of its own output can move again."""
    frame = config.frame
    if config.qwen3:
        return qwen3_video_size(num_frames, height, width, config)
    return smart_resize(
        height,
        width,
        factor=frame.factor,
        min_pixels=frame.min_pixels,
        max_pixels=config.frame_max_pixels(num_frames),
        what="video",
    )


def qwen3_video_size(
    num_frames: int, height: int, width: int, config: VideoConfig
) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize: sides rounded to the patch grid, scaled so that the
    video's frames (rounded to the temporal patch) times the frame's area stays within
    `min_pixels` .. `qwen3_max_pixels`."""
    frame = config.frame
    factor, temporal = frame.factor, frame.temporal_patch_size
    min_pixels, max_pixels = frame.min_pixels, config.qwen3_max_pixels()
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaError("the video's aspect ratio is over 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(max(num_frames, temporal) / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def process_video(frames: list[np.ndarray], config: VideoConfig) -> ProcessedImage:
    """Sampled full-size RGB frames ([H, W, 3] uint8, all one size) -> encoder input. The
    frames count as sampled at `config.fps`."""
    size = frame_size(frames[0].shape[0], frames[0].shape[1], len(frames), config)
    resized = np.stack([resize_frame(frame, *size) for frame in frames])
    times = temporal_patch_seconds(list(range(len(frames))), None, config)
    return from_resized_frames(resized, config, second_per_grid_t(0, 0, None, config), times)


def from_resized_frames(
    frames: np.ndarray, config: VideoConfig, seconds: float, times: tuple[float, ...]
) -> ProcessedImage:
    """[N, H, W, C] uint8 frames at their final size -> ProcessedImage (`seconds` of video
    per temporal patch, `times` when each was shot)."""
    frame_config = config.frame
    levels, grid_thw = patchify_frames(frames, frame_config)
    merge = frame_config.merge_size
    return ProcessedImage(
        pixel_levels=levels,
        normalization=frame_config.normalization,
        grid_thw=grid_thw,
        num_tokens=grid_thw[0] * grid_thw[1] * grid_thw[2] // merge**2,
        content_hash=video_content_hash(levels, grid_thw, frame_config),
        second_per_grid_t=seconds,
        frame_seconds=times,
    )


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8, bicubic with antialiasing (torch's uint8
    kernel, what torchvision runs). A frame already at that size is returned as is (the
    kernel would return it unchanged)."""
    if frame.shape[:2] == (height, width):
        return frame
    pixels = torch.from_numpy(frame).permute(2, 0, 1).unsqueeze(0)  # [1, 3, H, W]
    resized = torch.nn.functional.interpolate(
        pixels, size=(height, width), mode="bicubic", antialias=True, align_corners=False
    )
    return resized[0].permute(1, 2, 0).numpy()  # a view of [3, height, width]


def patchify_frames(
    frames: np.ndarray, config: ImageProcessorConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[N, H, W, C] uint8 -> (levels [grid_t * grid_h * grid_w, C * T * P * P], grid_thw).

    Each frame is cut by the image path's `frame_patches` and written into its temporal
    slot: T consecutive frames fill a row's slots. N is padded to a multiple of T by
    repeating the last frame."""
    temporal, patch = config.temporal_patch_size, config.patch_size
    num_frames, height, width, channels = frames.shape
    grid_t, grid_h, grid_w = -(-num_frames // temporal), height // patch, width // patch
    shape = (grid_t, grid_h * grid_w, channels, temporal, patch * patch)
    levels = np.empty(shape, dtype=frames.dtype)  # written in place: one copy per frame
    for index in range(grid_t * temporal):
        frame = frames[min(index, num_frames - 1)]
        levels[index // temporal, :, :, index % temporal] = frame_patches(frame, config)[0]
    return torch.from_numpy(levels.reshape(grid_t * grid_h * grid_w, -1)), (grid_t, grid_h, grid_w)
