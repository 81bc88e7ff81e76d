"""Videos through LLM / EngineCore equal transformers' Qwen2VLForConditionalGeneration given
the same frames (pixel_values_videos, video_grid_thw), token for token.

The shapes cover a video whose temporal grid is longer than its spatial one (M-RoPE's
temporal index then dominates the position after the video), an odd single frame (repeated
to fill the temporal patch), a video next to an image, and a video split across prefill chunks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("av")

from bench.local_inputs import moving_pictures, picture, video_bytes  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.multimodal.video import VideoConfig  # noqa: E402
from engine.multimodal.video_decode import load_video  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import HFGreedy  # noqa: E402

NUM_NEW = 16
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)

# (width, height, frames, fps of the file): 160x120 at 4 fps for 3 s -> 6 sampled frames,
# grid (3, 8, 12); 64x64, 32 frames at 2 fps -> 32 frames, grid (16, 4, 4); 5 frames at
# 5 fps -> 4 sampled (min_frames); a 1-frame 96x64 video -> that frame twice (transformers'
# sampler divides by zero there; its patchify repeats the last frame the same way).
CLIPS = [(160, 120, 12, 4), (64, 64, 32, 2), (120, 90, 5, 5), (96, 64, 1, 2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("video_parity"), seed=3)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFGreedy(model_dir)


@pytest.fixture(scope="module")
def clips():
    return [
        video_bytes(moving_pictures(w, h, n, salt=i), fps=fps)
        for i, (w, h, n, fps) in enumerate(CLIPS)
    ]


def video_chat(data: bytes, text: str, image=None) -> tuple[dict, list[dict]]:
    """(the LLM prompt, transformers' messages) of one user turn."""
    parts, hf_parts = [], []
    if image is not None:
        parts.append({"type": "image", "image": image})
        hf_parts.append({"type": "image"})
    parts += [{"type": "video", "video": data}, {"type": "text", "text": text}]
    hf_parts += [{"type": "video"}, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": parts}]}, [
        {"role": "user", "content": hf_parts}
    ]


def reference(hf, model_dir, data: bytes, messages: list[dict], images=()) -> tuple:
    config = VideoConfig.from_model_dir(model_dir)
    video = load_video(data, config)
    inputs = hf.inputs(messages, images=images, videos=[video])
    return inputs["input_ids"][0].tolist(), hf.generate(inputs, NUM_NEW), video.grid_thw


def test_videos_match_transformers(model_dir, hf, clips):
    llm = LLM(str(model_dir), num_kv_blocks=256)
    prompts, expected, grids = [], [], []
    for index, data in enumerate(clips):
        prompt, messages = video_chat(data, f"What happens in clip {index}?")
        prompts.append(prompt)
        ids, tokens, grid = reference(hf, model_dir, data, messages)
        expected.append((ids, tokens))
        grids.append(grid)
    assert grids == [(3, 8, 12), (16, 4, 4), (2, 6, 8), (1, 4, 6)]
    results = llm.generate(prompts, GREEDY)  # one batch: the encoder sees all four at once
    for result, (ids, tokens) in zip(results, expected, strict=True):
        assert result.error is None, result.error
        assert result.prompt_token_ids == ids
        assert result.token_ids == tokens


def test_video_beside_an_image_and_across_prefill_chunks(model_dir, hf, clips):
    image = picture(112, 84, 7)
    prompt, messages = video_chat(clips[0], "Compare the picture and the clip.", image=image)
    ids, tokens, _ = reference(hf, model_dir, clips[0], messages, images=[image])
    for budget in (2048, 40):  # 40: the video's 288 rows arrive in 8 chunks
        llm = LLM(str(model_dir), num_kv_blocks=256, max_num_batched_tokens=budget)
        [result] = llm.generate([prompt], GREEDY)
        assert result.error is None, result.error
        assert result.prompt_token_ids == ids
        assert result.token_ids == tokens, f"budget {budget}"


def test_decoding_after_a_video_longer_in_time_than_in_space(model_dir, hf):
    # 32 frames of 56x56: 16 temporal patches of 2 x 2 merged tokens, then two words. The
    # video's temporal row reaches p + 15, the text after it restarts at p + 2 and ends
    # below that, so decoding must step on from the last prompt token, as transformers'
    # generate() does, not from the largest position (which diverged from token 2 on).
    data = video_bytes(moving_pictures(56, 56, 40, salt=9), fps=2)
    prompt, messages = video_chat(data, "Why?")
    ids, tokens, grid = reference(hf, model_dir, data, messages)
    assert grid == (16, 4, 4)
    [result] = LLM(str(model_dir), num_kv_blocks=256).generate([prompt], GREEDY)
    assert result.error is None, result.error
    assert result.prompt_token_ids == ids
    assert result.token_ids == tokens


def test_mm_processor_kwargs_in_an_offline_prompt(model_dir, hf, clips):
    # The prompt's own mm_processor_kwargs (as on the HTTP API): 1 fps and at most 2
    # frames, and the image held to 56x56 pixels; transformers gets inputs processed alike.
    import dataclasses

    image = picture(112, 84, 7)
    plain, messages = video_chat(clips[0], "Compare the picture and the clip.", image=image)
    prompt = {**plain, "mm_processor_kwargs": {"fps": 1, "max_frames": 2, "max_pixels": 3136}}
    config = VideoConfig.from_model_dir(model_dir)
    video_config = dataclasses.replace(
        config,
        fps=1.0,
        max_frames=2,
        min_frames=2,
        frame=dataclasses.replace(config.frame, max_pixels=56 * 56),
    )
    video = load_video(clips[0], video_config)
    size = {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}
    inputs = hf.inputs(messages, images=[image], videos=[video], image_size=size)
    llm = LLM(str(model_dir), num_kv_blocks=256)
    [result, default] = llm.generate([prompt, plain], GREEDY)
    assert result.error is None, result.error
    assert result.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert result.token_ids == hf.generate(inputs, NUM_NEW)
    assert len(result.prompt_token_ids) < len(default.prompt_token_ids)
    [bad] = llm.generate([{**plain, "mm_processor_kwargs": {"max_frames": 0}}], GREEDY)
    assert bad.error is not None and bad.error.param == "mm_processor_kwargs.max_frames"
