"""engine/multimodal/processing.py: a request's mm_processor_kwargs, checked as raw values
(the offline LLM has no pydantic in front of it)."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.processing import SUPPORTED_KWARGS, MediaProcessing
from engine.multimodal.video import VideoConfig
from server.media_options import MediaProcessingOptions

IMAGE = ImageProcessorConfig(min_pixels=3136, max_pixels=1_000_000)
DEFAULT = MediaProcessing(IMAGE, VideoConfig(IMAGE, max_frames=16))


def test_the_http_model_names_the_same_keys():
    assert MediaProcessingOptions.SUPPORTED == SUPPORTED_KWARGS


def test_no_kwargs_keep_the_settings():
    assert DEFAULT.narrowed(None) is DEFAULT and DEFAULT.narrowed({}) is DEFAULT


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"num_frames": 8}, "mm_processor_kwargs"),
        ({"fps": 0}, "mm_processor_kwargs.fps"),
        ({"fps": float("inf")}, "mm_processor_kwargs.fps"),
        ({"fps": "2"}, "mm_processor_kwargs.fps"),
        ({"fps": True}, "mm_processor_kwargs.fps"),
        ({"max_frames": 2.0}, "mm_processor_kwargs.max_frames"),
        ({"max_frames": False}, "mm_processor_kwargs.max_frames"),
        ({"min_pixels": -1}, "mm_processor_kwargs.min_pixels"),
        ({"min_pixels": 5000, "max_pixels": 4000}, "mm_processor_kwargs"),
        ({"max_frames": 17}, "mm_processor_kwargs.max_frames"),  # over the server's 16
        ({"max_pixels": 1_000_001}, "mm_processor_kwargs.max_pixels"),  # over the model's
    ],
)
def test_bad_kwargs_name_the_key(kwargs, param):
    with pytest.raises(InvalidRequest) as error:
        DEFAULT.narrowed(kwargs)
    assert error.value.param == param


def test_kwargs_narrow_both_kinds():
    chosen = DEFAULT.narrowed({"fps": 1, "max_frames": 3, "max_pixels": 200_000})
    assert chosen.image.max_pixels == chosen.video.frame.max_pixels == 200_000
    assert (chosen.video.fps, chosen.video.max_frames, chosen.video.min_frames) == (1.0, 3, 3)
    assert chosen.cache_tag("video") != DEFAULT.cache_tag("video")
    assert chosen.cache_tag("image") != DEFAULT.cache_tag("image")


def test_a_requests_pixel_bounds_leave_qwen3_vl_videos_to_their_own():
    """Qwen3-VL's video bounds are on the whole video (t x h x w), and its processor takes
    no per-frame ones: a request's max_pixels of 8192 shrank a video's frames to 2048 px."""
    qwen3 = MediaProcessing(IMAGE, VideoConfig(IMAGE, max_frames=16, qwen3=True))
    chosen = qwen3.narrowed({"max_pixels": 200_000, "min_pixels": 5000})
    assert chosen.image.max_pixels == 200_000 and chosen.image.min_pixels == 5000
    assert chosen.video.frame == IMAGE
