"""`tessera encode-features`: run a model's own vision tower over images and videos, write
features.

    tessera encode-features --model DIR --output OUT FILE [FILE ...]

Each file is decoded and preprocessed exactly as the server does (a video file — MP4/MOV,
WebM/Matroska, AVI — is sampled at `--video-fps`, at most `--max-video-frames` frames, as
the server's defaults; anything else is an image), encoded by the model's vision tower
(patch merger included), and written as `<OUT>/<file stem>.safetensors` with tensors
`embeds` [num_tokens, hidden_size] (Qwen3-VL: hidden_size x (1 + deepstack levels), the
levels beside the merged rows) and `grid_thw` [3] (int64). OUT is a local folder or
`s3://bucket/prefix` (aioboto3; `--s3-endpoint-url` or the standard AWS env). One JSON line
per file goes to stdout: {"image" or "video", "url", "grid_thw", "num_tokens"} and, for a
video, "second_per_grid_t" (the seconds one temporal patch spans, by which Qwen2.5-VL spaces
video positions) and "frame_seconds" (each temporal patch's time, which Qwen3-VL writes
into the prompt): what a chat request's `image_features` / `video_features` part needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save

from engine.attention import get_attention_backend
from engine.models.loader import load_model
from engine.multimodal.image_processor import ImageProcessorConfig, process_image
from engine.multimodal.media import decode_image
from engine.multimodal.video import (
    DEFAULT_FPS,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_TOKENS,
    VideoConfig,
)
from engine.multimodal.video_decode import load_video, sniff_container

VIDEO_CONTAINERS = ("mov", "matroska", "avi")  # an animated GIF stays an image, as on the server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera encode-features",
        description="Encode images and videos with a model's vision tower into safetensors "
        "feature files.",
    )
    parser.add_argument("images", nargs="+", metavar="FILE", help="image or video files")
    parser.add_argument("--model", required=True, help="local Hugging Face checkpoint folder")
    parser.add_argument("--output", required=True, help="folder or s3://bucket/prefix")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--s3-endpoint-url", default=None)
    parser.add_argument("--video-fps", type=float, default=DEFAULT_FPS, help="frames per second")
    parser.add_argument("--max-video-frames", type=int, default=DEFAULT_MAX_FRAMES)
    parser.add_argument("--max-video-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    return parser


@torch.inference_mode()
def encode_file(
    model, image_config: ImageProcessorConfig, video_config: VideoConfig, path: Path, device
) -> tuple:
    """(embeds [num_tokens, hidden] float32 on host, the ProcessedImage, "image" | "video")
    of one image or video file."""
    data = path.read_bytes()
    if sniff_container(data) in VIDEO_CONTAINERS:
        kind = "video"
        image = load_video(data, video_config)
    else:
        kind = "image"
        image = process_image(decode_image(data), image_config)
    model_dtype = next(model.parameters()).dtype
    pixel_values = image.pixel_values.to(device=device, dtype=model_dtype)  # [P, C*T*P*P]
    grid = torch.tensor([image.grid_thw], dtype=torch.long, device=device)  # [1, 3]
    embeds = model.encode_images(pixel_values, grid)  # [num_tokens, hidden]
    return embeds.float().cpu(), image, kind


def feature_file_bytes(embeds: torch.Tensor, grid_thw: tuple[int, int, int], dtype: str) -> bytes:
    return save(
        {
            "embeds": embeds.to(getattr(torch, dtype)).contiguous(),
            "grid_thw": torch.tensor(grid_thw, dtype=torch.int64),
        }
    )


async def _upload(files: dict[str, bytes], endpoint_url: str | None) -> None:
    import aioboto3

    async with aioboto3.Session().client("s3", endpoint_url=endpoint_url) as s3:
        for url, data in files.items():
            bucket, _, key = url.removeprefix("s3://").partition("/")
            await s3.put_object(Bucket=bucket, Key=key, Body=data)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(
        args.model, dtype=dtype, device=device, attention=get_attention_backend("torch")
    )
    config = ImageProcessorConfig.from_model_dir(args.model)
    video_config = VideoConfig.from_model_dir(
        args.model,
        fps=args.video_fps,
        max_frames=args.max_video_frames,
        max_tokens=args.max_video_tokens,
    )
    output = args.output.rstrip("/")
    files: dict[str, bytes] = {}
    for name in args.images:
        path = Path(name)
        embeds, image, kind = encode_file(model, config, video_config, path, device)
        url = f"{output}/{path.stem}.safetensors"
        files[url] = feature_file_bytes(embeds, tuple(image.grid_thw), args.dtype)
        line = {kind: name, "url": url, "grid_thw": list(image.grid_thw)}
        line["num_tokens"] = embeds.shape[0]
        if kind == "video":
            line["second_per_grid_t"] = image.second_per_grid_t
            line["frame_seconds"] = list(image.frame_seconds)
        print(json.dumps(line))
    if output.startswith("s3://"):
        asyncio.run(_upload(files, args.s3_endpoint_url))
    else:
        Path(output).mkdir(parents=True, exist_ok=True)
        for url, data in files.items():
            Path(url).write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
