"""The engine's encoder-cache entries against what the runner holds, in process: a
uuid-only item (no pixels) is held from admission to its request's finish, and an item
whose encode failed leaves no entry behind that a later request would take for a hit."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from engine.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("encoder_entries"), seed=3)


def picture(salt: int) -> Image.Image:  # 140x140: 25 placeholder tokens
    pixels = np.random.default_rng(salt).integers(0, 256, (140, 140, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def asking(llm: LLM, request_id: str, image: Image.Image, *, uuid: str | None = None,
           uuid_only: bool = False, lead: str = "a"):  # fmt: skip
    """The engine request the server sends for a chat with one image part: under the
    client's uuid, and without its pixels for a part that names the uuid alone."""
    content = [{"type": "text", "text": lead}, {"type": "image", "image": image}]
    request, tensors, _ = llm._build_request(request_id, {"messages": [
        {"role": "user", "content": content}]}, GREEDY)  # fmt: skip
    if uuid is not None:
        media = msgspec.structs.replace(request.media[0], content_hash=f"uuid:{uuid}")
        if uuid_only:
            media = msgspec.structs.replace(media, pixel_values=None, normalization=None)
            tensors = []
        request = msgspec.structs.replace(request, media=[media])
    return request, tensors


def run(llm: LLM, *requests) -> dict[str, object]:
    """Adds the requests in order and steps until they finish: request id -> error."""
    for request, tensors in requests:
        llm.engine.add_request(request, tensors)
    errors: dict[str, object] = {}
    while len(errors) < len(requests):
        for output in llm.engine.step().outputs:
            if output.finish_reason is not None:
                errors[output.request_id] = output.error
    return errors


def test_a_uuid_only_part_accepted_is_served_though_other_images_need_the_room(model_dir):
    """The uuid-only request was accepted (u1 cached), then the image queued before it
    evicted u1, oldest first, and it failed ('no pixels and no cached encoding'); after
    that, even the image sent again with its pixels under u1 failed, every time. Now
    another entry makes the room; with none other, the request fails naming the uuid,
    and the image sent again with its pixels is served."""
    x, y, z = picture(6), picture(7), picture(9)
    with LLM(str(model_dir), num_kv_blocks=64, encoder_cache_tokens=55) as llm:
        assert run(llm, asking(llm, "warm", x, uuid="u1")) == {"warm": None}
        assert run(llm, asking(llm, "newer", z)) == {"newer": None}
        errors = run(llm, asking(llm, "other", y),
                     asking(llm, "only", x, uuid="u1", uuid_only=True, lead="another"))  # fmt: skip
        assert errors == {"other": None, "only": None}
    with LLM(str(model_dir), num_kv_blocks=64, encoder_cache_tokens=30) as llm:
        assert run(llm, asking(llm, "warm", x, uuid="u1")) == {"warm": None}
        errors = run(llm, asking(llm, "other", y),
                     asking(llm, "only", x, uuid="u1", uuid_only=True, lead="another"))  # fmt: skip
        assert errors["other"] is None and errors["only"].code == "unknown_media_uuid"
        assert run(llm, asking(llm, "again", x, uuid="u1", lead="third")) == {"again": None}


def test_an_item_whose_encode_failed_is_encoded_again_next_time(model_dir, monkeypatch):
    """The failed item stayed accounted without rows: the same image sent next was taken
    for a cache hit and failed ('no pixels and no cached encoding')."""
    x = picture(8)
    with LLM(str(model_dir), num_kv_blocks=64) as llm:
        runner = llm.engine.runner
        encode = runner._encode_batch

        def fails(items):
            raise RuntimeError("the vision tower failed")

        monkeypatch.setattr(runner, "_encode_batch", fails)
        [error] = run(llm, asking(llm, "fails", x)).values()
        assert error is not None
        monkeypatch.setattr(runner, "_encode_batch", encode)
        assert run(llm, asking(llm, "next", x)) == {"next": None}
