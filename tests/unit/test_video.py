"""engine/multimodal/video.py: frame sampling, decoding untrusted bytes, patch layout, hashes."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import sys

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("av")

from bench.local_inputs import moving_pictures, picture, video_bytes  # noqa: E402
from engine.errors import MediaError  # noqa: E402
from engine.multimodal.image_processor import ImageProcessorConfig, process_image  # noqa: E402
from engine.multimodal.video import (  # noqa: E402
    VideoConfig,
    frame_size,
    process_video,
    resize_frame,
    sample_frame_indices,
)
from engine.multimodal.video_decode import (  # noqa: E402
    VideoLimits,
    decode_video,
    load_video,
    sniff_container,
)

FRAME = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=448 * 448)
CONFIG = VideoConfig(FRAME, fps=2.0, max_frames=32)


@pytest.mark.parametrize(
    ("total", "video_fps", "max_frames", "expected"),
    [
        # transformers' Qwen2VLVideoProcessor.sample_frames(fps=2) gives the same lists:
        (10, 4.0, 32, [0, 2, 5, 7]),  # 2.5 s -> 5 frames -> 4 (a multiple of 2)
        (9, 5.0, 32, [0, 2, 4, 6]),  # 1.8 s -> 3.6 -> min_frames 4
        (40, 30.0, 8, [0, 10, 20, 30]),  # 1.3 s -> 2.7 -> min_frames 4
        (300, 30.0, 32, list(range(0, 300, 15))),  # 10 s -> 20 frames
        (3000, 30.0, 32, [round(i * 93.75 - 0.49) for i in range(32)]),  # capped at 32
        (3, 2.0, 32, [0, 1]),  # rounded down to one temporal patch
        (32, 2.0, 32, list(range(32))),
        (12, None, 8, [0, 1, 3, 4, 6, 7, 9, 10]),  # no frame rate: max_frames, spread evenly
    ],
)
def test_sampling_follows_transformers(total, video_fps, max_frames, expected):
    config = VideoConfig(FRAME, fps=2.0, max_frames=max_frames)
    assert sample_frame_indices(total, video_fps, config) == expected


def test_a_video_shorter_than_a_temporal_patch_keeps_its_frames():
    assert sample_frame_indices(1, 30.0, CONFIG) == [0]
    assert sample_frame_indices(0, 30.0, CONFIG) == []


@pytest.mark.parametrize(
    ("container", "codec"),
    [
        ("mp4", "mpeg4"),
        ("mp4", "libx264"),
        ("webm", "libvpx"),
        ("avi", "mpeg4"),
        ("matroska", "mpeg4"),
    ],
)
def test_decodes_the_sampled_frames(container, codec):
    frames = moving_pictures(96, 64, 10, salt=2)
    data = video_bytes(frames, fps=4, container=container, codec=codec)
    decoded, video_fps, _ = decode_video(data, CONFIG)
    assert video_fps == pytest.approx(4.0)
    assert len(decoded) == 4  # 2.5 s at 2 fps -> 5 -> 4
    assert all(frame.shape == (56, 84, 3) and frame.dtype == np.uint8 for frame in decoded)
    # The kept frames are frames 0, 2, 5 and 7: each decoded (and resized) frame is closest
    # to that original, resized (the codecs are lossy, so no equality).
    originals = [resize_frame(np.array(f), 56, 84).astype(int) for f in frames]
    for got, index in zip(decoded, [0, 2, 5, 7], strict=True):
        distances = [np.abs(original - got).mean() for original in originals]
        assert int(np.argmin(distances)) == index, (index, distances)


@pytest.mark.parametrize(
    ("width", "height", "count", "fps", "max_tokens"),
    [(640, 480, 8, 4, 16384), (28, 20, 64, 2, 64)],  # the second: min and max pixels close
)
def test_frames_are_resized_while_decoding(width, height, count, fps, max_tokens):
    """Only resized frames are kept (32 source frames of a 4K video would be ~800 MB), and
    the result equals processing the sampled full-size frames."""
    import av

    config = VideoConfig(FRAME, max_tokens=max_tokens)
    data = video_bytes(moving_pictures(width, height, count, salt=5), fps=fps, codec="libx264")
    decoded = decode_video(data, config).frames
    size = frame_size(height, width, len(decoded), config)
    assert [frame.shape for frame in decoded] == [(*size, 3)] * len(decoded)
    with av.open(io.BytesIO(data)) as container:
        everything = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    full_size = [everything[i] for i in sample_frame_indices(count, float(fps), config)]
    expected = process_video(full_size, config)
    got = load_video(data, config)
    assert got.grid_thw == expected.grid_thw
    assert torch.equal(got.pixel_levels, expected.pixel_levels)


@pytest.mark.parametrize(
    ("container", "codec", "options"),
    [
        ("mp4", "libx264", {"g": "8", "bf": "3"}),  # B-frames: decode order != display order
        ("mp4", "libx264", {"g": "8", "bf": "2", "x264-params": "open-gop=1"}),
        ("mp4", "mpeg4", {"g": "6", "bf": "2"}),
        ("webm", "libvpx-vp9", {"g": "8"}),
        ("matroska", "libx264", {"g": "5"}),
    ],
)
def test_seeking_gives_the_frames_decoding_in_order_gives(container, codec, options):
    """Sampled frames lie GOPs apart (90 frames, 8 sampled, a keyframe every 5-8): decoding
    jumps between keyframes and must still give frame i = the decoder's i-th output."""
    import av

    from engine.multimodal.video_decode import (
        _decode_by_seeking,
        _DecodeGuard,
        _index_packets,
        sniff_container,
    )

    data = video_bytes(
        moving_pictures(96, 64, 90, salt=3), fps=10, container=container, codec=codec,
        options=options,
    )
    config = VideoConfig(FRAME, fps=1.0, max_frames=8)
    container_format = sniff_container(data)
    guard = _DecodeGuard(VideoLimits(), None)
    index = _index_packets(data, container_format, guard)
    assert index.can_seek(90) and len(index.keyframe_pts) >= 10
    wanted = sample_frame_indices(90, 10.0, config)
    assert len(wanted) == 8 and wanted[-1] - wanted[0] > 70
    # No seek missed its frame (a miss would fall back to decoding in order).
    assert _decode_by_seeking(data, container_format, index, wanted, config, guard) is not None
    by_seeking = decode_video(data, config).frames
    in_order = decode_video(data, config, seek=False).frames
    with av.open(io.BytesIO(data)) as container_file:
        everything = [f.to_ndarray(format="rgb24") for f in container_file.decode(video=0)]
    size = by_seeking[0].shape[:2]
    expected = [resize_frame(everything[i], *size) for i in wanted]
    for got, ordered, want in zip(by_seeking, in_order, expected, strict=True):
        assert np.array_equal(got, want) and np.array_equal(ordered, want)


