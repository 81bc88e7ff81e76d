"""Builds a model from a Hugging Face checkpoint folder (config.json + *.safetensors).

Tensors are read memory-mapped with `safetensors.safe_open` (never pickle) and
copied straight into the model's parameters, which are allocated once on the
target device without random initialisation.

Checkpoint names are first normalised to the hub layout:
    model.language_model.X -> model.X        (transformers >= 4.52 / 5 layout)
    model.visual.X         -> visual.X
then each expected hub name maps to (our parameter, row range, how to reshape):
    model.layers.N.self_attn.{q,k,v}_proj.*  -> rows of model.layers.N.self_attn.qkv_proj.*
    model.layers.N.mlp.{gate,up}_proj.weight -> rows of model.layers.N.mlp.gate_up_proj.weight
    visual.blocks.N.mlp.{gate,up}_proj.*     -> rows of visual.blocks.N.mlp.gate_up_proj.*
                                                (Qwen2.5-VL)
    visual.patch_embed.proj.weight [E,C,T,P,P] -> visual.patch_embed.weight [E, C*T*P*P]
    visual.patch_embed.proj.bias             -> visual.patch_embed.bias (Qwen3-VL)
    visual.merger.mlp.{0,2}.*                -> visual.merger.{fc1,fc2}.*
    model.layers.N.mlp.experts.E.{gate,up}_proj.weight
                                             -> expert E's rows of ...mlp.experts.gate_up_proj
    model.layers.N.mlp.experts.E.down_proj.weight -> expert E of ...mlp.experts.down_proj
    model.layers.N.mlp.experts.{gate_up,down}_proj [E, in, out] (Qwen3-VL-MoE, fused)
                                             -> the same parameter, transposed to [E, out, in]
Everything else keeps its name. Missing, mis-shaped or unexpected tensors raise
`ModelLoadError` naming the tensor.

With tensor parallelism (engine/tensor_parallel.py) each rank reads only its slice of the
split decoder tensors (`split_dim`), straight from the memory-mapped file; ranks other
than 0 skip what only rank 0 runs (the vision tower, the embedding, the LM head).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.attention.base import AttentionBackend
from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.models.qwen2_vl import Qwen2VLForConditionalGeneration
from engine.tensor_parallel import DRIVER_ONLY_PREFIXES, ShardGroup, split_dim

# Buffers some exporters save; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: rows [start, start + shape[0]) of `param_name`."""

    param_name: str
    start: int
    shape: tuple[int, ...]  # the checkpoint tensor's expected shape
    expert: int | None = None  # an expert's slice of a [E, ...] experts parameter
    transpose: bool = False  # the checkpoint holds [E, in, out]: the parameter is [E, out, in]


def open_checkpoint(file: Path):
    """`safe_open` of one weights file (on CPU), a ModelLoadError naming the file when it is
    empty, cut short or not safetensors at all (it reads the header, and checks that the
    file holds every byte the header's offsets name)."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(
            f"{file.name} is not a valid safetensors file ({exc}); the checkpoint is damaged "
            "or incompletely downloaded"
        ) from None


def load_model(
    model_dir: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionBackend,
    tensor_parallel: ShardGroup | None = None,
) -> Qwen2VLForConditionalGeneration:
    """Loads a Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2, Qwen3 or Llama checkpoint folder; raises
    `ModelLoadError` on any mismatch. With `tensor_parallel`, this rank's shard."""
    config = ModelConfig.from_model_dir(model_dir)
    rank, size = (0, 1) if tensor_parallel is None else tensor_parallel.shard
    skipped: tuple[str, ...] = ()
    if size > 1:
        config = config.shard(size)
    if rank > 0:
        config = dataclasses.replace(config, vision=None)
        skipped = DRIVER_ONLY_PREFIXES
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config, attention, tensor_parallel)
    if rank > 0:  # the decoder layers alone: rank 0 embeds and computes the logits
        model.model.embed_tokens = None
        model.lm_head = None
    model = model.to(dtype=dtype).to_empty(device=device)
    model.init_buffers()  # buffers were lost on meta; rebuild them (float32) on `device`
    params = dict(model.named_parameters())
    targets = expected_tensors(config, params)
    seen: set[str] = set()
    with torch.no_grad():
        for file in checkpoint_files(Path(model_dir)):
            with open_checkpoint(file) as reader:
                for raw_name in reader.keys():
                    name = normalize_name(raw_name)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: logits use the embedding matrix
                    if name.startswith(skipped):
                        continue
                    target = targets.get(name)
                    if target is None:
                        raise ModelLoadError(f"unexpected tensor {raw_name!r} in checkpoint")
                    tensor_slice = reader.get_slice(raw_name)
                    shape = tuple(tensor_slice.get_shape())
                    dim = split_dim(name) if size > 1 else None
                    expected = list(target.shape)
                    if dim is not None:  # the checkpoint holds every rank's share
                        expected[dim] *= size
                    if list(shape) != expected:
                        raise ModelLoadError(
                            f"tensor {raw_name!r} has shape {list(shape)}, expected {expected}"
                        )
                    tensor = (
                        tensor_slice[:] if dim is None
                        else _rank_slice(tensor_slice, dim, target.shape[dim], rank)
                    )  # fmt: skip
                    _copy_into(params[target.param_name], target, tensor)
                    seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"checkpoint lacks tensor {missing[0]!r}{more}, shape {list(targets[missing[0]].shape)}"
        )
    return model.eval()


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a folder: those the index names, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError("model.safetensors.index.json is malformed") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"checkpoint shard {file.name!r} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError("no *.safetensors files in the model folder")
    return files


