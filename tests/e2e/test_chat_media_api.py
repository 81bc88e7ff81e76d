"""Images and videos through a real `tessera serve` process: greedy answers equal
transformers' (mm_processor_kwargs included), and media named again by uuid."""

from __future__ import annotations

import base64
import dataclasses

import pytest
from tokenizers import Tokenizer

from bench.local_inputs import picture
from tests.e2e.conftest import MODEL_NAME
from tests.e2e.test_chat_api import (
    GREEDY,
    TEXT_PART,
    data_url,
    fetch,
    image_message,
    user,
    video_message,
)


def test_greedy_text_matches_transformers(client, model_dir, image_server):
    pytest.importorskip("transformers")
    from engine.multimodal.video import VideoConfig
    from engine.multimodal.video_decode import load_video
    from tests.hf_reference import HFGreedy

    reference = HFGreedy(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    image = picture(112, 84, 1)
    config = VideoConfig.from_model_dir(model_dir)  # the server's defaults: 2 fps, 32 frames
    clip = load_video(fetch(image_server + "/clip.mp4"), config)
    cases = [
        (user("Describe a dog in the park."), user("Describe a dog in the park."), [], []),
        (
            image_message(image_server + "/picture.png", "What is this?"),
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}],
                }
            ],
            [image],
            [],
        ),
        (
            video_message(image_server + "/clip.mp4", "What happens?"),
            [
                {
                    "role": "user",
                    "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}],
                }
            ],
            [],
            [clip],
        ),
    ]
    for api_messages, hf_messages, images, videos in cases:
        inputs = reference.inputs(hf_messages, images=images, videos=videos)
        hf_ids = reference.generate(inputs, 16)
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=api_messages, max_tokens=16, **GREEDY
        )
        assert response.usage.prompt_tokens == inputs["input_ids"].shape[1]
        assert response.usage.completion_tokens == 16
        assert response.choices[0].message.content == tokenizer.decode(hf_ids)


def test_mm_processor_kwargs_match_transformers(client, model_dir, image_server):
    # Per-request preprocessing (vLLM's mm_processor_kwargs): fewer pixels for an image,
    # a lower frame rate and fewer frames for a video; the answers equal transformers' on
    # inputs processed with the same settings. Each is sent first without options, so a
    # processed-media cache keyed by the bytes alone would answer from the default entry.
    pytest.importorskip("transformers")
    from engine.multimodal.video import VideoConfig
    from engine.multimodal.video_decode import load_video
    from tests.hf_reference import HFGreedy

    reference = HFGreedy(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = VideoConfig.from_model_dir(model_dir)
    few_frames = dataclasses.replace(config, fps=1.0, max_frames=2, min_frames=2)
    clip = load_video(fetch(image_server + "/clip.mp4"), few_frames)
    default_clip = load_video(fetch(image_server + "/clip.mp4"), config)
    assert clip.grid_thw[0] < default_clip.grid_thw[0]
    small = {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}
    cases = [
        (
            image_message(image_server + "/picture.png", "What is this?"),
            {"min_pixels": 28 * 28, "max_pixels": 56 * 56},
            reference.inputs(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}],
                    }
                ],
                images=[picture(112, 84, 1)],
                image_size=small,
            ),
        ),
        (
            video_message(image_server + "/clip.mp4", "What happens?"),
            {"fps": 1.0, "max_frames": 2},
            reference.inputs(
                [
                    {
                        "role": "user",
                        "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}],
                    }
                ],
                videos=[clip],
            ),
        ),
    ]
    for api_messages, options, inputs in cases:
        default = client.chat.completions.create(
            model=MODEL_NAME, messages=api_messages, max_tokens=1, **GREEDY
        )
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=api_messages,
            max_tokens=16,
            temperature=0,
            extra_body={**GREEDY["extra_body"], "mm_processor_kwargs": options},
        )
        assert response.usage.prompt_tokens == inputs["input_ids"].shape[1]
        assert response.usage.prompt_tokens < default.usage.prompt_tokens
        hf_ids = reference.generate(inputs, 16)
        assert response.choices[0].message.content == tokenizer.decode(hf_ids)


