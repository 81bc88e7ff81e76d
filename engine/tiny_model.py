"""Write small random-weight Qwen2-VL checkpoints in Hugging Face format.

`tessera make-tiny-model OUT_DIR [--seed N] [--size tiny|tiny2|small]` writes a folder that
both Tessera and `transformers` load: config.json (flat hub layout), model.safetensors (hub
tensor names), a byte-level BPE tokenizer trained here with the Qwen2-VL special tokens,
the Qwen2-VL chat template and the image processor config. No network, no hub.

Everything is a pure function of (size, seed): the same arguments give byte-identical
files. The tokenizer depends on the size only, so checkpoints of one size share token ids.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

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
# Qwen2's pre-tokenizer split; `transformers`' Qwen2Tokenizer rebuilds this exact pipeline,
# so writing it into tokenizer.json keeps both loaders token-for-token identical.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VOCAB_ALIGNMENT = 64
MATRIX_GAIN = 1.5


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one generated checkpoint. `hidden_size // num_attention_heads` is the head
    dim (transformers derives it that way) and `2 * sum(mrope_section)` must equal it."""

    bpe_vocab_size: int  # target for the BPE trainer, byte alphabet included
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    vision_depth: int
    vision_embed_dim: int
    vision_num_heads: int
    max_pixels: int
    dtype: torch.dtype
    vision_mlp_ratio: int = 4
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    min_pixels: int = 56 * 56

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SIZES: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(
        bpe_vocab_size=1536,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        mrope_section=(4, 6, 6),
        max_position_embeddings=4096,
        vision_depth=2,
        vision_embed_dim=64,
        vision_num_heads=4,
        max_pixels=448 * 448,
        dtype=torch.float32,
    ),
    # A second, different shape (head_dim 16, 3 layers, 3:1 GQA) for tests that must not
    # pass by accident on one geometry.
    "tiny2": TinyModelSpec(
        bpe_vocab_size=1024,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        mrope_section=(2, 3, 3),
        max_position_embeddings=2048,
        vision_depth=1,
        vision_embed_dim=48,
        vision_num_heads=3,
        max_pixels=336 * 336,
        dtype=torch.float32,
    ),
    "small": TinyModelSpec(
        bpe_vocab_size=8192,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        mrope_section=(8, 12, 12),  # sums to head_dim / 2 = 32
        max_position_embeddings=32768,
        vision_depth=4,
        vision_embed_dim=256,
        vision_num_heads=4,
        max_pixels=1280 * 28 * 28,
        dtype=torch.bfloat16,
    ),
}