def normalize_name(name: str) -> str:
    """Maps the transformers >= 4.52 save layout onto the hub layout."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("language_model.model."):  # older nested export layout
        return "model." + name[len("language_model.model.") :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name


def expected_tensors(
    config: ModelConfig, params: dict[str, torch.nn.Parameter]
) -> dict[str, _Target]:
    """Every hub-layout tensor name the checkpoint must hold, and where it goes."""
    targets: dict[str, _Target] = {}
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    fused = {
        "self_attn.qkv_proj": [
            ("self_attn.q_proj", q_size),
            ("self_attn.k_proj", kv_size),
            ("self_attn.v_proj", kv_size),
        ],
        "mlp.gate_up_proj": [
            ("mlp.gate_proj", config.intermediate_size),
            ("mlp.up_proj", config.intermediate_size),
        ],
    }
    vision = config.vision
    vision_width = 0 if vision is None else vision.intermediate_size
    vision_fused = {  # Qwen2.5-VL's gated vision MLP
        "mlp.gate_up_proj": [("mlp.gate_proj", vision_width), ("mlp.up_proj", vision_width)]
    }
    for param_name, param in params.items():
        shape = tuple(param.shape)
        if param_name == "visual.patch_embed.weight" and vision is not None:
            hf_shape = (
                vision.embed_dim,
                vision.in_channels,
                vision.temporal_patch_size,
                vision.patch_size,
                vision.patch_size,
            )
            targets["visual.patch_embed.proj.weight"] = _Target(param_name, 0, hf_shape)
            continue
        if param_name == "visual.patch_embed.bias":
            targets["visual.patch_embed.proj.bias"] = _Target(param_name, 0, shape)
            continue
        if param_name.startswith("visual.merger.fc"):
            hf_name = param_name.replace("merger.fc1.", "merger.mlp.0.")
            targets[hf_name.replace("merger.fc2.", "merger.mlp.2.")] = _Target(param_name, 0, shape)
            continue
        if param_name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            targets.update(_expert_targets(config, param_name, shape))
            continue
        parts = vision_fused if param_name.startswith("visual.") else fused
        fused_key = next((key for key in parts if f".{key}." in param_name), None)
        if fused_key is None:
            targets[param_name] = _Target(param_name, 0, shape)
            continue
        start = 0
        for hf_part, rows in parts[fused_key]:
            hf_name = param_name.replace(fused_key, hf_part)
            targets[hf_name] = _Target(param_name, start, (rows, *shape[1:]))
            start += rows
    return targets


def _expert_targets(
    config: ModelConfig, param_name: str, shape: tuple[int, ...]
) -> dict[str, _Target]:
    """Where a layer's expert tensors go: the fused [E, in, out] tensor transposed, or one
    tensor per expert (gate and up stacked in gate_up_proj)."""
    if config.moe is not None and config.moe.fused_checkpoint:
        num_experts, rows, columns = shape
        return {param_name: _Target(param_name, 0, (num_experts, columns, rows), transpose=True)}
    prefix = param_name.rsplit(".", 1)[0]  # model.layers.N.mlp.experts
    targets = {}
    for expert in range(shape[0]):
        if param_name.endswith("gate_up_proj"):
            width = shape[1] // 2
            for start, part in ((0, "gate_proj"), (width, "up_proj")):
                name = f"{prefix}.{expert}.{part}.weight"
                targets[name] = _Target(param_name, start, (width, shape[2]), expert)
        else:
            name = f"{prefix}.{expert}.down_proj.weight"
            targets[name] = _Target(param_name, 0, shape[1:], expert)
    return targets


def _copy_into(param: torch.nn.Parameter, target: _Target, tensor: torch.Tensor) -> None:
    rows = target.shape[0]
    data = param.data if target.expert is None else param.data[target.expert]
    if target.transpose:
        tensor = tensor.transpose(1, 2)
    destination = data[target.start : target.start + rows]
    destination.copy_(tensor.reshape(destination.shape))


def _rank_slice(tensor_slice, dim: int, length: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s `length` rows (dim 0) or columns (dim 1) of a checkpoint tensor, read
    without loading the rest."""
    start = rank * length
    if dim == 0:
        return tensor_slice[start : start + length]
    return tensor_slice[:, start : start + length]
