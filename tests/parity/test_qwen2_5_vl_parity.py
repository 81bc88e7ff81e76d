"""Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration on a generated
checkpoint (`tiny-qwen2.5-vl`: windows of 2 x 2 merged tokens, block 1 of 3 attends whole
frames).

The vision tower is compared alone (window order, edge windows, several items in one call,
a video), then greedy generation token for token: text, pictures of several sizes in one
batch, videos whose temporal positions are spaced by time (`second_per_grid_t` of 1.0, 19/16
and 1.25 s, where M-RoPE's floor(i x tokens_per_second x seconds) gives 0, 2, 4, 7 and
0, 2, 5, 7, ... rather than 1 s's 0, 2, 4, 6, ...), and a picture split over prefill chunks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from bench.local_inputs import moving_pictures, picture, video_bytes  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.attention import get_attention_backend  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.models.qwen2_5_vl_vision import window_order  # noqa: E402
from engine.multimodal.video import VideoConfig  # noqa: E402
from engine.multimodal.video_decode import load_video  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import HFGreedy  # noqa: E402

NUM_NEW = 16
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
# Patch grids (t, h, w): partial windows on the right and bottom edges, one window exactly,
# a single-window picture, a 3-frame video, a tall thin one.
GRIDS = [(1, 10, 6), (1, 4, 4), (2, 4, 8), (1, 14, 14), (3, 6, 2), (1, 2, 12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen2_5_vl"), size="tiny-qwen2.5-vl", seed=5)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFGreedy(model_dir)


def test_the_config_reads_the_qwen2_5_vision_fields(model_dir):
    vision = ModelConfig.from_model_dir(model_dir).vision
    assert (vision.variant, vision.embed_dim, vision.intermediate_size) == ("qwen2_5_vl", 64, 172)
    assert (vision.window_size, vision.fullatt_block_indexes) == (56, (1,))
    assert (vision.tokens_per_second, vision.out_hidden_size) == (2.0, 128)


def test_window_order_is_transformers(model_dir):
    from transformers.vision_utils import get_vision_window_index

    grid = torch.tensor(GRIDS)
    expected_order, expected_cu = get_vision_window_index(
        grid, spatial_merge_size=2, window_size=56, patch_size=14
    )
    order, lengths = window_order(GRIDS, merge=2, window_tokens=2)
    assert order.tolist() == expected_order.tolist()
    boundaries = torch.unique_consecutive(torch.as_tensor(expected_cu))  # drops empty windows
    assert lengths == torch.diff(boundaries).tolist()


def test_vision_tower_equals_transformers(model_dir, hf):
    model = load_model(
        str(model_dir),
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=get_attention_backend("torch"),
    )
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    with torch.no_grad():
        ours = model.encode_images(pixels, grid)
        theirs = hf.model.model.visual(pixels, grid_thw=grid).pooler_output
        # Each item alone gives the same rows as in the batch.
        alone = model.encode_images(pixels[: 10 * 6], grid[:1])
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(alone, ours[:15], atol=1e-5, rtol=1e-5)


def chat(parts: list[dict], text: str) -> tuple[dict, list[dict]]:
    """(the LLM prompt, transformers' messages) of one user turn with media `parts`."""
    content = [*parts, {"type": "text", "text": text}]
    hf_content = [{"type": p["type"]} for p in parts] + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}]}, [
        {"role": "user", "content": hf_content}
    ]


def test_text_and_pictures_match_transformers(model_dir, hf):
    sizes = [(112, 84), (252, 168), (140, 336), (56, 56)]
    prompts, expected = [], []
    plain, messages = chat([], "Tell me a story about windows.")
    prompts.append(plain)
    expected.append(hf.inputs(messages))
    for index, (width, height) in enumerate(sizes):
        image = picture(width, height, index)
        prompt, messages = chat([{"type": "image", "image": image}], f"Picture {index}?")
        prompts.append(prompt)
        expected.append(hf.inputs(messages, images=[image]))
    results = LLM(str(model_dir), num_kv_blocks=256).generate(prompts, GREEDY)  # one batch
    for result, inputs in zip(results, expected, strict=True):
        assert result.error is None, result.error
        assert result.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert result.token_ids == hf.generate(inputs, NUM_NEW)


# (width, height, frames, fps of the file) -> sampled frames, seconds per temporal patch:
# 12 frames at 4 fps -> 6 frames, 2 fps sampled, 1.0 s; 19 frames at 4 fps -> 8 frames
# (4.75 s x 2 fps, floored to the temporal patch) at 8/19 x 4 fps, 19/16 s; 40 frames at
# 2 fps -> 32 frames (--max-video-frames) at 1.6 fps, 1.25 s.
CLIPS = [(160, 120, 12, 4, 1.0), (84, 84, 19, 4, 19 / 16), (56, 56, 40, 2, 1.25)]


def test_videos_spaced_in_time_match_transformers(model_dir, hf):
    config = VideoConfig.from_model_dir(model_dir)
    image = picture(140, 112, 9)
    prompts, expected = [], []
    for index, (width, height, count, fps, seconds) in enumerate(CLIPS):
        data = video_bytes(moving_pictures(width, height, count, salt=index), fps=fps)
        video = load_video(data, config)
        assert video.second_per_grid_t == pytest.approx(seconds)
        parts = [{"type": "video", "video": data}, {"type": "image", "image": image}]
        prompt, messages = chat(parts, f"What happens in clip {index}?")
        prompts.append(prompt)
        expected.append(hf.inputs(messages, images=[image], videos=[video]))
    results = LLM(str(model_dir), num_kv_blocks=256).generate(prompts, GREEDY)
    for result, inputs in zip(results, expected, strict=True):
        assert result.error is None, result.error
        assert result.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert result.token_ids == hf.generate(inputs, NUM_NEW)


def test_a_picture_across_prefill_chunks(model_dir, hf):
    image = picture(252, 168, 3)  # 54 placeholder rows
    prompt, messages = chat([{"type": "image", "image": image}], "Describe it.")
    inputs = hf.inputs(messages, images=[image])
    expected = hf.generate(inputs, NUM_NEW)
    llm = LLM(str(model_dir), num_kv_blocks=256, max_num_batched_tokens=16)
    [result] = llm.generate([prompt], GREEDY)
    assert result.error is None, result.error
    assert result.token_ids == expected