def test_a_seek_that_misses_its_frame_falls_back_to_decoding_in_order():
    from engine.multimodal.video_decode import _decode_by_seeking, _DecodeGuard, _index_packets

    data = video_bytes(moving_pictures(96, 64, 40, salt=4), fps=10, options={"g": "4"})
    guard = _DecodeGuard(VideoLimits(), None)
    index = _index_packets(data, "mov", guard)
    wanted = [0, 1, 20, 21]
    assert _decode_by_seeking(data, "mov", index, wanted, CONFIG, guard) is not None
    shifted = dataclasses.replace(index, pts=[pts + 1 for pts in index.pts])  # lands nowhere
    assert _decode_by_seeking(data, "mov", shifted, wanted, CONFIG, guard) is None


def test_an_animated_gif_is_a_video():
    frames = moving_pictures(64, 48, 6, salt=1)
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=250)
    decoded = decode_video(buffer.getvalue(), CONFIG).frames
    assert len(decoded) == 4 and decoded[0].shape == (56, 56, 3)  # resized to the bounds


def hls_playlist() -> bytes:
    return b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a supported video"),
        (b"hello, this is text, not a video at all", "not a supported video"),
        (hls_playlist(), "not a supported video"),  # never handed to a probing demuxer
        (b"ffconcat version 1.0\nfile /etc/passwd\n", "not a supported video"),
        (b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, "truncated or corrupt"),
    ],
)
def test_bad_bytes_are_media_errors(data, message):
    with pytest.raises(MediaError, match=message) as info:
        decode_video(data, CONFIG, param="messages[0].content[1]")
    assert info.value.param == "messages[0].content[1]"


