"""The JSON files of a tiny checkpoint (engine/tiny_model.py writes them): config.json in
each architecture's hub layout, generation_config.json, tokenizer_config.json and the image
processor's preprocessor_config.json, as pure functions of the spec and the token ids."""

from __future__ import annotations

import torch

from engine.tiny_sizes import TinyModelSpec

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def model_config_dict(spec: TinyModelSpec, token_ids: dict[str, int], vocab_size: int) -> dict:
    """config.json in the flat hub layout that both transformers 4.x and 5.x read (Qwen3-VL:
    its hub layout, nested)."""
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[spec.dtype]
    if spec.is_qwen3_vl:
        return _qwen3_vl_config(spec, token_ids, vocab_size, dtype)
    architecture, model_type = {
        "qwen2_vl": ("Qwen2VLForConditionalGeneration", "qwen2_vl"),
        "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
        "qwen2": ("Qwen2ForCausalLM", "qwen2"),
        "llama": ("LlamaForCausalLM", "llama"),
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    }[spec.architecture]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "attention_dropout": 0.0,
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_token_id": token_ids["<|vision_pad|>"],
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
        "sliding_window": spec.max_position_embeddings,
        "use_sliding_window": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
        "vision_config": _vision_config_dict(spec),
    }
    if not spec.has_vision:  # a Qwen2 language model's config.json: no vision keys
        for key in ("vision_config", "rope_scaling", "vision_start_token_id",
                    "vision_end_token_id", "vision_token_id", "image_token_id",
                    "video_token_id"):  # fmt: skip
            del config[key]
    if spec.architecture == "llama":
        config.update(LLAMA_CONFIG)
    if spec.architecture in ("qwen3", "qwen3_moe"):
        config.update(head_dim=spec.head_dim, attention_bias=False)
    return {**config, **_moe_fields(spec)}


def _moe_fields(spec: TinyModelSpec) -> dict:
    if not spec.num_experts:
        return {}
    return {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(spec.mlp_only_layers),
    }


def _qwen3_vl_config(
    spec: TinyModelSpec, token_ids: dict[str, int], vocab_size: int, dtype: str
) -> dict:
    """As the hub's Qwen3-VL config.json: the decoder in `text_config`, the tower in
    `vision_config`, token ids at the top."""
    text = {
        "model_type": "qwen3_vl_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_interleaved": True,
            "mrope_section": list(spec.mrope_section),
        },  # fmt: skip
        "rope_theta": 5000000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
        **_moe_fields(spec),
    }
    moe = spec.architecture == "qwen3_vl_moe"
    if moe:
        text["model_type"] = "qwen3_vl_moe_text"
    vision = {
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "deepstack_visual_indexes": list(spec.deepstack_visual_indexes),
        "depth": spec.vision_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": spec.vision_embed_dim,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_num_heads,
        "num_position_embeddings": spec.num_position_embeddings,
        "out_hidden_size": spec.hidden_size,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
    }
    return {
        "architectures": [
            "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
        ],
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "tie_word_embeddings": spec.tie_word_embeddings,
        "dtype": dtype,
        "text_config": text,
        "vision_config": vision,
    }


LLAMA_CONFIG = {  # Llama 3.1's values, but for original_max_position_embeddings (8192)
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _vision_config_dict(spec: TinyModelSpec) -> dict:
    if spec.is_qwen2_5_vl:  # as in the hub's Qwen2.5-VL config.json
        return {
            "depth": spec.vision_depth,
            "hidden_act": "silu",
            "hidden_size": spec.vision_embed_dim,
            "intermediate_size": spec.vision_intermediate_size,
            "num_heads": spec.vision_num_heads,
            "in_chans": 3,
            "out_hidden_size": spec.hidden_size,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.spatial_merge_size,
            "spatial_patch_size": spec.patch_size,
            "window_size": spec.window_size,
            "fullatt_block_indexes": list(spec.fullatt_block_indexes),
            "tokens_per_second": spec.tokens_per_second,
            "temporal_patch_size": spec.temporal_patch_size,
        }
    return {
        "depth": spec.vision_depth,
        "embed_dim": spec.vision_embed_dim,
        "hidden_size": spec.hidden_size,  # merger output = decoder hidden size
        "hidden_act": "quick_gelu",
        "mlp_ratio": spec.vision_mlp_ratio,
        "num_heads": spec.vision_num_heads,
        "in_channels": 3,
        "in_chans": 3,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
    }


def generation_config(token_ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
        "pad_token_id": token_ids["<|endoftext|>"],
        "do_sample": False,
    }


def tokenizer_config(token_ids: dict[str, int], chat_template: str) -> dict:
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in token_ids.items()
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": chat_template,
    }


def preprocessor_config(spec: TinyModelSpec) -> dict:
    processor = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
                 "qwen3_vl_moe": "Qwen3VLProcessor"}  # fmt: skip
    mean, std = ((0.5,) * 3, (0.5,) * 3) if spec.is_qwen3_vl else (CLIP_MEAN, CLIP_STD)
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor.get(spec.architecture, "Qwen2VLProcessor"),
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "resample": 3,  # PIL bicubic
        "image_mean": list(mean),
        "image_std": list(std),
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.spatial_merge_size,
    }


def video_preprocessor_config(spec: TinyModelSpec) -> dict:
    """Qwen3-VL's video_preprocessor_config.json, as its hub checkpoints carry one: without it
    transformers (and vLLM) fall back to preprocessor_config.json's Qwen2-VL image processor
    and so to Qwen2-VL's video processor (other frame sampling, no timestamps). The frame
    bounds are the image ones, which Tessera used for a video before the file existed."""
    image = preprocessor_config(spec)
    del image["image_processor_type"], image["min_pixels"], image["max_pixels"]
    return {**image, "video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True,
            "fps": 2, "min_frames": 4, "max_frames": 768}  # fmt: skip
