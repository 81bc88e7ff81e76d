"""Runs the vision encoder on a step's media and keeps each item's rows in the
`EncoderCache`, for the model runner (engine/model_runner.py) at the start of a step.

The step's items, across requests, are encoded in ONE batched call and the rows split per
item; when that call fails each item is encoded alone to find the culprit, so a media item
that fails to encode fails only the requests that need it. Fetched features
(`MediaItem.embeds`) are the rows already: no encoder call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.device_io import to_device
from engine.encoder_cache import EncoderCache, uuid_of
from engine.errors import MediaError, error_info, unknown_media_uuid
from engine.models.qwen2_vl import Qwen2VLForConditionalGeneration
from engine.multimodal.image_processor import normalize_pixels
from engine.protocol import ErrorInfo
from engine.request import MediaItem
from engine.scheduler_output import ScheduledChunk

logger = logging.getLogger(__name__)


def encode_media(
    items: list[MediaItem],
    encode_batch: Callable[[list[MediaItem]], None],
    cache: EncoderCache,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[dict[str, ErrorInfo], int]:
    """Encodes `items` with one `encode_batch` call (per item on failure, to find the
    culprit): the errors by content hash, and the number of encoder calls."""
    if not items:
        return {}, 0
    failed: dict[str, ErrorInfo] = {}
    ready = []
    for item in items:
        if item.embeds is not None:  # fetched features: the "encoder" is the request's copy
            cache.put(
                item.content_hash, to_device(item.embeds, dtype, device)
            )  # [num_tokens, hidden]
        elif item.pixel_values is None:
            failed[item.content_hash] = error_info(no_encoding(item))
        else:
            ready.append(item)
    if not ready:
        return failed, 0
    try:
        encode_batch(ready)
        return failed, 1
    except Exception as exc:  # noqa: BLE001 - retried per item to attribute the failure
        if len(ready) == 1:
            logger.info("encoding %s failed: %s", ready[0].content_hash, exc)
            failed[ready[0].content_hash] = error_info(exc)
            return failed, 1
    for item in ready:
        try:
            encode_batch([item])
        except Exception as exc:  # noqa: BLE001
            logger.info("encoding %s failed: %s", item.content_hash, exc)
            failed[item.content_hash] = error_info(exc)
    return failed, 1 + len(ready)


def encode_into_cache(
    model: Qwen2VLForConditionalGeneration,
    items: list[MediaItem],
    cache: EncoderCache,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """One vision-encoder call on `items`; each item's rows go to `cache`."""
    pixel_values = torch.cat([pixel_input(item, dtype, device) for item in items])
    grid_thw = torch.tensor([item.grid_thw for item in items], dtype=torch.long)  # [N, 3]
    rows = model.encode_images(pixel_values, grid_thw)  # [sum tokens, hidden]
    merge = model.config.vision.spatial_merge_size
    counts = [t * h * w // merge**2 for t, h, w in (item.grid_thw for item in items)]
    if rows.shape[0] != sum(counts):
        raise MediaError(
            f"the vision encoder returned {rows.shape[0]} rows for {sum(counts)} expected tokens"
        )
    for item, count in zip(items, counts, strict=True):
        if count != item.num_tokens:
            raise MediaError(
                f"{item.modality} at {item.offset} has {item.num_tokens} "
                f"placeholders but its encoding has {count} rows"
            )
    for item, item_rows in zip(items, rows.split(counts), strict=True):
        cache.put(item.content_hash, item_rows)


def pixel_input(item: MediaItem, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The item's encoder input on the device, [P, C * T_patch * patch * patch]: uint8
    levels travel as they are (a quarter of float32's bytes) and are normalised there."""
    if item.normalization is None:
        return to_device(item.pixel_values, dtype, device)
    levels = to_device(item.pixel_values, torch.uint8, device)
    return normalize_pixels(levels, item.normalization).to(dtype)


def media_failure(
    chunk: ScheduledChunk, failed_hashes: dict[str, ErrorInfo], cache: EncoderCache
) -> ErrorInfo | None:
    """Why `chunk` cannot run: one of its media failed to encode or has no encoding."""
    needed = chunk.request.media_overlapping(chunk.start, chunk.end)
    for media in needed:
        if media.content_hash in failed_hashes:
            return failed_hashes[media.content_hash]
    for media in needed:
        if media.content_hash not in cache:
            return error_info(no_encoding(media))
    return None


def no_encoding(item: MediaItem) -> MediaError:
    """The error of an item with neither pixels nor a cached encoding: a uuid-only part
    whose encoding was evicted while its request waited (the client sends it again)."""
    uuid = uuid_of(item.content_hash)
    if item.cached_only and uuid is not None:
        return unknown_media_uuid(
            uuid,
            "its cached encoding was evicted while the request waited; send the media with "
            "its uuid again",
        )
    return MediaError(f"{item.modality} at {item.offset} has no pixels and no cached encoding")
