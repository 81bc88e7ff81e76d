"""The registry of media uuids: bounded by --max-remembered-media-uuids, least recently
used forgotten first, a uuid known only to its cache salt."""

from __future__ import annotations

import asyncio
import base64

import pytest

from bench.local_inputs import moving_pictures, picture, png_bytes, video_bytes
from engine.config import EngineConfig
from engine.errors import InvalidRequest, MediaError
from engine.protocol import Modality
from server.chat import UuidRegistry
from server.settings import ServerSettings


class _Image:
    grid_thw = (1, 4, 4)
    num_tokens = 4
    second_per_grid_t = 1.0
    frame_seconds = ()


def _known(registry: UuidRegistry, uuid: str, salt: str | None = None) -> bool:
    try:
        registry.lookup(uuid, Modality.IMAGE, salt, param="p")
    except MediaError:
        return False
    return True


def test_a_uuid_named_since_it_was_sent_outlives_newer_ones():
    """Naming a uuid counts as using it: before, one sent once and named by every request
    after was the first forgotten."""
    registry = UuidRegistry(capacity=2)
    registry.remember("a", Modality.IMAGE, None, _Image())
    registry.remember("b", Modality.IMAGE, None, _Image())
    assert _known(registry, "a")
    registry.remember("c", Modality.IMAGE, None, _Image())
    assert [_known(registry, uuid) for uuid in "abc"] == [True, False, True]


def test_a_uuid_is_known_only_to_its_salt():
    registry = UuidRegistry(capacity=4)
    registry.remember("a", Modality.IMAGE, "tenant-1", _Image())
    assert _known(registry, "a", "tenant-1") and not _known(registry, "a", "tenant-2")
    assert not _known(registry, "a")


def test_the_capacity_is_a_setting():
    field = ServerSettings.__dataclass_fields__["max_remembered_media_uuids"]
    assert field.default == UuidRegistry().capacity
    with pytest.raises(ValueError, match="max_remembered_media_uuids"):
        ServerSettings(engine=EngineConfig(model="m"), max_remembered_media_uuids=0)


def test_naming_a_uuid_refreshes_it_in_the_other_api_processes():
    """Only new uuids were shared: the process a uuid-only part reached kept it, the others
    forgot it first (fuzz51)."""
    here, there = UuidRegistry(capacity=2), UuidRegistry(capacity=2)
    here.share_with(there.learn)
    here.remember("a", Modality.IMAGE, None, _Image())
    here.remember("b", Modality.IMAGE, None, _Image())
    here.lookup("a", Modality.IMAGE, None, param="p")
    here.remember("c", Modality.IMAGE, None, _Image())
    assert [_known(there, uuid) for uuid in "abc"] == [True, False, True]


@pytest.fixture
def tokens_of(tmp_path):
    """`await tokens_of(part, kwargs)`: the tokens of a one-part chat request's media item,
    prepared as the server prepares it (uuids remembered in the process's registry)."""
    from engine.multimodal.image_processor import ImageProcessorConfig
    from engine.multimodal.prompt import PromptProcessor
    from engine.tiny_model import make_tiny_model
    from server.chat import prepare_chat_prompt
    from server.media_fetch import MediaFetchConfig, MediaFetcher
    from server.openai_models import ChatCompletionRequest

    model = make_tiny_model(tmp_path / "m", seed=0)
    processor = PromptProcessor.from_model_dir(model)

    async def tokens(part: dict, kwargs: dict | None = None) -> int:
        request = ChatCompletionRequest(model="m", mm_processor_kwargs=kwargs, messages=[
            {"role": "user", "content": [part]}])  # fmt: skip
        fetcher = MediaFetcher(MediaFetchConfig(), ImageProcessorConfig.from_model_dir(model))
        try:
            prompt = await prepare_chat_prompt(request, processor, fetcher, max_images=4)
        finally:
            await fetcher.aclose()
        return prompt.media[0].num_tokens

    return tokens


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_a_uuid_only_part_is_answered_under_its_own_requests_mm_processor_kwargs(tokens_of):
    """A uuid-only part under `max_pixels` was answered at the size another request had
    sent the image at, and one without kwargs at the size a kwargs request had made: the
    uuid was remembered without the preprocessing (fuzz69). It is now remembered under
    it, as vLLM hashes a uuid with the processor's kwargs: other kwargs are unknown."""
    url = _data_url("image/png", png_bytes(picture(224, 224, 3)))
    small = {"max_pixels": 56 * 56}

    async def scenario():
        sent = {"type": "image_url", "image_url": {"url": url}, "uuid": "kwargs-scope"}
        named = {"type": "image_url", "uuid": "kwargs-scope"}
        default_size = await tokens_of(sent)
        with pytest.raises(
            InvalidRequest, match="under the same cache_salt and mm_processor_kwargs"
        ):
            await tokens_of(named, small)
        small_size = await tokens_of(sent, small)
        assert small_size < default_size
        assert await tokens_of(named, small) == small_size
        assert await tokens_of(named) == default_size  # not the latest one sent

    asyncio.run(scenario())


def test_a_uuid_is_scoped_by_its_own_kinds_settings_only(tokens_of):
    """An image uuid was unknown when only the request's `fps` (a video setting) changed:
    the scope digested the image and video settings together. A video uuid still is, and
    one sent as a video and named as an image is told so."""
    image = _data_url("image/png", png_bytes(picture(224, 224, 3)))
    video = _data_url("video/mp4", video_bytes(moving_pictures(64, 64, 8), fps=4))

    async def scenario():
        size = await tokens_of({"type": "image_url", "image_url": {"url": image}, "uuid": "pic"})
        assert await tokens_of({"type": "image_url", "uuid": "pic"}, {"fps": 1.0}) == size
        sent = {"type": "video_url", "video_url": {"url": video}, "uuid": "clip"}
        frames = await tokens_of(sent, {"fps": 2.0})
        assert await tokens_of({"type": "video_url", "uuid": "clip"}, {"fps": 2.0}) == frames
        with pytest.raises(
            InvalidRequest, match="under the same cache_salt and mm_processor_kwargs"
        ):
            await tokens_of({"type": "video_url", "uuid": "clip"}, {"fps": 1.0})
        with pytest.raises(MediaError, match="names video, not image"):
            await tokens_of({"type": "image_url", "uuid": "clip"}, {"fps": 2.0})

    asyncio.run(scenario())