def test_a_truncated_video_is_a_media_error_or_shorter():
    data = video_bytes(moving_pictures(96, 64, 10), fps=4)
    with pytest.raises(MediaError, match="truncated or corrupt|no decodable frames"):
        decode_video(data[: len(data) // 3], CONFIG)


def test_limits_are_checked_before_decoding():
    data = video_bytes(moving_pictures(96, 64, 10), fps=4)
    with pytest.raises(MediaError, match="96x64 = 6144 pixels; the limit is 6000"):
        decode_video(data, CONFIG, VideoLimits(max_frame_pixels=6000))
    with pytest.raises(MediaError, match="10 frames; the limit is 9"):
        decode_video(data, CONFIG, VideoLimits(max_source_frames=9))


def mjpeg_avi(sizes: list[tuple[int, int]]) -> bytes:
    """An MJPEG AVI whose frames have these (width, height)s: a stream that changes size
    after the first frames its header describes."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="avi") as out:
        stream = out.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = *sizes[0], "yuvj420p"
        for index, (width, height) in enumerate(sizes):
            jpeg = io.BytesIO()
            Image.new("RGB", (width, height), (128, 128, 128)).save(jpeg, "JPEG", quality=10)
            packet = av.Packet(jpeg.getvalue())
            packet.stream, packet.pts, packet.dts = stream, index, index
            out.mux(packet)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("big", "says"),
    [((2000, 2000), "a frame of the video is 2000x2000 = 4000000 pixels; the limit is 1000000"),
     ((4000, 4000), "truncated or corrupt")],  # past FFmpeg's own cap: never decoded
)  # fmt: skip
def test_a_frame_over_the_pixel_limit_is_refused_before_it_is_converted(big, says):
    """The limit was checked on the header's size only: frames that grow later were decoded
    and converted to RGB (768 MB for one 16000 x 16000 frame) before the size change was
    seen. Nothing near a big frame's RGB (12 or 48 MB here) is allocated now."""
    import tracemalloc

    data = mjpeg_avi([(64, 48)] * 4 + [big] * 4)
    tracemalloc.start()
    try:
        with pytest.raises(MediaError, match=says):
            decode_video(data, CONFIG, VideoLimits(max_frame_pixels=1_000_000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8_000_000, peak


@pytest.mark.parametrize(("width", "height"), [(100, 100), (64, 48), (30, 200)])
def test_frames_exactly_at_the_pixel_limit_decode(width, height):
    """FFmpeg's own cap counts the width rounded up to 64: frames at the limit were refused
    as "truncated or corrupt" when that cap was the limit itself."""
    data = mjpeg_avi([(width, height)] * 4)
    decoded = decode_video(data, CONFIG, VideoLimits(max_frame_pixels=width * height))
    assert len(decoded.frames) == 4
    with pytest.raises(MediaError, match="the limit is"):
        decode_video(data, CONFIG, VideoLimits(max_frame_pixels=width * height - 1))


def test_a_decode_that_runs_past_its_time_is_refused():
    """A few kilobytes of GIF (one-pixel frames on a huge canvas) decoded for minutes."""
    frames = moving_pictures(64, 48, 6, salt=1)
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=250)
    seekable = video_bytes(moving_pictures(96, 64, 10), fps=4)
    for data in (buffer.getvalue(), seekable):  # decoded in order; by seeking
        with pytest.raises(MediaError, match="took over 1e-09 s") as info:
            decode_video(data, CONFIG, VideoLimits(max_decode_seconds=1e-9), param="v")
        assert info.value.param == "v"
        assert len(decode_video(data, CONFIG, VideoLimits(max_decode_seconds=30)).frames) == 4


def test_sniffing_names_one_demuxer_per_container():
    assert sniff_container(b"\x00\x00\x00\x20ftypisom") == "mov"
    assert sniff_container(b"\x1a\x45\xdf\xa3\x01") == "matroska"
    assert sniff_container(b"RIFF\x00\x00\x00\x00AVI LIST") == "avi"
    assert sniff_container(b"GIF89a") == "gif"
    assert sniff_container(b"RIFF\x00\x00\x00\x00WEBPVP8 ") is None  # a still image


def frames_of(*images: Image.Image) -> list[np.ndarray]:
    return [np.array(image) for image in images]


def test_a_still_video_has_the_image_path_patches():
    """Two equal frames of a size that needs no resize make exactly the image's patches:
    the image path (checked against transformers' image processor) repeats one frame
    along the temporal patch."""
    image = picture(84, 56, 3)
    video = process_video(frames_of(image, image), CONFIG)
    still = process_image(image, FRAME)
    assert video.grid_thw == still.grid_thw == (1, 4, 6)
    assert torch.equal(video.pixel_levels, still.pixel_levels)
    assert video.num_tokens == still.num_tokens == 6
    assert video.content_hash != still.content_hash  # kinds never share encoder rows


def test_consecutive_frames_pair_along_the_temporal_patch():
    a, b, c = picture(84, 56, 1), picture(84, 56, 2), picture(84, 56, 3)
    video = process_video(frames_of(a, b, c), CONFIG)
    assert video.grid_thw == (2, 4, 6)  # three frames padded to four with the last
    rows = video.pixel_levels.view(2, 24, 3, 2, 14 * 14)  # [t, rows, C, T, P*P]
    patches = {
        name: process_image(image, FRAME).pixel_levels.view(24, 3, 2, 14 * 14)[:, :, 0]
        for name, image in (("a", a), ("b", b), ("c", c))
    }
    assert torch.equal(rows[0, :, :, 0], patches["a"]) and torch.equal(
        rows[0, :, :, 1], patches["b"]
    )
    assert torch.equal(rows[1, :, :, 0], patches["c"]) and torch.equal(
        rows[1, :, :, 1], patches["c"]
    )


def test_frames_are_resized_like_transformers_video_processor():
    """The resize is torch's uint8 bicubic antialias kernel, which torchvision's resize
    runs for uint8 on CPU. Against PIL's bicubic (the image path) it may differ by a level."""
    image = picture(300, 200, 4)
    video = process_video(frames_of(image, image), CONFIG)
    expected = torch.nn.functional.interpolate(
        torch.from_numpy(np.array(image)).permute(2, 0, 1)[None],
        size=(196, 308),
        mode="bicubic",
        antialias=True,
        align_corners=False,
    )
    assert video.grid_thw == (1, 14, 22)
    # Undo the patch layout of frame 0 and compare with the resized frame.
    rows = video.pixel_levels.view(7, 11, 2, 2, 3, 2, 14, 14)[..., 0, :, :]  # T=0
    frame = rows.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, 196, 308)
    assert torch.equal(frame, expected[0])


def test_a_token_budget_shrinks_the_frames_as_transformers_cap_does():
    frames = frames_of(*moving_pictures(640, 480, 4))
    uncapped = process_video(frames, VideoConfig(FRAME, max_tokens=None))
    assert uncapped.grid_thw == (2, 26, 36) and uncapped.num_tokens == 468  # 448x448 bound
    config = VideoConfig(FRAME, max_tokens=64)
    # 90% of 64 tokens of 28x28 px, times 2 frames per token, over 4 frames: 22579 px.
    assert config.frame_max_pixels(4) == 22579
    capped = process_video(frames, config)
    assert capped.grid_thw == (2, 8, 12) and capped.num_tokens == 48
    # Never below 1.05 x min_pixels, however many frames share the budget.
    assert config.frame_max_pixels(10_000) == int(56 * 56 * 1.05)


def test_a_token_budget_bounds_a_whole_qwen3_vl_video():
    """On Qwen3-VL the budget capped each frame (transformers' per-frame meaning of its own
    max_video_tokens): a 16-frame clip cost ~1946 tokens under --max-video-tokens 256."""
    from engine.multimodal.video import qwen3_video_size

    frame = ImageProcessorConfig(min_pixels=4096, max_pixels=25_165_824, patch_size=16)
    for max_tokens, frames in ((256, 16), (256, 64), (2000, 32)):
        config = VideoConfig(frame, max_tokens=max_tokens, qwen3=True)
        height, width = qwen3_video_size(frames, 480, 640, config)
        tokens = frames // 2 * (height // 32) * (width // 32)
        assert 0.7 * max_tokens <= tokens <= 0.9 * max_tokens, (max_tokens, frames, tokens)
    # The default budget leaves the model's own bound (12288 tokens) to bind.
    config = VideoConfig(frame, qwen3=True)
    assert config.qwen3_max_pixels() == frame.max_pixels


def test_fewer_than_four_frames_without_a_video_config(tmp_path):
    """The start-up failed with a traceback: min_frames stayed at 4 over a max of 2."""
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 3136, "max_pixels": 200704}')
    for max_frames in (1, 2, 3):
        config = VideoConfig.from_model_dir(tmp_path, max_frames=max_frames)
        assert config.min_frames == config.max_frames == max_frames


def test_content_hash_follows_the_frames_and_the_settings():
    frames = frames_of(*moving_pictures(84, 56, 4))
    first = process_video(frames, CONFIG)
    assert process_video(frames, CONFIG).content_hash == first.content_hash
    assert process_video(frames[::-1], CONFIG).content_hash != first.content_hash
    other = VideoConfig(ImageProcessorConfig(min_pixels=56 * 56, max_pixels=56 * 84), fps=2.0)
    assert process_video(frames, other).content_hash != first.content_hash


def test_model_folder_video_config(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 3136, "max_pixels": 200704}')
    config = VideoConfig.from_model_dir(tmp_path, fps=1.0, max_frames=8)
    assert (config.frame.max_pixels, config.fps, config.max_frames) == (200704, 1.0, 8)
    (tmp_path / "video_preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 100352, "longest_edge": 602112}, "min_frames": 2}'
    )
    config = VideoConfig.from_model_dir(tmp_path, max_frames=8)
    assert (config.frame.min_pixels, config.frame.max_pixels) == (100352, 602112)
    assert config.min_frames == 2


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None,
    reason="transformers' video processor needs torchvision",
)
def test_matches_transformers_video_processor(tmp_path):
    """Where torchvision is importable: the same levels as Qwen2VLVideoProcessor with
    do_sample_frames=True, fps=2, with and without its whole-video token cap (normalised
    values within one float32 ulp)."""
    from bench.hf_baseline import patch_broken_torchvision

    patch_broken_torchvision()
    transformers = pytest.importorskip("transformers")
    import av
    from transformers.video_utils import VideoMetadata

    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m")
    processor = transformers.AutoVideoProcessor.from_pretrained(model_dir)
    clips = [(160, 120, 10, 4), (200, 90, 9, 5), (320, 240, 40, 30)]
    for max_tokens in (None, 64):
        config = VideoConfig.from_model_dir(model_dir, max_tokens=max_tokens)
        cap = {"cap_pixels_per_frame": max_tokens is not None}
        processor.max_video_tokens = max_tokens or 0  # read from the processor, not the call
        for width, height, count, fps in clips:
            data = video_bytes(moving_pictures(width, height, count, salt=count), fps=fps)
            ours = load_video(data, config)
            video_fps = decode_video(data, config).fps
            with av.open(io.BytesIO(data)) as container:
                everything = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            video = torch.from_numpy(np.stack(everything)).permute(0, 3, 1, 2)
            metadata = VideoMetadata(
                total_num_frames=len(everything), fps=video_fps, width=width, height=height
            )
            out = processor(
                videos=[video],
                video_metadata=[metadata],
                do_sample_frames=True,
                fps=2.0,
                max_frames=32,
                return_tensors="pt",
                **cap,
            )
            assert out["video_grid_thw"].tolist() == [list(ours.grid_thw)], (max_tokens, width)
            expected = out["pixel_values_videos"]
            assert torch.allclose(ours.pixel_values, expected, rtol=0, atol=1e-6)
    assert "torchvision" in sys.modules


def test_a_video_too_wide_is_named_a_video():
    """Qwen2.5-VL's refusal of a 4000x16 video said "image aspect ratio" (fuzz67)."""
    with pytest.raises(MediaError, match="^video aspect ratio must be at most 200:1"):
        frame_size(16, 4000, 4, CONFIG)
    with pytest.raises(MediaError, match="^image aspect ratio"):
        process_image(picture(4000, 16, 1), FRAME)
