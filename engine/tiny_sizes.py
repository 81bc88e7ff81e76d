"""The shapes of the checkpoints `engine.tiny_model` writes: `TinyModelSpec`, and `SIZES`
by name (tests, CPU benchmarks, and the real shapes of Qwen2-VL, Qwen2.5-VL and Qwen3-VL
for GPU benchmarks). engine/tiny_model.py says what each size is for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.model_config import QWEN3_VL_MODEL_TYPES

TEXT_ONLY_ARCHITECTURES = ("qwen2", "llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one generated checkpoint. `hidden_size // num_attention_heads` is the head
    dim (transformers derives it that way) and `2 * sum(mrope_section)` must equal it.

    `vocab_size` is the number of embedding (and lm_head) rows: None rounds the tokenizer's
    size up to VOCAB_ALIGNMENT; a larger value pads with zero rows to a real model's shape.
    With `tie_word_embeddings` the checkpoint has no lm_head.weight (logits use the
    embedding matrix), as in Qwen2-VL-2B."""

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
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    architecture: str = "qwen2_vl"  # or "qwen2_5_vl"; text only: "qwen2", "llama", "qwen3"
    explicit_head_dim: int | None = None  # config.json's head_dim (Qwen3); None: derived
    num_position_embeddings: int = 0  # qwen3_vl: the learned position table (a square)
    deepstack_visual_indexes: tuple[int, ...] = ()  # qwen3_vl
    num_experts: int = 0  # qwen3_moe, qwen3_vl_moe: experts per sparse layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep the dense MLP
    vision_intermediate_size: int = 0  # qwen2_5_vl
    window_size: int = 112  # qwen2_5_vl
    fullatt_block_indexes: tuple[int, ...] = ()  # qwen2_5_vl
    tokens_per_second: int = 2  # qwen2_5_vl (Qwen2.5-VL-3B/7B's value)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_qwen2_5_vl(self) -> bool:
        return self.architecture == "qwen2_5_vl"

    @property
    def is_qwen3_vl(self) -> bool:
        return self.architecture in QWEN3_VL_MODEL_TYPES

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The decoder layers whose MLP is a mixture of experts."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.mlp_only_layers)

    @property
    def has_vision(self) -> bool:
        return self.architecture not in TEXT_ONLY_ARCHITECTURES


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
    # FlashInfer's head dim (128, as Qwen2-VL-2B/7B), small otherwise: the GPU tests run
    # FlashInfer on it, which JIT-compiles one kernel module per head dim and dtype.
    "tiny-hd128": TinyModelSpec(
        bpe_vocab_size=1536,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        mrope_section=(16, 24, 24),
        max_position_embeddings=4096,
        vision_depth=2,
        vision_embed_dim=64,
        vision_num_heads=4,
        max_pixels=448 * 448,
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
    # The real Qwen2-VL-2B / 7B shapes (2,208,985,600 and 8,291,375,616 parameters, as the
    # hub checkpoints), with the small tokenizer: only the embedding rows have the real count.
    "qwen2-vl-2b": TinyModelSpec(
        bpe_vocab_size=8192,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        mrope_section=(16, 24, 24),  # head_dim 128
        max_position_embeddings=32768,
        vision_depth=32,
        vision_embed_dim=1280,
        vision_num_heads=16,
        max_pixels=12845056,  # the hub preprocessor_config's
        dtype=torch.bfloat16,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2-vl-7b": TinyModelSpec(
        bpe_vocab_size=8192,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        mrope_section=(16, 24, 24),  # head_dim 128
        max_position_embeddings=32768,
        vision_depth=32,
        vision_embed_dim=1280,
        vision_num_heads=16,
        max_pixels=12845056,
        dtype=torch.bfloat16,
        vocab_size=152064,
    ),
    # The real Qwen2.5-VL-3B / 7B shapes (3,754,622,976 and 8,292,166,656 parameters, as the
    # hub checkpoints), with the small tokenizer.
    "qwen2.5-vl-3b": TinyModelSpec(
        bpe_vocab_size=8192,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        mrope_section=(16, 24, 24),  # head_dim 128
        max_position_embeddings=128000,
        vision_depth=32,
        vision_embed_dim=1280,
        vision_num_heads=16,
        max_pixels=12845056,
        dtype=torch.bfloat16,
        vocab_size=151936,
        tie_word_embeddings=True,
        architecture="qwen2_5_vl",
        vision_intermediate_size=3420,
        fullatt_block_indexes=(7, 15, 23, 31),
    ),
    "qwen2.5-vl-7b": TinyModelSpec(
        bpe_vocab_size=8192,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        mrope_section=(16, 24, 24),  # head_dim 128
        max_position_embeddings=128000,
        vision_depth=32,
        vision_embed_dim=1280,
        vision_num_heads=16,
        max_pixels=12845056,
        dtype=torch.bfloat16,
        vocab_size=152064,
        architecture="qwen2_5_vl",
        vision_intermediate_size=3420,
        fullatt_block_indexes=(7, 15, 23, 31),
    ),
}


# The real Qwen3-VL-2B / 4B shapes (2,127,532,032 and 4,437,815,808 parameters: Qwen3-1.7B's
# / 4B's decoder, the 24-block tower, deepstack from blocks 5, 11 and 17), with the small
# tokenizer: GPU benchmarks.
SIZES["qwen3-vl-2b"] = TinyModelSpec(
    bpe_vocab_size=8192,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    mrope_section=(24, 20, 20),  # head_dim 128
    max_position_embeddings=262144,
    vision_depth=24,
    vision_embed_dim=1024,
    vision_num_heads=16,
    max_pixels=16777216,
    min_pixels=65536,
    dtype=torch.bfloat16,
    vocab_size=151936,
    tie_word_embeddings=True,
    architecture="qwen3_vl",
    explicit_head_dim=128,
    vision_intermediate_size=4096,
    patch_size=16,
    num_position_embeddings=2304,
    deepstack_visual_indexes=(5, 11, 17),
)
SIZES["qwen3-vl-4b"] = dataclasses.replace(
    SIZES["qwen3-vl-2b"],
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
)


