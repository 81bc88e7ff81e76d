"""Decoding untrusted video bytes with PyAV: the sampled frames, resized as they come.

Only a few containers are opened, each with its own demuxer named explicitly (MP4/MOV,
Matroska/WebM, AVI, GIF): letting FFmpeg probe the format would also admit demuxers such as
HLS or concat that read further files or URLs named inside the data. Decoding jumps from
keyframe to keyframe where that skips frames (`decode_video`); the frames are those a
decode of every frame gives.

`load_video` is the whole path from bytes to encoder input: `decode_video`, then
engine/multimodal/video.py's temporal patches and content hash. `VideoLimits` bound what
one video may cost: its frame size (checked on the header and again, loosely, by the
decoder), its frame count and its decoding time.
"""

from __future__ import annotations

import bisect
import io
import itertools
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from engine.errors import MediaError
from engine.multimodal.image_processor import ProcessedImage
from engine.multimodal.video import (
    VideoConfig,
    frame_size,
    from_resized_frames,
    resize_frame,
    sample_frame_indices,
    second_per_grid_t,
    temporal_patch_seconds,
)

SUPPORTED_CONTAINERS = "MP4/MOV, WebM/Matroska, AVI, GIF"
# Demuxers that give every packet its presentation timestamp and seek by it through an
# index. AVI and GIF decode in order (no reliable timestamps; a GIF frame draws over the
# previous one).
SEEKABLE_CONTAINERS = ("mov", "matroska")


class DecodedVideo(NamedTuple):
    frames: list[np.ndarray]  # the sampled frames, resized, [H, W, 3] uint8 RGB
    fps: float | None  # the file's frame rate, None when it declares none
    total_frames: int  # frames in the file


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

    def check_frame_count(self, num_frames: int) -> None:
        if num_frames > self.limits.max_source_frames:
            raise MediaError(
                f"the video has {num_frames} frames; the limit is {self.limits.max_source_frames}",
                param=self.param,
            )

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
    # The clock runs from here: FFmpeg's probe as a file opens reads up to 5 MB of its
    # packets (~2.6 s for a million one-byte ones), and a decode opens the file up to three
    # times; listing a file's packets took 50 s before the decode's own limit started
    # (fuzz67).
    guard = _DecodeGuard(limits, param)
    try:
        with _open(data, container_format, guard) as container:
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
        guard.check_frame_count(declared_frames)
        index = None
        if not declared_frames or (seek and container_format in SEEKABLE_CONTAINERS):
            index = _index_packets(data, container_format, guard)
        total = declared_frames or len(index.pts)  # type: ignore[union-attr]
        guard.check_frame_count(total)
        video_fps = float(rate) if rate else None
        wanted = sample_frame_indices(total, video_fps, config)
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


def _open(data: bytes, container_format: str, guard: _DecodeGuard):
    """The container, once FFmpeg has probed it (which cannot be stopped midway: its time
    counts against the decode's, checked once it returns)."""
    import av  # PyAV: imported here so that an image-only process does not load FFmpeg

    container = av.open(io.BytesIO(data), mode="r", format=container_format)
    try:
        guard.check_time()
    except MediaError:
        container.close()
        raise
    return container


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


def _index_packets(data: bytes, container_format: str, guard: _DecodeGuard) -> _PacketIndex:
    """Demux (no decoding) the first video stream's packets, within the decode's time and
    frame limits."""
    pts: list[int | None] = []
    keyframes: list[int] = []
    with _open(data, container_format, guard) as container:
        for packet in container.demux(container.streams.video[0]):
            if packet.size:  # the demuxer's final empty packet is not a frame
                pts.append(packet.pts)
                if packet.is_keyframe and packet.pts is not None:
                    keyframes.append(packet.pts)
                if len(pts) % 1024 == 0:
                    guard.check_time()
                    guard.check_frame_count(len(pts))
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

    with _open(data, container_format, guard) as container:
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
        with _open(data, container_format, guard) as container:
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
    return from_resized_frames(np.stack(video.frames), config, seconds, times)
