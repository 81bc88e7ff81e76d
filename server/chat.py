"""Chat request -> prompt token ids + media (MediaInput + pixel tensors) for the engine.

Images are fetched and preprocessed concurrently (media_fetch), then the chat template is
rendered with one placeholder per image and each placeholder widened to the image's token
count; the spans give every MediaInput its `offset` / `num_tokens`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.errors import InvalidRequest
from engine.multimodal.image_processor import ProcessedImage
from engine.multimodal.prompt import PromptProcessor
from engine.protocol import MediaInput, Modality, TensorRef
from server.generation import PreparedPrompt
from server.media_fetch import MediaFetcher
from server.openai_models import ChatCompletionRequest, ChatMessage, ImagePart


def tensor_ref(frame: int, tensor: Any) -> TensorRef:
    """TensorRef for `tensor` carried in extra frame `frame` (engine.serialization's if any)."""
    try:
        from engine.serialization import tensor_ref as engine_tensor_ref
    except ImportError:
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorRef(frame=frame, dtype=dtype, shape=tuple(tensor.shape))
    return engine_tensor_ref(frame, tensor)


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(param path, url) of every image part, in prompt order."""
    found = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    found.append((f"messages[{i}].content[{j}]", part.image_url.url))
    return found


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in messages]


async def prepare_chat_prompt(
    request: ChatCompletionRequest,
    processor: PromptProcessor,
    fetcher: MediaFetcher | None,
    *,
    max_images: int,
) -> PreparedPrompt:
    """Fetch + process images and tokenise the rendered chat."""
    parts = image_parts(request.messages)
    if len(parts) > max_images:
        raise InvalidRequest(
            f"the request has {len(parts)} images; at most {max_images} are allowed",
            param="messages",
        )
    if parts and fetcher is None:
        raise InvalidRequest("this model does not accept images", param=parts[0][0])
    images: list[ProcessedImage] = []
    if parts:
        tasks = [
            asyncio.create_task(fetcher.load_image(url, param=param))  # type: ignore[union-attr]
            for param, url in parts
        ]
        try:
            images = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
    counts = [("image", image.num_tokens) for image in images]
    prompt = await asyncio.to_thread(
        processor.process_chat, messages_as_dicts(request.messages), counts
    )
    media, tensors = [], []
    for frame, (image, span) in enumerate(zip(images, prompt.spans, strict=True)):
        media.append(
            MediaInput(
                modality=Modality.IMAGE,
                content_hash=image.content_hash,
                offset=span.offset,
                num_tokens=span.num_tokens,
                grid_thw=tuple(image.grid_thw),
                pixel_values=tensor_ref(frame, image.pixel_values),
            )
        )
        tensors.append(image.pixel_values)  # [num_patches, C * T * P * P] float32
    return PreparedPrompt(token_ids=prompt.token_ids, media=media, tensors=tensors)