# Sizes that vary one above, by what they change.
# Qwen2.5-VL: windows of 56 pixels = 2 x 2 merged tokens, block 1 of 3 attends whole
# frames; an intermediate size that is no multiple of the width, as the real 3420.
SIZES["tiny-qwen2.5-vl"] = dataclasses.replace(
    SIZES["tiny"],
    num_hidden_layers=3,
    vision_depth=3,
    architecture="qwen2_5_vl",
    vision_intermediate_size=172,
    window_size=56,
    fullatt_block_indexes=(1,),
)
# `small` with Qwen2.5-VL's vision tower (a quarter of the real width, the real ratio of
# MLP to width, windows of 112 pixels, every fourth block full): CPU benchmarks.
SIZES["small-qwen2.5-vl"] = dataclasses.replace(
    SIZES["small"],
    vision_embed_dim=320,
    architecture="qwen2_5_vl",
    vision_intermediate_size=855,
    fullatt_block_indexes=(3,),
)
# The decoder alone (Qwen2ForCausalLM, as Qwen2 / Qwen2.5 language models): no vision
# weights, no preprocessor_config.json, plain RoPE (all frequencies on the first row).
SIZES["tiny-qwen2"] = dataclasses.replace(
    SIZES["tiny"], mrope_section=(16, 0, 0), vision_depth=0, architecture="qwen2"
)
# Llama 3.1's decoder alone, tiny-qwen2's shape: no q/k/v biases, llama3 rotary scaling
# (over an original context of 64 positions, so that it changes most frequencies within a
# test's prompts: LLAMA_CONFIG), a tokenizer that adds a BOS to raw text.
SIZES["tiny-llama"] = dataclasses.replace(SIZES["tiny-qwen2"], architecture="llama")
# Qwen3's decoder alone: no q/k/v biases, q/k head norms, and a head dim (48) that is not
# hidden / heads (32), as Qwen3's 128 against 1024 / 16 in Qwen3-0.6B.
SIZES["tiny-qwen3"] = dataclasses.replace(
    SIZES["tiny-qwen2"], architecture="qwen3", explicit_head_dim=48, mrope_section=(24, 0, 0)
)
# Qwen3-VL: Qwen3's decoder (head dim 48) with interleaved M-RoPE (sections of 10, 7 and 7
# frequencies, so that t also takes the tail, as the real 24 / 20 / 20 do), 16-pixel
# patches, an 8 x 8 learned position table, and deepstack from vision blocks 0 and 2 into
# decoder layers 0 and 1.
# Mixtures of experts: 8 experts of width 48, 2 per token, layer 1 dense (mlp_only_layers).
# 2 x 48 differs from the hidden size, so a transposed expert tensor cannot pass for the
# right one (transformers transposes the fused layout only where the shapes tell).
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
       "mlp_only_layers": (1,)}  # fmt: skip
SIZES["tiny-qwen3-moe"] = dataclasses.replace(SIZES["tiny-qwen3"], architecture="qwen3_moe", **MOE)
SIZES["tiny-qwen3-vl"] = dataclasses.replace(
    SIZES["tiny"],
    architecture="qwen3_vl",
    explicit_head_dim=48,
    mrope_section=(10, 7, 7),
    vision_depth=3,
    vision_intermediate_size=172,
    patch_size=16,
    min_pixels=64 * 64,
    num_position_embeddings=64,
    deepstack_visual_indexes=(0, 2),
)
# `small` reshaped as Qwen3-VL (head dim 64 of 14 heads, sections 12 / 10 / 10), with a
# quarter-width tower of 6 blocks (deepstack from 1, 3 and 5) and the real 48 x 48 learned
# position table: CPU benchmarks.
SIZES["small-qwen3-vl"] = dataclasses.replace(
    SIZES["small"],
    architecture="qwen3_vl",
    explicit_head_dim=64,
    mrope_section=(12, 10, 10),
    vision_depth=6,
    vision_embed_dim=256,
    vision_intermediate_size=1024,
    patch_size=16,
    min_pixels=64 * 64,
    max_pixels=1280 * 32 * 32,
    num_position_embeddings=2304,
    deepstack_visual_indexes=(1, 3, 5),
)
SIZES["tiny-qwen3-vl-moe"] = dataclasses.replace(
    SIZES["tiny-qwen3-vl"], architecture="qwen3_vl_moe", **MOE
)
# Qwen3-VL-30B-A3B's widths (a 2048-wide decoder of 32 query and 4 KV heads, 128 experts
# of width 768 in every layer, 8 per token; the 27-block, 1152-wide tower with deepstack
# from blocks 8, 16 and 24) with 8 of its 48 decoder layers: the grouped expert matmuls at
# their real shapes on a GPU. 6.1B parameters, 12.3 GB in bf16; all 48 layers would be
# 31,070,754,032 (the hub's 31.1B), 62 GB, more than the lent machine's disk holds.
SIZES["qwen3-vl-moe-8l"] = dataclasses.replace(
    SIZES["qwen3-vl-2b"],
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    tie_word_embeddings=False,
    architecture="qwen3_vl_moe",
    vision_depth=27,
    vision_embed_dim=1152,
    vision_intermediate_size=4304,
    deepstack_visual_indexes=(8, 16, 24),
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
)
