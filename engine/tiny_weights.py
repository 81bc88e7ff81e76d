"""Random weights for `engine.tiny_model` checkpoints: hub tensor names and shapes, the
seeded draw, and the safetensors files they are written to.

The draw is a pure function of (spec, vocab size, seed, device): tensors are drawn one at a
time in `weight_shapes` order from a single generator, so the same arguments give the same
bytes, and only one shard of converted tensors is ever held in memory.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from engine.tiny_sizes import TinyModelSpec

QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")

MATRIX_GAIN = 1.5
MAX_SHARD_BYTES = 5 * 10**9  # transformers' historic default; a 7B bf16 file makes 4 shards
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_shapes(spec: TinyModelSpec, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Hub tensor names and shapes, in the fixed order the random values are drawn."""
    hidden, kv_dim = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    q_dim = spec.num_attention_heads * spec.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden))
    ]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q_dim, hidden)),
            (p + "self_attn.q_proj.bias", (q_dim,)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv_dim,)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, q_dim)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (spec.intermediate_size, hidden)),
            (p + "mlp.up_proj.weight", (spec.intermediate_size, hidden)),
            (p + "mlp.down_proj.weight", (hidden, spec.intermediate_size)),
        ]
        if spec.architecture in ("llama", *QK_NORM_ARCHITECTURES):  # no q, k, v biases
            layer = [(name, shape) for name, shape in layer if not name.endswith("_proj.bias")]
        if i in spec.sparse_layers:  # the MLP becomes a router and experts
            layer = [entry for entry in layer if ".mlp." not in entry[0]]
            layer += _expert_shapes(spec, p + "mlp.")
        if spec.architecture in QK_NORM_ARCHITECTURES:  # an RMSNorm over each q and k head
            layer[2:2] = [(p + "self_attn.q_norm.weight", (spec.head_dim,)),
                          (p + "self_attn.k_norm.weight", (spec.head_dim,))]  # fmt: skip
        shapes += layer
    shapes.append(("model.norm.weight", (hidden,)))
    if not spec.tie_word_embeddings:  # tied: logits use model.embed_tokens.weight
        shapes.append(("lm_head.weight", (vocab_size, hidden)))

    if not spec.has_vision:
        return shapes
    if spec.is_qwen3_vl:  # the hub layout: the decoder under model.language_model
        shapes = [(_qwen3_vl_name(name), shape) for name, shape in shapes]
        return shapes + _qwen3_vision_shapes(spec)
    embed = spec.vision_embed_dim
    patch = (embed, 3, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
    shapes.append(("visual.patch_embed.proj.weight", patch))  # Conv3d, no bias
    if spec.is_qwen2_5_vl:
        return shapes + _qwen2_5_vision_shapes(spec)
    mlp = embed * spec.vision_mlp_ratio
    for i in range(spec.vision_depth):
        shapes += _layer_norm_block_shapes(f"visual.blocks.{i}.", embed, mlp, "fc")
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


def _qwen2_5_vision_shapes(spec: TinyModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-VL's vision blocks and merger: RMSNorms (no bias), a gated MLP with biases."""
    embed, mlp = spec.vision_embed_dim, spec.vision_intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(spec.vision_depth):
        p = f"visual.blocks.{i}."
        shapes += [
            (p + "norm1.weight", (embed,)),
            (p + "attn.qkv.weight", (3 * embed, embed)),
            (p + "attn.qkv.bias", (3 * embed,)),
            (p + "attn.proj.weight", (embed, embed)),
            (p + "attn.proj.bias", (embed,)),
            (p + "norm2.weight", (embed,)),
            (p + "mlp.gate_proj.weight", (mlp, embed)),
            (p + "mlp.gate_proj.bias", (mlp,)),
            (p + "mlp.up_proj.weight", (mlp, embed)),
            (p + "mlp.up_proj.bias", (mlp,)),
            (p + "mlp.down_proj.weight", (embed, mlp)),
            (p + "mlp.down_proj.bias", (embed,)),
        ]
    merged = embed * spec.spatial_merge_size**2
    return shapes + [
        ("visual.merger.ln_q.weight", (embed,)),
        ("visual.merger.mlp.0.weight", (merged, merged)),
        ("visual.merger.mlp.0.bias", (merged,)),
        ("visual.merger.mlp.2.weight", (spec.hidden_size, merged)),
        ("visual.merger.mlp.2.bias", (spec.hidden_size,)),
    ]


def _expert_shapes(spec: TinyModelSpec, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A sparse layer's router and experts: one tensor each per expert (Qwen3-MoE's hub
    layout) or two fused [E, in, out] tensors (Qwen3-VL-MoE's)."""
    hidden, width, count = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    shapes = [(p + "gate.weight", (count, hidden))]
    if spec.architecture == "qwen3_vl_moe":
        return shapes + [(p + "experts.gate_up_proj", (count, hidden, 2 * width)),
                         (p + "experts.down_proj", (count, width, hidden))]  # fmt: skip
    for e in range(count):
        shapes += [(f"{p}experts.{e}.gate_proj.weight", (width, hidden)),
                   (f"{p}experts.{e}.up_proj.weight", (width, hidden)),
                   (f"{p}experts.{e}.down_proj.weight", (hidden, width))]  # fmt: skip
    return shapes


def _layer_norm_block_shapes(
    p: str, embed: int, mlp: int, fc: str
) -> list[tuple[str, tuple[int, ...]]]:
    """One LayerNorm vision block with a 2-layer MLP (`{fc}1`, `{fc}2`): Qwen2-VL's, Qwen3-VL's."""
    return [
        (p + "norm1.weight", (embed,)),
        (p + "norm1.bias", (embed,)),
        (p + "attn.qkv.weight", (3 * embed, embed)),
        (p + "attn.qkv.bias", (3 * embed,)),
        (p + "attn.proj.weight", (embed, embed)),
        (p + "attn.proj.bias", (embed,)),
        (p + "norm2.weight", (embed,)),
        (p + "norm2.bias", (embed,)),
        (p + f"mlp.{fc}1.weight", (mlp, embed)),
        (p + f"mlp.{fc}1.bias", (mlp,)),
        (p + f"mlp.{fc}2.weight", (embed, mlp)),
        (p + f"mlp.{fc}2.bias", (embed,)),
    ]


def _qwen3_vl_name(name: str) -> str:
    return "model.language_model." + name[len("model.") :] if name.startswith("model.") else name


def _qwen3_vision_shapes(spec: TinyModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-VL's tower: a biased patch embedding, the learned position table, LayerNorm
    blocks with a 2-layer MLP, the merger and one merger per deepstack level."""
    embed, mlp = spec.vision_embed_dim, spec.vision_intermediate_size
    merged = embed * spec.spatial_merge_size**2
    patch = (embed, 3, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
    v = "model.visual."
    shapes: list[tuple[str, tuple[int, ...]]] = [
        (v + "patch_embed.proj.weight", patch),
        (v + "patch_embed.proj.bias", (embed,)),
        (v + "pos_embed.weight", (spec.num_position_embeddings, embed)),
    ]
    for i in range(spec.vision_depth):
        shapes += _layer_norm_block_shapes(f"{v}blocks.{i}.", embed, mlp, "linear_fc")
    mergers = [(v + "merger.", embed)] + [
        (f"{v}deepstack_merger_list.{i}.", merged)
        for i in range(len(spec.deepstack_visual_indexes))
    ]
    for p, norm_width in mergers:
        shapes += [
            (p + "norm.weight", (norm_width,)),
            (p + "norm.bias", (norm_width,)),
            (p + "linear_fc1.weight", (merged, merged)),
            (p + "linear_fc1.bias", (merged,)),
            (p + "linear_fc2.weight", (spec.hidden_size, merged)),
            (p + "linear_fc2.bias", (spec.hidden_size,)),
        ]
    return shapes


def random_weights(
    spec: TinyModelSpec,
    vocab_size: int,
    seed: int,
    *,
    num_real_tokens: int | None = None,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Every tensor of `iter_random_weights`, in one dict (CPU tensors of `spec.dtype`)."""
    return dict(
        iter_random_weights(spec, vocab_size, seed, num_real_tokens=num_real_tokens, device=device)
    )


def iter_random_weights(
    spec: TinyModelSpec,
    vocab_size: int,
    seed: int,
    *,
    num_real_tokens: int | None = None,
    device: str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Draw every tensor from one seeded generator, in `weight_shapes` order, and yield each
    as a CPU tensor of `spec.dtype` (converted as soon as it is drawn: no float32 copy of the
    whole model is ever held).

    The generator lives on `device`: "cpu" (the default, what tests use) or "cuda", which
    is much faster for billions of values but draws different numbers from the same seed;
    a CUDA draw is reproducible on the same GPU model and torch version.

    Matrices get std MATRIX_GAIN/sqrt(fan_in) rather than HF's 0.02: with 0.02 the residual
    stream barely changes, greedy decoding collapses into one repeated token and a wrong
    rotary or mask hides below test tolerances (gain 1.5 gives ~30 distinct tokens in 32
    greedy steps). Norm scales are 1 +- 0.1 and biases 0 +- 0.1 so a forgotten bias or norm
    weight shows up too. Embedding and lm_head rows past the tokenizer's vocabulary (the
    alignment padding) are zero, so greedy decoding never emits an id the tokenizer lacks.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in weight_shapes(spec, vocab_size):
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
        is_embedding = name.endswith("embed_tokens.weight")
        if is_embedding:
            tensor.normal_(0.0, 1.0, generator=generator)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            tensor.normal_(0.0, MATRIX_GAIN * shape[1] ** -0.5, generator=generator)
        elif len(shape) >= 2:
            fan_in = math.prod(shape[1:])
            tensor.normal_(0.0, MATRIX_GAIN * fan_in**-0.5, generator=generator)
        elif name.endswith("bias"):
            tensor.normal_(0.0, 0.1, generator=generator)
        else:  # RMSNorm / LayerNorm scale
            tensor.normal_(1.0, 0.1, generator=generator)
        if (is_embedding or name == "lm_head.weight") and num_real_tokens:
            tensor[num_real_tokens:] = 0.0
        yield name, tensor.to(spec.dtype).to("cpu").contiguous()


def shard_plan(
    shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, max_shard_bytes: int
) -> list[list[str]]:
    """Tensor names per file, in order: a new shard starts where the next tensor would take
    the current one past `max_shard_bytes` (a single larger tensor gets a shard alone)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    num_bytes = 0
    for name, shape in shapes:
        size = math.prod(shape) * itemsize
        if shards[-1] and num_bytes + size > max_shard_bytes:
            shards.append([])
            num_bytes = 0
        shards[-1].append(name)
        num_bytes += size
    return shards


def save_shards(
    out: Path, weights: Iterator[tuple[str, torch.Tensor]], plan: list[list[str]]
) -> None:
    """model.safetensors when the plan has one shard, else hub-style numbered shards plus
    model.safetensors.index.json. Only one shard's tensors are in memory at a time."""
    # The first draw before a previous run's weights go: a draw that fails (a seed or a
    # device the generator refuses) left a checkpoint folder without weights.
    weights = itertools.chain([next(weights)], weights)
    for stale in (out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")):
        stale.unlink(missing_ok=True)  # a previous run's files would confuse the loaders
    if len(plan) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for names, file in zip(plan, files, strict=True):
        tensors = dict(itertools.islice(weights, len(names)))
        if list(tensors) != names:
            raise RuntimeError("weights were drawn in another order than the shard plan")
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        (out / file).chmod(0o644)  # safetensors writes it owner-only
        weight_map.update(dict.fromkeys(names, file))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(plan) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
