"""engine.tiny_model: deterministic random-weight Qwen2-VL checkpoints (no transformers here)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import safe_open
from tokenizers import Tokenizer

from engine.model_config import ModelConfig
from engine.tiny_model import (
    SIZES,
    SPECIAL_TOKENS,
    main,
    make_tiny_model,
    model_config_dict,
    read_chat_template,
    weight_shapes,
    write_checkpoint,
)
from engine.tiny_weights import INDEX_FILE, random_weights

REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


def _read(path: Path, name: str) -> bytes:
    return (path / name).read_bytes()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_same_seed_gives_byte_identical_files(tiny, tmp_path):
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert sorted(p.name for p in again.iterdir()) == sorted(FILES)
    for name in FILES:
        assert _read(tiny, name) == _read(again, name), name


def test_cli_in_a_fresh_process_gives_identical_files(tiny, tmp_path):
    """A new process has new hash seeds and thread pools: tokenizer training and weight
    generation must still give the same bytes."""
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "engine.tiny_model", str(out), "--seed", "0"],
        check=True,
        env=env,
        capture_output=True,
    )
    for name in FILES:
        assert _read(tiny, name) == _read(out, name), name


def test_different_seed_gives_different_weights_same_tokenizer(tiny, tmp_path):
    other = make_tiny_model(tmp_path / "seed1", seed=1)
    for name in ("tokenizer.json", "config.json", "preprocessor_config.json"):
        assert _read(tiny, name) == _read(other, name), name
    a, b = _tensors(tiny), _tensors(other)
    assert a.keys() == b.keys()
    for name in a:
        if a[name].abs().sum() > 0:
            assert not torch.equal(a[name], b[name]), name


def test_tensor_names_shapes_and_dtype(tiny):
    config = json.loads(_read(tiny, "config.json"))
    tensors = _tensors(tiny)
    expected = dict(weight_shapes(SIZES["tiny"], config["vocab_size"]))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert {v.dtype for v in tensors.values()} == {torch.float32}
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "lm_head.weight",
        "visual.patch_embed.proj.weight",
        "visual.merger.mlp.0.weight",
        "visual.blocks.1.attn.qkv.weight",
        "model.layers.3.mlp.down_proj.weight",
    ):
        assert name in tensors


def test_special_token_ids_match_config(tiny):
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    config = json.loads(_read(tiny, "config.json"))
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    assert ids == list(range(num_tokens - len(SPECIAL_TOKENS), num_tokens))  # after BPE vocab
    assert 1000 <= num_tokens - len(SPECIAL_TOKENS) <= 2048
    assert num_tokens <= config["vocab_size"] and config["vocab_size"] % 64 == 0
    by_name = dict(zip(SPECIAL_TOKENS, ids, strict=True))
    assert config["eos_token_id"] == by_name["<|im_end|>"]
    assert config["bos_token_id"] == by_name["<|endoftext|>"]
    assert config["image_token_id"] == by_name["<|image_pad|>"]
    assert config["video_token_id"] == by_name["<|video_pad|>"]
    assert config["vision_start_token_id"] == by_name["<|vision_start|>"]
    assert config["vision_end_token_id"] == by_name["<|vision_end|>"]
    generation = json.loads(_read(tiny, "generation_config.json"))
    assert by_name["<|im_end|>"] in generation["eos_token_id"]
    tokenizer_config = json.loads(_read(tiny, "tokenizer_config.json"))
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["pad_token"] == "<|endoftext|>"
    assert tokenizer_config["chat_template"] == read_chat_template()


def test_padded_vocab_rows_are_zero(tiny):
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    tensors = _tensors(tiny)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.all(tensors[name][num_tokens:] == 0)
        assert torch.all(tensors[name][:num_tokens].abs().sum(dim=1) > 0)


def test_model_config_parses_and_matches_spec(tiny):
    config = ModelConfig.from_model_dir(tiny)
    spec = SIZES["tiny"]
    assert config.hidden_size == spec.hidden_size
    assert config.head_dim == spec.head_dim == 2 * sum(config.mrope_section)
    assert config.num_key_value_heads == spec.num_key_value_heads
    assert config.vision.embed_dim == spec.vision_embed_dim
    assert config.vision.out_hidden_size == spec.hidden_size
    assert config.tie_word_embeddings is False


def test_tokenizer_round_trips_text_and_keeps_specials_whole(tiny):
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = "Describe the picture: a dog, 42 cats; héllo 世界 🙂\n\tdone."
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>"
    encoded = tokenizer.encode(prompt).ids
    for token in ("<|im_start|>", "<|vision_start|>", "<|image_pad|>", "<|im_end|>"):
        assert encoded.count(tokenizer.token_to_id(token)) == 1


def _render(messages, add_generation_prompt=False) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(read_chat_template()).render(
        messages=messages, add_generation_prompt=add_generation_prompt
    )


def test_chat_template_default_system_and_generation_prompt():
    text = _render([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_media_parts_and_given_system():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                {"type": "text", "text": "Compare "},
                {"type": "image"},
                {"type": "text", "text": " and "},
                {"type": "video", "video": "v.mp4"},
            ],
        },
        {"role": "assistant", "content": "Same."},
    ]
    assert _render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Compare "
        "<|vision_start|><|image_pad|><|vision_end|> and "
        "<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\nSame.<|im_end|>\n"
    )


def test_tiny2_has_a_different_shape(tmp_path):
    path = make_tiny_model(tmp_path / "tiny2", size="tiny2")
    tiny2, tiny = ModelConfig.from_model_dir(path), SIZES["tiny"]
    assert (tiny2.hidden_size, tiny2.head_dim, tiny2.num_hidden_layers) != (
        tiny.hidden_size,
        tiny.head_dim,
        tiny.num_hidden_layers,
    )
    assert tiny2.head_dim == 2 * sum(tiny2.mrope_section)


def test_main_cli_and_unknown_size(tmp_path, capsys):
    assert main([str(tmp_path / "m"), "--seed", "3", "--size", "tiny2", "--device", "cpu"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="unknown size"):
        make_tiny_model(tmp_path / "x", size="huge")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "y"), "--size", "huge"])


def _num_params(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


def _decoder_params(h: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int) -> int:
    """Qwen2 decoder parameters, counted from the architecture (not from weight_shapes)."""
    kv = kv_heads * (h // heads)
    attention = (h * h + h) + 2 * (kv * h + kv) + h * h  # q, k, v with bias; o without
    layer = 2 * h + attention + 3 * h * mlp  # two RMSNorms, SwiGLU MLP
    return vocab * h + layers * layer + h  # embedding, layers, final norm (lm_head apart)


def _vision_params(embed: int, depth: int, out_hidden: int) -> int:
    """Qwen2-VL ViT parameters: Conv3d patch embed (no bias), blocks, 2x2 patch merger."""
    block = 2 * 2 * embed + (3 * embed * embed + 3 * embed) + (embed * embed + embed)
    block += 2 * (4 * embed * embed) + 4 * embed + embed  # fc1, fc2 (mlp ratio 4)
    merged = 4 * embed
    merger = 2 * embed + (merged * merged + merged) + (out_hidden * merged + out_hidden)
    return embed * 3 * 2 * 14 * 14 + depth * block + merger


@pytest.mark.parametrize(
    "size,decoder,lm_head,total",
    [
        # The hub's Qwen2-VL-2B-Instruct / 7B-Instruct safetensors hold exactly these totals.
        ("qwen2-vl-2b", _decoder_params(1536, 28, 12, 2, 8960, 151936), 0, 2_208_985_600),
        (
            "qwen2-vl-7b",
            _decoder_params(3584, 28, 28, 4, 18944, 152064),
            152064 * 3584,
            8_291_375_616,
        ),
    ],
)
def test_benchmark_sizes_have_the_real_parameter_counts(size, decoder, lm_head, total):
    spec = SIZES[size]
    vision = _vision_params(1280, 32, spec.hidden_size)
    assert decoder + lm_head + vision == total  # the architecture's count matches the hub's
    shapes = weight_shapes(spec, spec.vocab_size)
    assert _num_params(shapes) == total
    assert _num_params([s for s in shapes if s[0].startswith("visual.")]) == vision
    assert spec.head_dim == 128 == 2 * sum(spec.mrope_section)
    assert spec.dtype == torch.bfloat16
    assert ("lm_head.weight" in dict(shapes)) is (lm_head > 0)
    assert dict(shapes)["model.embed_tokens.weight"] == (spec.vocab_size, spec.hidden_size)
    assert 8192 <= spec.bpe_vocab_size < spec.vocab_size  # small tokenizer, real row count


def test_the_mixture_of_experts_benchmark_size_has_qwen3_vl_30b_a3b_widths():
    """qwen3-vl-moe-8l: Qwen3-VL-30B-A3B's layers, 8 of 48. Counted from the architecture,
    its decoder layer and, with all 48 layers, the whole model (the hub's 31.1B)."""
    spec = SIZES["qwen3-vl-moe-8l"]
    shapes = dict(weight_shapes(spec, spec.vocab_size))
    prefix = "model.language_model.layers.7."
    assert shapes[prefix + "mlp.experts.gate_up_proj"] == (128, 2048, 2 * 768)
    assert shapes[prefix + "mlp.experts.down_proj"] == (128, 768, 2048)
    assert shapes[prefix + "mlp.gate.weight"] == (128, 2048)
    assert not any(name.startswith("model.language_model.layers.8.") for name in shapes)
    h, head, heads, kv_heads = 2048, 128, 32, 4
    attention = 2 * h * heads * head + 2 * h * kv_heads * head + 2 * head  # q, o; k, v; norms
    layer = 2 * h + attention + 128 * h + 128 * 3 * h * 768  # norms, attention, router, experts
    layers = [s for name, s in shapes.items() if name.startswith(prefix)]
    assert _num_params([("", s) for s in layers]) == layer
    whole = dataclasses.replace(spec, num_hidden_layers=48)
    assert _num_params(weight_shapes(whole, spec.vocab_size)) == 31_070_754_032
    assert ("lm_head.weight", (151936, 2048)) in weight_shapes(spec, spec.vocab_size)


def test_tie_word_embeddings_drops_lm_head_and_sets_the_config():
    untied = SIZES["tiny"]
    tied = dataclasses.replace(untied, tie_word_embeddings=True)
    untied_shapes, tied_shapes = dict(weight_shapes(untied, 1600)), dict(weight_shapes(tied, 1600))
    assert untied_shapes.pop("lm_head.weight") == (1600, untied.hidden_size)
    assert tied_shapes == untied_shapes
    weights = random_weights(tied, 1600, seed=0, num_real_tokens=1544)
    assert "lm_head.weight" not in weights and weights.keys() == tied_shapes.keys()
    token_ids = dict.fromkeys(SPECIAL_TOKENS, 1)
    assert model_config_dict(tied, token_ids, 1600)["tie_word_embeddings"] is True
    assert model_config_dict(untied, token_ids, 1600)["tie_word_embeddings"] is False
    assert model_config_dict(SIZES["qwen2-vl-2b"], token_ids, 151936)["tie_word_embeddings"]
    assert not model_config_dict(SIZES["qwen2-vl-7b"], token_ids, 152064)["tie_word_embeddings"]


def test_forced_vocab_size_pads_with_zero_rows(tmp_path):
    spec = dataclasses.replace(SIZES["tiny2"], vocab_size=1100, tie_word_embeddings=True)
    path = write_checkpoint(tmp_path / "tied", spec, seed=3)
    tensors = _tensors(path)
    num_tokens = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(True)
    assert num_tokens < 1100
    assert "lm_head.weight" not in tensors
    embed = tensors["model.embed_tokens.weight"]
    assert embed.shape == (1100, spec.hidden_size)
    assert torch.all(embed[num_tokens:] == 0) and torch.all(embed[:num_tokens].abs().sum(1) > 0)
    config = ModelConfig.from_model_dir(path)
    assert config.vocab_size == 1100 and config.tie_word_embeddings is True
    with pytest.raises(ValueError, match="vocab_size"):
        write_checkpoint(tmp_path / "bad", dataclasses.replace(spec, vocab_size=num_tokens - 1))


def test_sharded_checkpoint_holds_the_same_tensors(tiny, tmp_path):
    path = write_checkpoint(tmp_path / "sharded", SIZES["tiny"], seed=0, max_shard_bytes=10**6)
    index = json.loads((path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 5 and not (path / "model.safetensors").exists()
    assert sorted(p.name for p in path.glob("*.safetensors")) == files
    sharded = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            sharded.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    whole = _tensors(tiny)
    assert sharded.keys() == whole.keys() == index["weight_map"].keys()
    assert all(torch.equal(sharded[name], whole[name]) for name in whole)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in whole.values())
    # Written again as one file into the same folder: the old shards and index are gone.
    write_checkpoint(path, SIZES["tiny"], seed=0)
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    assert _read(path, "model.safetensors") == _read(tiny, "model.safetensors")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draw_is_deterministic_and_differs_from_cpu():
    spec = SIZES["tiny"]
    first = random_weights(spec, 1600, seed=0, num_real_tokens=1544, device="cuda")
    again = random_weights(spec, 1600, seed=0, num_real_tokens=1544, device="cuda")
    cpu = random_weights(spec, 1600, seed=0, num_real_tokens=1544)
    assert all(t.device.type == "cpu" and t.dtype == spec.dtype for t in first.values())
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], cpu["model.embed_tokens.weight"])
    assert torch.all(first["lm_head.weight"][1544:] == 0)


@pytest.mark.parametrize(
    "args, says",
    [(["--seed", str(2**64)], "--seed"), (["--device", "garbage"], "--device"),
     (["--device", "tpu"], "--device")]
    + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA")]),
)  # fmt: skip
def test_bad_arguments_are_one_line_and_leave_an_existing_checkpoint_whole(
    tmp_path, capsys, args, says
):
    """A bad seed or device over an existing checkpoint raised with a traceback after its
    weights were deleted (fuzz34)."""
    out = tmp_path / "m"
    assert main([str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(out), *args])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(SystemExit):
        main([str(file)])


def test_a_draw_that_fails_leaves_the_previous_weights(tmp_path):
    """The stale weights go only once the first tensor is drawn."""
    from engine.tiny_weights import save_shards

    (tmp_path / "model.safetensors").write_bytes(b"previous")

    def failing():
        raise RuntimeError("the generator refused the seed")
        yield  # a generator

    with pytest.raises(RuntimeError, match="refused"):
        save_shards(tmp_path, failing(), [["w"]])
    assert (tmp_path / "model.safetensors").read_bytes() == b"previous"