def make_tiny_model(out_dir: str | Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """Write a complete random-weight Qwen2-VL checkpoint folder and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    spec = SIZES[size]
    _check_spec(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(spec.bpe_vocab_size)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    token_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab_size = _round_up(num_tokens, VOCAB_ALIGNMENT)
    chat_template = read_chat_template()

    _write_json(out / "config.json", model_config_dict(spec, token_ids, vocab_size))
    _write_json(out / "generation_config.json", _generation_config(token_ids))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(token_ids, chat_template))
    _write_json(out / "preprocessor_config.json", _preprocessor_config(spec))
    _write_json(out / "chat_template.json", {"chat_template": chat_template})
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    weights = random_weights(spec, vocab_size, seed, num_real_tokens=num_tokens)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only
    return out


def _check_spec(spec: TinyModelSpec) -> None:
    if spec.hidden_size % spec.num_attention_heads or spec.head_dim % 2:
        raise ValueError("hidden_size must split into an even head_dim per attention head")
    if 2 * sum(spec.mrope_section) != spec.head_dim:
        raise ValueError("2 * sum(mrope_section) must equal head_dim")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if spec.vision_embed_dim % spec.vision_num_heads:
        raise ValueError("vision_embed_dim must be a multiple of vision_num_heads")


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# ---------------------------------------------------------------------------- weights


def weight_shapes(spec: TinyModelSpec, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Hub tensor names and shapes, in the fixed order the random values are drawn."""
    hidden, kv_dim = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden))
    ]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv_dim,)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (spec.intermediate_size, hidden)),
            (p + "mlp.up_proj.weight", (spec.intermediate_size, hidden)),
            (p + "mlp.down_proj.weight", (hidden, spec.intermediate_size)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab_size, hidden))]

    embed = spec.vision_embed_dim
    patch = (embed, 3, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
    shapes.append(("visual.patch_embed.proj.weight", patch))  # Conv3d, no bias
    mlp = embed * spec.vision_mlp_ratio
    for i in range(spec.vision_depth):
        p = f"visual.blocks.{i}."
        shapes += [
            (p + "norm1.weight", (embed,)),
            (p + "norm1.bias", (embed,)),
            (p + "attn.qkv.weight", (3 * embed, embed)),
            (p + "attn.qkv.bias", (3 * embed,)),
            (p + "attn.proj.weight", (embed, embed)),
            (p + "attn.proj.bias", (embed,)),
            (p + "norm2.weight", (embed,)),
            (p + "norm2.bias", (embed,)),
            (p + "mlp.fc1.weight", (mlp, embed)),
            (p + "mlp.fc1.bias", (mlp,)),
            (p + "mlp.fc2.weight", (embed, mlp)),
            (p + "mlp.fc2.bias", (embed,)),
        ]
    merged = embed * spec.spatial_merge_size**2
    shapes += [
        ("visual.merger.ln_q.weight", (embed,)),
        ("visual.merger.ln_q.bias", (embed,)),
        ("visual.merger.mlp.0.weight", (merged, merged)),
        ("visual.merger.mlp.0.bias", (merged,)),
        ("visual.merger.mlp.2.weight", (hidden, merged)),
        ("visual.merger.mlp.2.bias", (hidden,)),
    ]
    return shapes


def random_weights(
    spec: TinyModelSpec, vocab_size: int, seed: int, *, num_real_tokens: int | None = None
) -> dict[str, torch.Tensor]:
    """Draw every tensor from one seeded generator, in `weight_shapes` order.

    Matrices get std MATRIX_GAIN/sqrt(fan_in) rather than HF's 0.02: with 0.02 the residual
    stream barely changes, greedy decoding collapses into one repeated token and a wrong
    rotary or mask hides below test tolerances (gain 1.5 gives ~30 distinct tokens in 32
    greedy steps). Norm scales are 1 +- 0.1 and biases 0 +- 0.1 so a forgotten bias or norm
    weight shows up too. Embedding and lm_head rows past the tokenizer's vocabulary (the
    alignment padding) are zero, so greedy decoding never emits an id the tokenizer lacks.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(spec, vocab_size):
        tensor = torch.empty(shape, dtype=torch.float32)
        if name == "model.embed_tokens.weight":
            tensor.normal_(0.0, 1.0, generator=generator)
        elif len(shape) >= 2:
            fan_in = math.prod(shape[1:])
            tensor.normal_(0.0, MATRIX_GAIN * fan_in**-0.5, generator=generator)
        elif name.endswith("bias"):
            tensor.normal_(0.0, 0.1, generator=generator)
        else:  # RMSNorm / LayerNorm scale
            tensor.normal_(1.0, 0.1, generator=generator)
        if name in ("model.embed_tokens.weight", "lm_head.weight") and num_real_tokens:
            tensor[num_real_tokens:] = 0.0
        weights[name] = tensor.to(spec.dtype).contiguous()
    return weights


# ---------------------------------------------------------------------------- tokenizer


def train_tokenizer(bpe_vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on `training_corpus()`, then the Qwen2-VL special tokens with
    ids right after the learned vocabulary, in `SPECIAL_TOKENS` order."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_corpus(bpe_vocab_size), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    return tokenizer


def training_corpus(bpe_vocab_size: int) -> list[str]:
    """Deterministic English-like text: the shipped word list in random sentences, plus
    made-up words so larger vocabularies have enough distinct merges to learn."""
    rng = random.Random(1234)
    words = _asset("tiny_words.txt").split()
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    made_up = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))
        for _ in range(bpe_vocab_size)
    ]
    lines = []
    for _ in range(4 * bpe_vocab_size):
        pool = made_up if rng.random() < 0.2 else words
        sentence = " ".join(rng.choice(pool) for _ in range(rng.randint(4, 14)))
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 9999)}"
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:"))
    return lines


def _asset(name: str) -> str:
    return (resources.files("engine") / "assets" / name).read_text(encoding="utf-8")


def read_chat_template() -> str:
    """The Qwen2-VL chat template shipped in engine/assets (also written into checkpoints)."""
    return _asset("qwen2_vl_chat_template.jinja")


# ---------------------------------------------------------------------------- json files


def model_config_dict(spec: TinyModelSpec, token_ids: dict[str, int], vocab_size: int) -> dict:
    """config.json in the flat hub layout that both transformers 4.x and 5.x read."""
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[spec.dtype]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
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
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
        "vision_config": {
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
        },
    }


def _generation_config(token_ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
        "pad_token_id": token_ids["<|endoftext|>"],
        "do_sample": False,
    }


def _tokenizer_config(token_ids: dict[str, int], chat_template: str) -> dict:
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


def _preprocessor_config(spec: TinyModelSpec) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "resample": 3,  # PIL bicubic
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.spatial_merge_size,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(
        json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


# ---------------------------------------------------------------------------- cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera make-tiny-model",
        description="Write a random-weight Qwen2-VL checkpoint (weights, tokenizer, processor).",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out_dir, seed=args.seed, size=args.size)
    print(f"wrote {args.size} Qwen2-VL checkpoint (seed {args.seed}) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
