"""What one `video_url` costs the API process: decode (PyAV) with the sampled frames
converted and resized as they come, then temporal patches + content hash, per clip,
against decoding in order (no seeking) and decoding and converting every frame.

    PYTHONPATH=. .venv/bin/python bench/video_path.py [--repeats 3]

Clips are H.264 (libx264, ultrafast) of a smooth moving gradient, made here: 5 s of
640x360, 10 s of 1280x720 and 30 s of 854x480 (x264's default keyframe interval, 250
frames), and 2 min of 854x480 with a keyframe every 2 s, all at 30 fps. Each line prints
the median of `--repeats` runs: `decode_video` (decode, jumping between keyframes where
that skips frames, + the sampled frames' RGB conversion and resize), the same with
`seek=False` (every frame up to the last sampled one is decoded), `load_video` (seeking
decode plus patches and hash: Tessera's whole cost), and the time to decode and convert
every frame of the clip (what a loader that samples after converting pays), side by side
in one run. Last, the server's media fetcher preprocesses a 640x480 PNG alone and then
while two of the 30 s clips decode (data: URLs, no cache): videos have their own decode
threads, so the image does not queue behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import time
from functools import partial

import numpy as np

from bench.local_inputs import picture, png_bytes
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.video import VideoConfig
from engine.multimodal.video_decode import decode_video, load_video
from server.media_fetch import MediaFetchConfig, MediaFetcher

CLIPS = [  # name, width, height, frames, keyframe interval (None: x264's 250)
    ("5 s 640x360", 640, 360, 150, None),
    ("10 s 1280x720", 1280, 720, 300, None),
    ("30 s 854x480", 854, 480, 900, None),
    ("2 min 854x480 g60", 854, 480, 3600, 60),
]
# Qwen2-VL-2B-Instruct's preprocessor_config.json bounds (transformers applies them to
# video frames too when the folder has no video_preprocessor_config.json).
REAL_FRAME = ImageProcessorConfig(min_pixels=3136, max_pixels=12845056)


def h264_clip(
    width: int, height: int, num_frames: int, keyint: int | None = None, fps: int = 30
) -> bytes:
    import av

    y, x = np.mgrid[0:height, 0:width]
    buffer = io.BytesIO()
    options = {"preset": "ultrafast", **({"g": str(keyint)} if keyint else {})}
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream("libx264", rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(num_frames):
            shift = 3 * index
            frame = np.stack(
                [(x + shift) % 256, (y + shift) % 256, (x + y + 2 * shift) % 256], axis=-1
            ).astype(np.uint8)
            output.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        output.mux(stream.encode())
    return buffer.getvalue()


def decode_everything(data: bytes) -> int:
    import av

    with av.open(io.BytesIO(data), format="mov") as container:
        return sum(
            1 for frame in container.decode(video=0) if frame.to_ndarray(format="rgb24").size
        )


def timed(function, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = VideoConfig(REAL_FRAME, fps=2.0, max_frames=32)
    print(
        f"{'clip':<20}{'MB':>6}{'frames':>8}{'grid':>12}{'tokens':>8}"
        f"{'decode+resize ms':>18}{'in order ms':>13}{'total ms':>10}{'every frame ms':>16}"
    )
    for name, width, height, num_frames, keyint in CLIPS:
        data = h264_clip(width, height, num_frames, keyint)
        decode_ms, (frames, _) = timed(partial(decode_video, data, config), args.repeats)
        in_order_ms, (ordered, _) = timed(
            partial(decode_video, data, config, seek=False), args.repeats
        )
        assert all(np.array_equal(a, b) for a, b in zip(frames, ordered, strict=True))
        total_ms, video = timed(partial(load_video, data, config), args.repeats)
        everything_ms, _ = timed(partial(decode_everything, data), args.repeats)
        grid = "x".join(str(v) for v in video.grid_thw)
        print(
            f"{name:<20}{len(data) / 1e6:>6.1f}{len(frames):>8}{grid:>12}{video.num_tokens:>8}"
            f"{decode_ms:>18.1f}{in_order_ms:>13.1f}{total_ms:>10.1f}{everything_ms:>16.1f}"
        )
    clip = h264_clip(854, 480, 900)
    runs = [asyncio.run(image_beside_videos(clip, config)) for _ in range(args.repeats)]
    alone, beside = (statistics.median(run[i] for run in runs) * 1e3 for i in (0, 1))
    print(f"640x480 PNG preprocessed alone: {alone:.1f} ms; while two 30 s clips decode: "
          f"{beside:.1f} ms")  # fmt: skip


async def image_beside_videos(video: bytes, config: VideoConfig) -> tuple[float, float]:
    """Seconds to preprocess a PNG alone, then while two videos decode."""
    video_url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    images = [
        "data:image/png;base64," + base64.b64encode(png_bytes(picture(640, 480, s))).decode()
        for s in range(2)
    ]
    fetcher = MediaFetcher(MediaFetchConfig(processed_image_cache_bytes=0), REAL_FRAME, config)
    try:
        start = time.perf_counter()
        await fetcher.load(images[0], "image", param="image")
        alone = time.perf_counter() - start
        videos = [asyncio.create_task(fetcher.load(video_url, "video", param="v")) for _ in "ab"]
        await asyncio.sleep(0.02)  # both videos are decoding
        start = time.perf_counter()
        await fetcher.load(images[1], "image", param="image")
        beside = time.perf_counter() - start
        await asyncio.gather(*videos)
        return alone, beside
    finally:
        await fetcher.aclose()


if __name__ == "__main__":
    main()
