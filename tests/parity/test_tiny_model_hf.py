"""transformers loads and generates from the checkpoints engine.tiny_model writes."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers")

from engine.tiny_model import (  # noqa: E402
    SIZES,
    SPECIAL_TOKENS,
    make_tiny_model,
    write_checkpoint,
)

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_hf"), seed=0)


@pytest.fixture(scope="module")
def hf_model(tiny):
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tiny, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def hf_tokenizer(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny)


def test_loads_with_no_missing_or_unexpected_keys(hf_model):
    model, info = hf_model
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert not info["error_msgs"]


def test_second_shape_loads_too(tmp_path):
    path = make_tiny_model(tmp_path, seed=5, size="tiny2")
    _, info = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        path, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]


def test_qwen2_5_vl_shape_loads_too(tmp_path):
    path = make_tiny_model(tmp_path, seed=2, size="tiny-qwen2.5-vl")
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        path, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    vision = model.config.vision_config
    assert (vision.hidden_size, vision.intermediate_size, vision.window_size) == (64, 172, 56)
    assert list(vision.fullatt_block_indexes) == [1]


def test_transformers_reads_the_flat_config(hf_model, hf_tokenizer):
    config = hf_model[0].config
    spec = SIZES["tiny"]
    assert config.text_config.hidden_size == spec.hidden_size
    assert config.text_config.num_key_value_heads == spec.num_key_value_heads
    assert list(config.text_config.rope_parameters["mrope_section"]) == list(spec.mrope_section)
    assert config.vision_config.embed_dim == spec.vision_embed_dim
    assert config.vision_config.hidden_size == spec.hidden_size
    assert config.image_token_id == hf_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.tie_word_embeddings is False
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in hf_model[0].generation_config.eos_token_id


def test_hf_tokenizer_matches_the_tokenizers_library(tiny, hf_tokenizer):
    """The server tokenizes with either; both must give the same ids."""
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    for text in (
        "Hello world",
        "  spaces\n\nand 12345 digits's",
        "héllo 世界 🙂",
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>x<|im_end|>",
    ):
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == raw.encode(text).ids, text
    for token in SPECIAL_TOKENS:
        assert hf_tokenizer.convert_tokens_to_ids(token) == raw.token_to_id(token)


def test_hf_chat_template_renders_like_qwen2_vl(hf_tokenizer):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_image_processor_geometry(tiny):
    processor = transformers.AutoImageProcessor.from_pretrained(tiny)
    if not HAS_TORCHVISION:
        assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    image = Image.new("RGB", (448, 448), (120, 30, 200))
    out = processor(images=[image], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 32, 32]]  # 1024 patches -> 256 tokens
    assert tuple(out["pixel_values"].shape) == (1024, 3 * 2 * 14 * 14)
    small = processor(images=[Image.new("RGB", (20, 20))], return_tensors="pt")
    t, h, w = small["image_grid_thw"][0].tolist()
    assert h * w * 14 * 14 >= 56 * 56  # min_pixels


def _image_inputs(tiny, hf_tokenizer, text: str, image: Image.Image) -> dict:
    """Qwen2VLProcessor when it can be built; transformers 5.23 cannot build it without
    torchvision (its video processor needs it), so then do its one job for images by hand:
    expand each <|image_pad|> to grid_t*grid_h*grid_w / merge**2 copies."""
    if HAS_TORCHVISION:
        processor = transformers.AutoProcessor.from_pretrained(tiny)
        return dict(processor(text=[text], images=[image], return_tensors="pt"))
    image_processor = transformers.AutoImageProcessor.from_pretrained(tiny)
    pixels = image_processor(images=[image], return_tensors="pt")
    num_tokens = int(pixels["image_grid_thw"][0].prod()) // image_processor.merge_size**2
    text = text.replace("<|image_pad|>", "<|image_pad|>" * num_tokens)
    return {**hf_tokenizer(text, return_tensors="pt"), **pixels}


def _greedy(model, inputs: dict, num_tokens: int = 16) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=num_tokens, do_sample=False, min_new_tokens=num_tokens
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_generates_varied_tokens_from_a_text_prompt(hf_model, hf_tokenizer):
    messages = [{"role": "user", "content": "Describe a dog in the park."}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(hf_tokenizer(text, return_tensors="pt"))
    tokens = _greedy(hf_model[0], inputs)
    assert len(tokens) == 16
    assert len(set(tokens)) >= 6, tokens
    assert max(tokens) < len(hf_tokenizer)  # padded vocab rows never win


def test_generates_varied_tokens_from_an_image_prompt(tiny, hf_model, hf_tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels = (np.arange(224 * 300 * 3).reshape(224, 300, 3) % 251).astype(np.uint8)
    inputs = _image_inputs(tiny, hf_tokenizer, text, Image.fromarray(pixels))
    assert inputs["image_grid_thw"].tolist() == [[1, 16, 22]]
    image_id = hf_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_id).sum()) == 16 * 22 // 4
    tokens = _greedy(hf_model[0], inputs)
    assert len(set(tokens)) >= 6, tokens
    # The image matters: a different picture changes the continuation.
    other = _image_inputs(tiny, hf_tokenizer, text, Image.fromarray(255 - pixels))
    assert _greedy(hf_model[0], other) != tokens


def test_tied_padded_sharded_checkpoint_matches_tessera(tmp_path):
    """Tied embeddings (no lm_head.weight), embedding rows forced past the tokenizer's size
    to an unaligned count, and several shards with an index: transformers and Tessera both
    load it and agree on greedy tokens and their logprobs."""
    from engine import LLM
    from tests.parity.test_generate import GREEDY, Reference, chat, check, picture

    spec = dataclasses.replace(SIZES["tiny2"], vocab_size=1100, tie_word_embeddings=True)
    path = write_checkpoint(tmp_path / "tied", spec, seed=3, max_shard_bytes=200_000)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    _, info = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        path, output_loading_info=True
    )
    assert not any(info.values()), info
    reference = Reference(path)
    model = reference.model
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.lm_head.weight.shape[0] == 1100

    prompts = [chat("Describe a dog in the park."), chat(picture(112, 84, 1), "What is this?")]
    results = LLM(str(path), num_kv_blocks=64).generate(prompts, GREEDY)
    check(results, reference, prompts, range(len(prompts)))
    tokens = [t for index in range(len(prompts)) for t in reference.get(index, prompts[index])[1]]
    assert len(set(tokens)) >= 6 and max(tokens) < len(reference.tokenizer), tokens
