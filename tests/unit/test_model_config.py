"""engine/model_config.py: what a checkpoint's config.json means to Tessera, and the
fields it cannot honour refused rather than ignored (each was served wrong, fuzz55)."""

from __future__ import annotations

import pytest

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig, check_max_model_len
from engine.tiny_configs import SPECIAL_TOKENS, model_config_dict
from engine.tiny_sizes import SIZES

TOKEN_IDS = {token: 1000 + i for i, token in enumerate(SPECIAL_TOKENS)}


def config_of(size: str, **changes) -> dict:
    config = model_config_dict(SIZES[size], TOKEN_IDS, vocab_size=2048)
    config.update(changes)
    return config


@pytest.mark.parametrize("size", ["tiny-qwen2", "tiny-qwen3", "tiny"])
def test_a_sliding_window_caps_the_context_length(size):
    """Layers from max_window_layers on attend to the last 16 tokens only (transformers);
    Tessera's attend to all, so a 40-token prompt answered differently. The context is
    now capped to the window, where the two agree, and a longer one is refused."""
    slides = config_of(size, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    model = ModelConfig.from_dict(slides)
    assert model.sliding_window == 16
    assert check_max_model_len(None, model) == 16
    assert check_max_model_len(12, model) == 12
    with pytest.raises(ModelLoadError, match="sliding window"):
        check_max_model_len(17, model)


@pytest.mark.parametrize("changes", [
    {"use_sliding_window": False, "sliding_window": 16},  # shipped Qwen checkpoints
    {"use_sliding_window": True, "sliding_window": None},
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 99},
    {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention"] * 2},
])  # fmt: skip
def test_no_layer_slides_and_the_context_is_the_trained_one(changes):
    model = ModelConfig.from_dict(config_of("tiny-qwen3", **changes))
    assert model.sliding_window is None
    assert check_max_model_len(None, model) == model.max_position_embeddings


def test_layer_types_decide_which_layers_slide():
    layer_types = ["full_attention", "sliding_attention"]
    config = config_of("tiny-qwen3", use_sliding_window=True, sliding_window=16,
                       max_window_layers=99, layer_types=layer_types)  # fmt: skip
    assert ModelConfig.from_dict(config).sliding_window == 16


@pytest.mark.parametrize("size", ["tiny", "tiny-qwen2.5-vl"])
@pytest.mark.parametrize("rope_type", ["yarn", "linear"])
def test_a_vision_language_models_rope_scaling_is_refused(size, rope_type):
    """Qwen2.5-VL with YaRN was served with plain M-RoPE (text-only models refused it)."""
    config = config_of(size)
    config["rope_scaling"] = {**config["rope_scaling"], "rope_type": rope_type, "factor": 4.0}
    with pytest.raises(ModelLoadError, match=f"rope scaling '{rope_type}'"):
        ModelConfig.from_dict(config)


@pytest.mark.parametrize("size", ["tiny", "tiny-qwen2.5-vl", "qwen3-vl-2b"])
def test_the_shipped_m_rope_is_taken(size):
    assert ModelConfig.from_dict(config_of(size)).vision is not None


@pytest.mark.parametrize("activation", ["relu", "gelu_pytorch_tanh"])
def test_a_decoder_activation_other_than_silu_is_refused(activation):
    """The decoder's MLP is always SiLU-gated: `relu` gave other tokens, silently."""
    with pytest.raises(ModelLoadError, match=f"hidden_act '{activation}'"):
        ModelConfig.from_dict(config_of("tiny-qwen3", hidden_act=activation))


@pytest.mark.parametrize("changes, words", [
    ({"max_position_embeddings": 0}, "max_position_embeddings 0 is not positive"),
    ({"num_attention_heads": 8}, r"mrope_section \(4, 6, 6\) does not sum to head_dim // 2 \(8\)"),
    ({"num_attention_heads": 6}, "num_attention_heads 6 does not divide hidden_size 128"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
])  # fmt: skip
def test_a_decoder_that_cannot_be_built_is_refused_by_its_config(changes, words):
    """Each passed here and failed in the model's constructor (or as a zero-length context)
    with a traceback from the engine process, after it had started (fuzz62)."""
    with pytest.raises(ModelLoadError, match=f"config.json is invalid: {words}"):
        ModelConfig.from_dict(config_of("tiny", **changes))


def test_an_explicit_head_dim_need_not_divide_the_hidden_size():
    """Qwen3's q_proj maps hidden_size to heads x head_dim (0.6B: 1024 to 16 x 128)."""
    model = ModelConfig.from_dict(
        config_of("tiny-qwen3", num_attention_heads=6, num_key_value_heads=2)
    )
    assert model.num_attention_heads * model.head_dim != model.hidden_size
