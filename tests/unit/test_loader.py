"""The safetensors loader: name mapping (hub and transformers-5 layouts), fusing, sharding,
tied embeddings, and errors that name the offending tensor."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from engine.attention.torch_backend import TorchAttentionBackend
from engine.errors import ModelLoadError
from engine.models.loader import load_model

HUB_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
    "image_token_id": 60,
    "video_token_id": 61,
    "vision_start_token_id": 62,
    "vision_config": {
        "depth": 1,
        "embed_dim": 16,
        "hidden_size": 32,
        "num_heads": 2,
        "mlp_ratio": 2,
        "in_chans": 3,
        "patch_size": 2,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "hidden_act": "quick_gelu",
    },
}


def hub_tensors(tied: bool = False) -> dict[str, torch.Tensor]:
    shapes = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (32, 32),
            p + "self_attn.q_proj.bias": (32,),
            p + "self_attn.k_proj.weight": (16, 32),
            p + "self_attn.k_proj.bias": (16,),
            p + "self_attn.v_proj.weight": (16, 32),
            p + "self_attn.v_proj.bias": (16,),
            p + "self_attn.o_proj.weight": (32, 32),
            p + "mlp.gate_proj.weight": (48, 32),
            p + "mlp.up_proj.weight": (48, 32),
            p + "mlp.down_proj.weight": (32, 48),
            p + "input_layernorm.weight": (32,),
            p + "post_attention_layernorm.weight": (32,),
        }
    b = "visual.blocks.0."
    shapes |= {
        "visual.patch_embed.proj.weight": (16, 3, 2, 2, 2),
        b + "norm1.weight": (16,),
        b + "norm1.bias": (16,),
        b + "norm2.weight": (16,),
        b + "norm2.bias": (16,),
        b + "attn.qkv.weight": (48, 16),
        b + "attn.qkv.bias": (48,),
        b + "attn.proj.weight": (16, 16),
        b + "attn.proj.bias": (16,),
        b + "mlp.fc1.weight": (32, 16),
        b + "mlp.fc1.bias": (32,),
        b + "mlp.fc2.weight": (16, 32),
        b + "mlp.fc2.bias": (16,),
        "visual.merger.ln_q.weight": (16,),
        "visual.merger.ln_q.bias": (16,),
        "visual.merger.mlp.0.weight": (64, 64),
        "visual.merger.mlp.0.bias": (64,),
        "visual.merger.mlp.2.weight": (32, 64),
        "visual.merger.mlp.2.bias": (32,),
    }
    if not tied:
        shapes["lm_head.weight"] = (64, 32)
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def write_checkpoint(path, tensors, config=None, shards=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or HUB_CONFIG))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return str(path)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(path / file))
        weight_map |= {n: file for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(path)


def load(path):
    return load_model(
        path, dtype=torch.float32, device=torch.device("cpu"), attention=TorchAttentionBackend()
    )


def check_values(model, t):
    attn = model.model.layers[1].self_attn
    expected_qkv = torch.cat([t[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    expected_bias = torch.cat([t[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, expected_bias)
    gate_up = torch.cat(
        [t["model.layers.0.mlp.gate_proj.weight"], t["model.layers.0.mlp.up_proj.weight"]]
    )
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(
        model.visual.patch_embed.weight, t["visual.patch_embed.proj.weight"].reshape(16, 24)
    )
    assert torch.equal(model.visual.merger.fc2.weight, t["visual.merger.mlp.2.weight"])
    assert torch.equal(model.model.norm.weight, t["model.norm.weight"])


def test_loads_hub_layout(tmp_path):
    tensors = hub_tensors()
    model = load(write_checkpoint(tmp_path / "m", tensors))
    check_values(model, tensors)
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ tensors["lm_head.weight"].T)
    assert model.config.vision.out_hidden_size == 32 and model.config.mrope_section == (1, 1, 2)


def test_loads_transformers5_layout_sharded(tmp_path):
    tensors = hub_tensors()
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        elif name.startswith("visual."):
            name = "model." + name
        renamed[name] = tensor
    config = {k: v for k, v in HUB_CONFIG.items() if k not in ("vocab_size", "hidden_size")}
    config["text_config"] = {"vocab_size": 64, "hidden_size": 32}
    model = load(write_checkpoint(tmp_path / "m", renamed, config=config, shards=3))
    check_values(model, tensors)


def test_tied_embeddings(tmp_path):
    tensors = hub_tensors(tied=True)
    model = load(
        write_checkpoint(tmp_path / "m", tensors, {**HUB_CONFIG, "tie_word_embeddings": True})
    )
    assert model.lm_head is None
    hidden = torch.randn(2, 32)
    torch.testing.assert_close(
        model.compute_logits(hidden), hidden @ tensors["model.embed_tokens.weight"].T
    )


def test_missing_tensor_is_named(tmp_path):
    tensors = hub_tensors()
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load(write_checkpoint(tmp_path / "m", tensors))


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    tensors = hub_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight.*\[47, 32\].*\[48, 32\]"):
        load(write_checkpoint(tmp_path / "m", tensors))


def test_unexpected_tensor_is_named(tmp_path):
    tensors = hub_tensors()
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    with pytest.raises(ModelLoadError, match=r"unexpected.*self_attn\.extra\.weight"):
        load(write_checkpoint(tmp_path / "m", tensors))


def test_unsupported_architecture(tmp_path):
    config = {**HUB_CONFIG, "architectures": ["LlavaForConditionalGeneration"]}
    with pytest.raises(
        ModelLoadError, match="unsupported architecture 'LlavaForConditionalGeneration'"
    ):
        load(write_checkpoint(tmp_path / "m", hub_tensors(), config))


def test_no_weights(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HUB_CONFIG))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load(str(path))


def load_shard(path, rank, size=2):
    # The loader reads only `shard` of the group; its collectives are not called here
    # (tests/parity/test_tensor_parallel.py runs the real gloo group).
    group = SimpleNamespace(shard=(rank, size), all_reduce=lambda x: x)
    return load_model(
        path,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchAttentionBackend(),
        tensor_parallel=group,
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_rank_reads_its_slice(tmp_path, rank):
    t = hub_tensors()
    model = load_shard(write_checkpoint(tmp_path / "m", t, shards=2), rank)
    layer = model.model.layers[1]

    def rows(name, n):  # rank's n output rows (column-parallel)
        return t[f"model.layers.1.{name}"][rank * n : (rank + 1) * n]

    qkv = [rows(f"self_attn.{x}_proj.weight", n) for x, n in (("q", 16), ("k", 8), ("v", 8))]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(qkv))
    qkv_bias = [rows(f"self_attn.{x}_proj.bias", n) for x, n in (("q", 16), ("k", 8), ("v", 8))]
    assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat(qkv_bias))
    gate_up = torch.cat([rows("mlp.gate_proj.weight", 24), rows("mlp.up_proj.weight", 24)])
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    columns = slice(rank * 16, (rank + 1) * 16)  # rank's input columns (row-parallel)
    assert torch.equal(
        layer.self_attn.o_proj.weight, t["model.layers.1.self_attn.o_proj.weight"][:, columns]
    )
    columns = slice(rank * 24, (rank + 1) * 24)
    assert torch.equal(
        layer.mlp.down_proj.weight, t["model.layers.1.mlp.down_proj.weight"][:, columns]
    )
    assert torch.equal(layer.input_layernorm.weight, t["model.layers.1.input_layernorm.weight"])
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)
    assert model.config.intermediate_size == 24
    if rank == 0:  # the driver keeps what only it runs
        assert model.visual is not None and model.lm_head is not None
        assert torch.equal(model.model.embed_tokens.weight, t["model.embed_tokens.weight"])
    else:
        assert model.visual is None and model.lm_head is None
        assert model.model.embed_tokens is None
        assert model.config.vision is None


def test_tensor_parallel_shape_errors_name_the_whole_tensor(tmp_path):
    tensors = hub_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight.*\[47, 32\].*\[48, 32\]"):
        load_shard(write_checkpoint(tmp_path / "m", tensors), 1)


def test_a_folder_without_a_tokenizer_fails_before_its_weights_load(tmp_path, monkeypatch):
    """The engine loaded the weights and said ready; the server then failed to start with a
    traceback (exit code 3). Now the engine refuses the folder once its config is read."""
    from engine import model_runner
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", seed=0)
    (model_dir / "tokenizer.json").unlink()
    loads = []
    monkeypatch.setattr(model_runner, "load_model", lambda *a, **k: loads.append(1))
    with pytest.raises(ModelLoadError, match="no tokenizer.json in model folder 'm'"):
        EngineCore(EngineConfig(model=str(model_dir)))
    assert loads == []


def test_damaged_weights_name_their_file(tmp_path):
    """The offline LLM got safetensors' own error ("incomplete metadata, file not fully
    covered"), which names no file (fuzz65); `tessera serve`'s pre-flight says the same as
    this, through the same function."""
    folder = Path(write_checkpoint(tmp_path / "m", hub_tensors()))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=rf"{weights.name} is not a valid safetensors"):
        load(folder)
