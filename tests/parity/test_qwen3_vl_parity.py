"""Qwen3-VL against transformers' Qwen3VLForConditionalGeneration on a generated checkpoint
(and Qwen3-VL-MoE against Qwen3VLMoeForConditionalGeneration: `tiny-qwen3-vl-moe`, its MLPs
mixtures of 8 experts but for layer 1) (`tiny-qwen3-vl`: Qwen3's decoder with a head dim of 48, interleaved M-RoPE sections of
10 / 7 / 7, 16-pixel patches, an 8 x 8 learned position table, deepstack from vision blocks
0 and 2 into decoder layers 0 and 1).

The vision tower is compared alone (grids smaller and larger than the position table, odd
aspect ratios, several items in one call: the merged rows and every deepstack level), then
greedy generation token for token: text, pictures of several sizes in one batch, two
pictures in one prompt, a picture split over prefill chunks (its deepstack rows arrive
chunk by chunk), one served from the encoder and prefix caches, and videos laid out temporal
patch by temporal patch after their times (the processor's layout, which
tests/hf_reference.py writes for transformers). Frame sampling, timestamps and frame sizes
are held to transformers' Qwen3-VL video processor's own functions.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import dataclasses  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from bench.local_inputs import moving_pictures, picture, video_bytes  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.attention import get_attention_backend  # noqa: E402
from engine.errors import ModelLoadError  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.models.cpu_prepack import PrepackedLinear, can_prepack  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.multimodal.video import (  # noqa: E402
    VideoConfig,
    frame_size,
    sample_frame_indices,
    temporal_patch_seconds,
)
from engine.multimodal.video_decode import load_video  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402
from tests.hf_reference import HFGreedy  # noqa: E402
from tests.parity.test_qwen2_5_vl_parity import chat  # noqa: E402

NUM_NEW = 16
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
# Patch grids (t, h, w): smaller than the 8 x 8 table, equal, larger, thin, two frames.
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 14, 10), (1, 2, 16), (2, 6, 4)]


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def model_dir(request, tmp_path_factory):
    """Qwen3-VL, and Qwen3-VL-MoE (its decoder's experts fused in the checkpoint)."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_vl"), size=request.param, seed=5)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFGreedy(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), num_kv_blocks=256) as llm:
        yield llm


def test_the_config_reads_the_qwen3_fields(model_dir):
    config = ModelConfig.from_model_dir(model_dir)
    vision = config.vision
    assert vision.variant == "qwen3_vl" and vision.patch_size == 16
    assert vision.num_position_embeddings == 64
    assert vision.deepstack_visual_indexes == (0, 2) and vision.hidden_act == "gelu_pytorch_tanh"
    assert (config.head_dim, config.mrope_section) == (48, (10, 7, 7))
    assert config.qk_norm and config.mrope_interleaved and not config.attention_bias
    assert config.encoder_width == 3 * config.hidden_size  # merged rows + 2 deepstack levels
    with pytest.raises(ModelLoadError, match="tensor parallelism"):
        config.shard(2)


def test_vision_tower_equals_transformers(model_dir, hf):
    model = load_model(
        str(model_dir),
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=get_attention_backend("torch"),
    )
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    with torch.no_grad():
        ours = model.encode_images(pixels, grid)
        output = hf.model.model.visual(pixels, grid_thw=grid)
        theirs = torch.cat([output.pooler_output, *output.deepstack_features], dim=-1)
        alone = model.encode_images(pixels[: 4 * 6], grid[:1])  # each item alone: the same
    assert ours.shape == (int(grid.prod(-1).sum()) // 4, 3 * 128)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(alone, ours[:6], atol=1e-5, rtol=1e-5)


def test_text_and_pictures_match_transformers(llm, hf):
    sizes = [(112, 84), (256, 160), (128, 352), (64, 64)]
    prompts, expected = [], []
    plain, messages = chat([], "Tell me a story about windows.")
    prompts.append(plain)
    expected.append(hf.inputs(messages))
    for index, (width, height) in enumerate(sizes):
        image = picture(width, height, index)
        prompt, messages = chat([{"type": "image", "image": image}], f"Picture {index}?")
        prompts.append(prompt)
        expected.append(hf.inputs(messages, images=[image]))
    first, second = picture(96, 64, 7), picture(64, 128, 8)
    prompt, messages = chat([{"type": "image", "image": first}, {"type": "image", "image": second}],
                            "Compare them.")  # fmt: skip
    prompts.append(prompt)
    expected.append(hf.inputs(messages, images=[first, second]))
    results = llm.generate(prompts, GREEDY)  # one batch
    for result, inputs in zip(results, expected, strict=True):
        assert result.error is None, result.error
        assert result.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert result.token_ids == hf.generate(inputs, NUM_NEW)


def test_a_picture_across_prefill_chunks_and_from_the_caches(model_dir, hf):
    image = picture(256, 160, 3)  # 40 placeholder rows
    prompt, messages = chat([{"type": "image", "image": image}], "Describe it.")
    expected = hf.generate(hf.inputs(messages, images=[image]), NUM_NEW)
    with LLM(str(model_dir), num_kv_blocks=256, max_num_batched_tokens=16) as llm:
        [chunked] = llm.generate([prompt], GREEDY)
        [again] = llm.generate([prompt], GREEDY)  # encoder and prefix caches warm
        assert sum(s.prefix_cache_hits_total for s in llm.last_stats) > 0
    assert chunked.error is None and again.error is None
    assert chunked.token_ids == expected == again.token_ids


def test_videos_frame_by_frame_with_their_times_match_transformers(llm, model_dir, hf):
    """Each temporal patch after its time: 12 frames at 4 fps, 19 at 4 fps (an odd count
    of sampled frames, the last patch repeating its frame), 40 at 2 fps; with a picture."""
    config = VideoConfig.from_model_dir(model_dir)
    assert config.qwen3
    image = picture(96, 96, 9)
    prompts, expected = [], []
    for index, (width, height, count, fps) in enumerate([(160, 120, 12, 4), (96, 96, 19, 4),
                                                         (64, 64, 40, 2)]):  # fmt: skip
        data = video_bytes(moving_pictures(width, height, count, salt=index), fps=fps)
        video = load_video(data, config)
        assert len(video.frame_seconds) == video.grid_thw[0] > 1
        parts = [{"type": "video", "video": data}, {"type": "image", "image": image}]
        prompt, messages = chat(parts, f"What happens in clip {index}?")
        prompts.append(prompt)
        expected.append(hf.inputs(messages, images=[image], videos=[video]))
    results = llm.generate(prompts, GREEDY)
    for result, inputs in zip(results, expected, strict=True):
        assert result.error is None, result.error
        assert result.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert result.token_ids == hf.generate(inputs, NUM_NEW)


def test_timestamps_and_sampling_follow_the_qwen3_video_processor(model_dir):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import VideoMetadata

    config = dataclasses.replace(VideoConfig.from_model_dir(model_dir), max_frames=768,
                                 min_frames=4, max_tokens=None)  # fmt: skip
    # The checkpoint's own video processor (fuzz107: without video_preprocessor_config.json
    # transformers and vLLM fell back to Qwen2-VL's), with Tessera's frame bounds.
    saved = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    assert saved.pop("video_processor_type") == "Qwen3VLVideoProcessor"
    reference = Qwen3VLVideoProcessor(**saved)
    assert (reference.size.shortest_edge, reference.size.longest_edge) == (
        config.frame.min_pixels,
        config.frame.max_pixels,
    )
    assert reference.patch_size == config.frame.patch_size
    assert tuple(reference.image_mean) == config.frame.image_mean
    for total, fps in [(40, 2.0), (19, 4.0), (300, 30.0), (7, 24.0), (3, 1.0)]:
        indices = sample_frame_indices(total, fps, config)
        metadata = VideoMetadata(total_num_frames=total, fps=fps)
        assert indices == reference.sample_frames(metadata, fps=2).tolist(), (total, fps)
        times = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert temporal_patch_seconds(indices, fps, config) == pytest.approx(times)
    frame = config.frame
    for frames, height, width in [(8, 120, 160), (32, 1080, 1920), (4, 20, 600), (2, 33, 33)]:
        expected = smart_resize(frames, height, width, factor=frame.factor,
                                min_pixels=frame.min_pixels, max_pixels=frame.max_pixels)  # fmt: skip
        assert frame_size(height, width, frames, config) == expected


def test_bfloat16_on_a_cpu_with_prepacked_linears(model_dir):
    """bfloat16 on a CPU swaps every linear for a prepacked one without a `weight`
    (engine/models/cpu_prepack.py); the tower must not need one. Its rows stay within
    bfloat16's rounding of float32's."""
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bfloat16 kernels")
    image = picture(128, 96, 2)
    prompt, _ = chat([{"type": "image", "image": image}], "What is it?")
    with LLM(str(model_dir), num_kv_blocks=64, dtype="bfloat16") as llm:
        [result] = llm.generate([prompt], GREEDY)
        model = llm.engine.runner.model
        assert isinstance(model.visual.patch_embed, PrepackedLinear)
        grid = torch.tensor([[1, 6, 8]])
        pixels = torch.randn(48, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            rows = model.encode_images(pixels, grid).float()
    assert result.error is None and len(result.token_ids) == NUM_NEW
    reference = load_model(str(model_dir), dtype=torch.float32, device=torch.device("cpu"),
                           attention=get_attention_backend("torch"))  # fmt: skip
    with torch.no_grad():
        expected = reference.encode_images(pixels, grid)
    torch.testing.assert_close(rows, expected, atol=0.1, rtol=0.05)
