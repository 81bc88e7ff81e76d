"""How one request's images and videos are preprocessed: the server's (or `LLM`'s) settings,
or those narrowed by the request's `mm_processor_kwargs`.

The keys are the names transformers' Qwen2-VL processors take (what vLLM hands them):
`fps` and `max_frames` for videos, `min_pixels` and `max_pixels` for images and video
frames. A request may lower the bounds, never raise them: `max_frames` above the server's
and pixels above the model's image bound are refused; video frames also keep the model's
own (often lower) video bound, and the video token budget still shares out the pixels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from engine.errors import InvalidRequest
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.video import VideoConfig

MediaKind = Literal["image", "video"]
SUPPORTED_KWARGS = ("fps", "max_frames", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class MediaProcessing:
    """The image settings and the video settings one request's media are processed with."""

    image: ImageProcessorConfig
    video: VideoConfig

    def cache_tag(self, kind: MediaKind) -> str:
        """Names the settings a `kind` item is processed under (a processed-media cache key
        must include them)."""
        return repr(self.image if kind == "image" else self.video)

    def narrowed(
        self, kwargs: Mapping[str, Any] | None, *, param: str = "mm_processor_kwargs"
    ) -> MediaProcessing:
        """These settings under a request's `mm_processor_kwargs`; `InvalidRequest` naming
        `param.<key>` for an unknown key, a bad value or a bound above these settings'."""
        if not kwargs:
            return self
        unknown = sorted(str(key) for key in kwargs if key not in SUPPORTED_KWARGS)
        if unknown:
            raise InvalidRequest(
                f"unsupported key(s) {', '.join(unknown)[:200]}; supported: "
                + ", ".join(SUPPORTED_KWARGS),
                param=param,
            )
        fps, max_frames, min_pixels, max_pixels = (kwargs.get(k) for k in SUPPORTED_KWARGS)
        if fps is not None and not _is_positive_number(fps):
            raise InvalidRequest("fps must be a positive number", param=f"{param}.fps")
        for name, value in (("max_frames", max_frames), ("min_pixels", min_pixels),
                            ("max_pixels", max_pixels)):  # fmt: skip
            if value is not None and (type(value) is not int or value < 1):
                raise InvalidRequest(f"{name} must be a positive integer", param=f"{param}.{name}")
        if min_pixels and max_pixels and min_pixels > max_pixels:
            raise InvalidRequest(
                f"min_pixels ({min_pixels}) is larger than max_pixels ({max_pixels})", param=param
            )
        image, video = self.image, self.video
        if max_frames is not None and max_frames > video.max_frames:
            raise InvalidRequest(
                f"max_frames {max_frames} is over this server's limit of {video.max_frames} "
                "(--max-video-frames)",
                param=f"{param}.max_frames",
            )
        for name, value in (("max_pixels", max_pixels), ("min_pixels", min_pixels)):
            if value is not None and value > image.max_pixels:
                raise InvalidRequest(
                    f"{name} {value} is over the model's max_pixels of {image.max_pixels}",
                    param=f"{param}.{name}",
                )
        max_frames = max_frames or video.max_frames
        # Qwen3-VL's video bounds are on the whole video, and its processor takes no
        # per-frame ones (transformers'): there a request's bounds are its images' only.
        frame = video.frame if video.qwen3 else _pixel_bounds(video.frame, min_pixels, max_pixels)
        return MediaProcessing(
            _pixel_bounds(image, min_pixels, max_pixels),
            replace(
                video,
                frame=frame,
                fps=float(fps or video.fps),
                max_frames=max_frames,
                min_frames=min(video.min_frames, max_frames),
            ),
        )


def _is_positive_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _pixel_bounds(
    config: ImageProcessorConfig, min_pixels: int | None, max_pixels: int | None
) -> ImageProcessorConfig:
    """`config` with a request's area bounds: never above its own `max_pixels`."""
    upper = min(max_pixels or config.max_pixels, config.max_pixels)
    lower = min(min_pixels or config.min_pixels, upper)
    return replace(config, min_pixels=lower, max_pixels=upper)
