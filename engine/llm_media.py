"""The offline `LLM`'s media content parts: `{"type": "image", "image": ...}` and
`{"type": "video", "video": ...}` processed for the model, and `image_url` / `video_url`
parts with a data: URL turned into them (engine/llm.py)."""

from __future__ import annotations

import numpy as np
import PIL.Image

from engine.errors import InvalidRequest


def processed_media(part: dict, param: str, processing):
    """ProcessedImage of an {"type": "image"} or {"type": "video"} content part under
    `processing` (a MediaProcessing)."""
    from engine.multimodal.image_processor import process_image
    from engine.multimodal.media import decode_image
    from engine.multimodal.video import process_video
    from engine.multimodal.video_decode import load_video

    if processing is None:
        raise InvalidRequest("this model takes no images or videos", param=param)

    if part["type"] == "image":
        image = part.get("image")
        if isinstance(image, (bytes, bytearray)):
            image = decode_image(bytes(image), param=param)
        if not isinstance(image, PIL.Image.Image):
            raise InvalidRequest(
                f"an image part's 'image' is a PIL image or encoded bytes, not "
                f"{type(image).__name__}",
                param=param,
            )
        return process_image(image, processing.image)
    video = part.get("video")
    if isinstance(video, (bytes, bytearray)):
        return load_video(bytes(video), processing.video, param=param)
    if not isinstance(video, (list, tuple)) or not video:
        raise InvalidRequest(
            "a video part's 'video' is a file's bytes or a list of frames", param=param
        )
    frames = [  # sampled by the caller
        np.array(frame.convert("RGB") if hasattr(frame, "convert") else frame) for frame in video
    ]
    if not all(f.dtype == np.uint8 and f.ndim == 3 and f.shape[2] == 3 for f in frames):
        raise InvalidRequest(
            "a video's frames are PIL images or [H, W, 3] uint8 arrays", param=param
        )
    return process_video(frames, processing.video)


def inlined(part: dict, kind: str, param: str) -> dict:
    """An `image_url` / `video_url` part holding a data: URL as the offline form: its
    decoded bytes. vLLM's LLM.chat also fetches http(s) and file URLs; here that stays the
    server's (its fetcher's SSRF guard, allowed domains and folders are server settings)."""
    from engine.multimodal.media import decode_data_url, is_data_url

    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not is_data_url(url):
        raise InvalidRequest(
            f"LLM.chat takes a {kind} part with a data: URL (base64); fetch other URLs "
            "yourself and pass the bytes as {'type': 'image', 'image': ...}, or use the server",
            param=param,
        )
    modality = kind.removesuffix("_url")
    # The caller's own bytes: bounded by memory alone, as an image passed as bytes is.
    data = decode_data_url(url, max_bytes=len(url), param=param)
    return {"type": modality, modality: data}
