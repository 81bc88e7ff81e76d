"""Media items placed at their prompt spans (`PromptProcessor.process_chat`'s).

Usually one item, one span: the item gets the span's offset. A video that the prompt lays
out temporal patch by temporal patch (Qwen3-VL writes each patch's time before it) becomes
one item per patch: grid (1, h, w), the patch's rows of the video's pixels (or of its
pre-encoded features: `FeatureSource.rows`), and a content hash of its own. Qwen3-VL's
tower attends within frames and places its learned positions per frame, so a patch
encoded alone gives the rows it gets inside the whole video.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from engine.multimodal.image_processor import ProcessedImage
from engine.multimodal.prompt import PlaceholderSpan
from engine.protocol import MediaInput, Modality
from engine.serialization import tensor_ref


def media_input(
    modality: Modality, image: ProcessedImage, frame: int, content_hash: str | None = None
) -> MediaInput:
    """The unplaced item (offset 0) of a processed image or video whose pixel levels go in
    extra frame `frame`; `content_hash`: its cache key, if not the pixels' hash (a uuid)."""
    return MediaInput(
        modality=modality,
        content_hash=content_hash or image.content_hash,
        offset=0,
        num_tokens=image.num_tokens,
        grid_thw=tuple(image.grid_thw),
        pixel_values=tensor_ref(frame, image.pixel_levels),
        normalization=image.normalization,
        second_per_grid_t=image.second_per_grid_t,
    )


def place_media(
    items: Sequence[MediaInput], spans: Sequence[PlaceholderSpan], tensors: Sequence[torch.Tensor]
) -> tuple[list[MediaInput], list[torch.Tensor]]:
    """The items at their spans (offset 0 going in), and the tensors they refer to now
    (a temporal patch's rows are a view of its video's)."""
    placed: list[MediaInput] = []
    carried: list[torch.Tensor] = []
    for span in spans:
        item = items[span.item]
        pixels = None if item.pixel_values is None else tensors[item.pixel_values.frame]
        changes: dict = {"offset": span.offset}
        if span.frame is not None:
            _, h, w = item.grid_thw
            changes.update(
                num_tokens=span.num_tokens,
                grid_thw=(1, h, w),
                frame=span.frame,
            )
            if pixels is not None:
                pixels = pixels[span.frame * h * w : (span.frame + 1) * h * w]
            if item.feature is not None:  # the patch's rows of the file, fetched once
                start = span.frame * span.num_tokens
                changes["feature"] = msgspec.structs.replace(
                    item.feature,
                    rows=(start, start + span.num_tokens),
                    file_grid_thw=tuple(item.grid_thw),
                )
        if pixels is not None:
            changes["pixel_values"] = tensor_ref(len(carried), pixels)
            carried.append(pixels)
        placed.append(msgspec.structs.replace(item, **changes))
    return placed, carried