def test_a_uuid_named_again_later_in_the_same_request(client):
    """A history that sends an image with its uuid in one turn and names it by uuid alone
    in a later one: the engine used to refuse the second part (its encoding was not cached
    yet). The answer is the one with the image sent twice."""
    url = data_url(picture(84, 56, 7))
    first_turn = [{"type": "image_url", "image_url": {"url": url}, "uuid": "history-1"},
                  {"type": "text", "text": "What is this?"}]  # fmt: skip

    def history(again: dict) -> list[dict]:
        return [{"role": "user", "content": first_turn},
                {"role": "assistant", "content": "A picture."},
                {"role": "user", "content": [again, {"type": "text", "text": "And now?"}]}]  # fmt: skip

    by_uuid = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, **GREEDY,
        messages=history({"type": "image_url", "uuid": "history-1"}))  # fmt: skip
    twice = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, **GREEDY,
        messages=history({"type": "image_url", "image_url": {"url": url}}))  # fmt: skip
    assert by_uuid.choices[0].message.content == twice.choices[0].message.content
    assert by_uuid.usage.prompt_tokens == twice.usage.prompt_tokens


def test_a_uuid_an_image_had_does_not_answer_a_video_sent_under_it(client):
    """A video sent with its own pixels under a uuid an image of the same grid had was
    answered from the image's cached encoding (the cache key left the modality out)."""
    from bench.local_inputs import moving_pictures, video_bytes

    image = {"type": "image_url", "image_url": {"url": data_url(picture(84, 56, 12))},
             "uuid": "shared-name"}  # fmt: skip
    clip = (
        "data:video/mp4;base64,"
        + base64.b64encode(video_bytes(moving_pictures(84, 56, 2, salt=13), fps=2)).decode()
    )  # one temporal patch

    def ask(part: dict):
        return client.chat.completions.create(
            model=MODEL_NAME, max_tokens=8, **GREEDY,
            messages=[{"role": "user", "content": [part, TEXT_PART]}])  # fmt: skip

    own = ask({"type": "video_url", "video_url": {"url": clip}})
    as_image = ask(image)
    video = ask({"type": "video_url", "video_url": {"url": clip}, "uuid": "shared-name"})
    assert video.choices[0].message.content == own.choices[0].message.content
    assert as_image.choices[0].message.content != own.choices[0].message.content


def test_video_by_data_url_http_and_uuid_agree(client, http, image_server):
    data = fetch(image_server + "/clip.mp4")
    by_http = client.chat.completions.create(
        model=MODEL_NAME, messages=video_message(image_server + "/clip.mp4"), max_tokens=8, **GREEDY
    )
    as_data_url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    part = {"type": "video_url", "video_url": {"url": as_data_url}, "uuid": "clip-1"}
    by_data = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": [part, TEXT_PART]}],
        max_tokens=8,
        **GREEDY,
    )
    by_uuid = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "user", "content": [{"type": "video_url", "uuid": "clip-1"}, TEXT_PART]}
        ],
        max_tokens=8,
        **GREEDY,
    )
    text_only = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": [TEXT_PART]}],
        max_tokens=8,
        **GREEDY,
    )
    assert by_http.choices[0].message.content == by_data.choices[0].message.content
    assert by_uuid.choices[0].message.content == by_data.choices[0].message.content
    # 12 frames at 4 fps: 3 s -> 6 frames -> grid (3, 8, 12) -> 72 tokens, plus two markers.
    assert by_http.usage.prompt_tokens == text_only.usage.prompt_tokens + 72 + 2
    wrong_kind = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "uuid": "clip-1"}]}],
        },
    )
    assert wrong_kind.status_code == 400
    assert "names video, not image" in wrong_kind.json()["error"]["message"]
