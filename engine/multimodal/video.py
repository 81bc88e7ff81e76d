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

Only a few containers are opened, each with its own demuxer named explicitly (MP4/MOV,
Matroska/WebM, AVI, GIF): letting FFmpeg probe the format would also admit demuxers such as
HLS or concat that read further files or URLs named inside the data. Decoding jumps from
keyframe to keyframe where that skips frames (`decode_video`); the frames are those a
decode of every frame gives.
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from engine.errors import MediaError, ModelLoadError
from engine.multimodal.hashing import video_content_hash
from engine.multimodal.image_processor import (
    ImageProcessorConfig,
    ProcessedImage,
    frame_patches,
    smart_resize,
)
from engine.multimodal.prompt import QWEN3_VL_MODEL_TYPES

# transformers' Qwen2VLVideoProcessor default (used when the model folder says nothing).
DEFAULT_MIN_FRAMES = 4
# The server's defaults (--video-fps, --max-video-frames, --max-video-tokens).
DEFAULT_FPS = 2.0
DEFAULT_MAX_FRAMES = 32
DEFAULT_MAX_TOKENS = 16384
SUPPORTED_CONTAINERS = "MP4/MOV, WebM/Matroska, AVI, GIF"
# Demuxers that give every packet its presentation timestamp and seek by it through an
# index. AVI and GIF decode in order (no reliable timestamps; a GIF frame draws over the
# previous one).
SEEKABLE_CONTAINERS = ("mov", "matroska")


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
            return cls(image_config, **limits)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            frame = ImageProcessorConfig.from_dict(data)
            min_frames = min(int(data.get("min_frames", DEFAULT_MIN_FRAMES)), max_frames)
            return cls(frame, min_frames=min_frames, **limits)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"video_preprocessor_config.json is invalid: {exc}") from exc

    def qwen3_max_pixels(self, num_frames: int) -> int:
        """Qwen3-VL's bound on the whole video's t x h x w: with `max_tokens`, each frame's
        share of it (at most that many tokens' pixels, at least 1.05 x `min_pixels`) times
        the frames, as its processor's `cap_pixels_per_frame=True`."""
        frame = self.frame
        if self.max_tokens is None:
            return frame.max_pixels
        cap = self.max_tokens * frame.factor * frame.factor
        share = max(min(cap, frame.max_pixels // max(num_frames, 1)), int(frame.min_pixels * 1.05))
        return share * num_frames

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
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
        return model_type in QWEN3_VL_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


class DecodedVideo(NamedTuple):
    frames: list[np.ndarray]  # the sampled frames, resized, [H, W, 3] uint8 RGB
    fps: float | None  # the file's frame rate, None when it declares none
    total_frames: int  # frames in the file


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


@dataclass(frozen=True)
class VideoLimits:
    """Checks on untrusted video data before and while it is decoded."""

    max_frame_pixels: int = 64_000_000  # width x height of every coded frame
    max_source_frames: int = 100_000  # frames in the container (decode cost)
    # Decoding past this fails: what a few kilobytes can cost is not bounded otherwise
    # (a GIF of 2000 one-pixel frames on an 8000 x 8000 canvas decodes 128 G pixels).
    max_decode_seconds: float = 30.0


# FFmpeg's max_pixels counts FFALIGN(width, STRIDE_ALIGN) x height: a width under 64 counts
# as 64, one of 64 or more as at most twice itself; heights stay under 2^16.
_STRIDE_ALIGN = 64
_MAX_CODED_HEIGHT = 65536


class _DecodeGuard:
    """One decode's `VideoLimits` while it runs, and the request field its errors name."""

    def __init__(self, limits: VideoLimits, param: str | None) -> None:
        self.limits = limits
        self.param = param
        self._deadline = time.monotonic() + limits.max_decode_seconds

    def check_time(self) -> None:
        """Checked per decoded frame: fails a decode past `max_decode_seconds`."""
        if time.monotonic() > self._deadline:
            raise MediaError(
                f"decoding the video took over {self.limits.max_decode_seconds:g} s "
                "(max_video_decode_seconds)",
                param=self.param,
            )

    def stream(self, container):
        """The first video stream, its decoder capped near `max_frame_pixels` a frame: the
        size checked before decoding is the first frames' (a stream may grow later), and a
        16000 x 16000 frame was decoded and converted (768 MB) before the size change was
        seen. FFmpeg refuses frames over its cap before it decodes them; the cap is loose
        (FFmpeg counts the width rounded up to its stride alignment, 64), and
        `check_frame` holds each decoded frame to the exact limit."""
        stream = container.streams.video[0]
        cap = 2 * self.limits.max_frame_pixels + _STRIDE_ALIGN * _MAX_CODED_HEIGHT
        stream.codec_context.options = {"max_pixels": str(cap)}
        return stream

    def check_frame(self, frame) -> None:
        """A decoded frame (before it is converted) within `max_frame_pixels`."""
        width, height = frame.width, frame.height
        if width * height > self.limits.max_frame_pixels:
            raise MediaError(
                f"a frame of the video is {width}x{height} = {width * height} pixels; "
                f"the limit is {self.limits.max_frame_pixels}",
                param=self.param,
            )


def decode_video(
    data: bytes,
    config: VideoConfig,
    limits: VideoLimits = VideoLimits(),
    *,
    param: str | None = None,
    seek: bool = True,
) -> DecodedVideo:
    """Decode the sampled frames of a video (resized), with the file's fps and frame count.

    Each sampled frame is resized to its final size as soon as it is decoded, so memory
    holds one source frame and the (budgeted) resized ones, never 32 source frames of a
    4K video. `load_video` turns them into encoder input.

    Frame `i` is the i-th frame the decoder outputs, as for transformers' loaders. With
    `seek` (MP4/MOV and Matroska/WebM whose packets all carry distinct timestamps),
    decoding jumps to the last keyframe before a sampled frame whenever that keyframe lies
    past what was decoded already, instead of decoding every frame in between: 32 frames
    of a 10-minute clip then cost a few GOPs each, not the whole clip. A seek that does not
    land on the planned frame falls back to decoding in order, so both give the same frames.

    Raises `MediaError` naming `param` for data that is not a supported container, has no
    video stream, is corrupt, is over the limits or has frames of changing size.
    """
    container_format = sniff_container(data)
    if container_format is None:
        raise MediaError(
            f"the data is not a supported video; supported containers are {SUPPORTED_CONTAINERS}",
            param=param,
        )
    try:
        with _open(data, container_format) as container:
            if not container.streams.video:
                raise MediaError("the video has no video stream", param=param)
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            declared_frames = stream.frames
            rate = stream.average_rate or stream.guessed_rate
        if width * height > limits.max_frame_pixels:
            raise MediaError(
                f"the video's frames are {width}x{height} = {width * height} pixels; "
                f"the limit is {limits.max_frame_pixels}",
                param=param,
            )
        index = None
        if not declared_frames or (seek and container_format in SEEKABLE_CONTAINERS):
            index = _index_packets(data, container_format)
        total = declared_frames or len(index.pts)  # type: ignore[union-attr]
        if total > limits.max_source_frames:
            raise MediaError(
                f"the video has {total} frames; the limit is {limits.max_source_frames}",
                param=param,
            )
        video_fps = float(rate) if rate else None
        wanted = sample_frame_indices(total, video_fps, config)
        guard = _DecodeGuard(limits, param)
        frames = None
        if seek and index is not None and index.can_seek(total):
            frames = _decode_by_seeking(data, container_format, index, wanted, config, guard)
        if frames is None:
            frames = _decode_in_order(data, container_format, wanted, config, guard)
    except MediaError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's data
        raise MediaError("the video data is truncated or corrupt", param=param) from exc
    if not frames:
        raise MediaError("the video has no decodable frames", param=param)
    return DecodedVideo(frames, video_fps, total)


def _open(data: bytes, container_format: str):
    import av  # PyAV: imported here so that an image-only process does not load FFmpeg

    return av.open(io.BytesIO(data), mode="r", format=container_format)


@dataclass(frozen=True)
class _PacketIndex:
    """The video stream's frames, one per packet: presentation timestamps in presentation
    order (entry i is frame i), and the timestamps decoding can start from (keyframes)."""

    pts: list[int | None]
    keyframe_pts: list[int]

    def can_seek(self, total_frames: int) -> bool:
        """Whether frame i can be named by timestamp: one distinct timestamp per frame."""
        if len(self.pts) != total_frames or not self.keyframe_pts or None in self.pts:
            return False
        return all(a < b for a, b in itertools.pairwise(self.pts))  # type: ignore[operator]


def _index_packets(data: bytes, container_format: str) -> _PacketIndex:
    """Demux (no decoding) the first video stream's packets."""
    pts: list[int | None] = []
    keyframes: list[int] = []
    with _open(data, container_format) as container:
        for packet in container.demux(container.streams.video[0]):
            if packet.size:  # the demuxer's final empty packet is not a frame
                pts.append(packet.pts)
                if packet.is_keyframe and packet.pts is not None:
                    keyframes.append(packet.pts)
    if None not in pts:
        pts.sort()  # decode order -> presentation order (B-frames)
    return _PacketIndex(pts, sorted(keyframes))


def _decode_in_order(
    data: bytes, container_format: str, wanted: list[int], config: VideoConfig, guard: _DecodeGuard
) -> list[np.ndarray]:
    """The `wanted` frames, decoding every frame up to the last of them."""

    def picked(container):
        if not wanted:
            return
        wanted_set, last = set(wanted), wanted[-1]
        for index, frame in enumerate(container.decode(guard.stream(container))):
            guard.check_time()
            if index in wanted_set:
                yield frame
            if index >= last:
                break

    with _open(data, container_format) as container:
        return _resized_frames(picked(container), len(wanted), config, guard)


class _MissedFrame(Exception):
    """A seek did not bring the planned frame: decode in order instead."""


def _decode_by_seeking(
    data: bytes,
    container_format: str,
    index: _PacketIndex,
    wanted: list[int],
    config: VideoConfig,
    guard: _DecodeGuard,
) -> list[np.ndarray] | None:
    """The `wanted` frames, jumping to a keyframe where one lies between the last frame
    decoded and the next frame wanted; None where a seek misses (then decode in order)."""

    def picked(container):
        stream = guard.stream(container)
        frames, position = None, None  # the decoding iterator; the last timestamp it gave
        for target in (index.pts[i] for i in wanted):
            start = index.keyframe_pts[bisect.bisect_right(index.keyframe_pts, target) - 1]
            if frames is None or start > position:
                if start > index.pts[0] or frames is not None:
                    container.seek(start, stream=stream, backward=True, any_frame=False)
                frames = container.decode(stream)
            for frame in frames:
                guard.check_time()
                position = frame.pts
                if position is None or position >= target:
                    break
            if position != target:
                raise _MissedFrame
            yield frame

    try:
        with _open(data, container_format) as container:
            return _resized_frames(picked(container), len(wanted), config, guard)
    except _MissedFrame:
        return None


def _resized_frames(frames, num_frames: int, config: VideoConfig, guard: _DecodeGuard):
    """Decoded frames (PyAV) -> [H, W, 3] uint8 RGB, each resized to the video's final
    frame size (from the first frame's size and the number of frames)."""
    resized: list[np.ndarray] = []
    source_shape, size = None, None
    for frame in frames:
        guard.check_frame(frame)
        rgb = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
        if source_shape is None:
            source_shape = rgb.shape
            size = frame_size(rgb.shape[0], rgb.shape[1], num_frames, config)
        elif rgb.shape != source_shape:
            raise MediaError(
                "the video's frames change size; that is not supported", param=guard.param
            )
        resized.append(resize_frame(rgb, *size))  # type: ignore[misc]
    return resized


def sniff_container(data: bytes) -> str | None:
    """FFmpeg demuxer name for the container these bytes start with, or None."""
    head = data[:16]
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"):
        return "mov"  # MP4, MOV, 3GP, M4V: one demuxer
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"  # MKV and WebM
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    return None


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
    )


def qwen3_video_size(
    num_frames: int, height: int, width: int, config: VideoConfig
) -> tuple[int, int]:
    """Qwen3-VL's video smart_resize: sides rounded to the patch grid, scaled so that the
    video's frames (rounded to the temporal patch) times the frame's area stays within
    `min_pixels` .. `qwen3_max_pixels`."""
    frame = config.frame
    factor, temporal = frame.factor, frame.temporal_patch_size
    min_pixels, max_pixels = frame.min_pixels, config.qwen3_max_pixels(num_frames)
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


def load_video(
    data: bytes,
    config: VideoConfig,
    limits: VideoLimits = VideoLimits(),
    *,
    param: str | None = None,
) -> ProcessedImage:
    """Video file bytes -> encoder input: `decode_video` (sampled, resized frames), then
    temporal patches and the content hash."""
    video = decode_video(data, config, limits, param=param)
    seconds = second_per_grid_t(len(video.frames), video.total_frames, video.fps, config)
    indices = sample_frame_indices(video.total_frames, video.fps, config)[: len(video.frames)]
    times = temporal_patch_seconds(indices, video.fps, config)
    return _from_resized(np.stack(video.frames), config, seconds, times)


def process_video(frames: list[np.ndarray], config: VideoConfig) -> ProcessedImage:
    """Sampled full-size RGB frames ([H, W, 3] uint8, all one size) -> encoder input. The
    frames count as sampled at `config.fps`."""
    size = frame_size(frames[0].shape[0], frames[0].shape[1], len(frames), config)
    resized = np.stack([resize_frame(frame, *size) for frame in frames])
    times = temporal_patch_seconds(list(range(len(frames))), None, config)
    return _from_resized(resized, config, second_per_grid_t(0, 0, None, config), times)


def _from_resized(
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
