"""Write small random-weight checkpoints in Hugging Face format: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL (and its mixture of experts), and the Qwen2, Qwen3 (and MoE) and Llama decoders.

`tessera make-tiny-model OUT_DIR [--seed N] [--size SIZE] [--device cpu|cuda]` writes a
folder that both Tessera and `transformers` load: config.json (flat hub layout; Qwen3-VL's
nested one), model.safetensors (hub tensor names; sharded with an index past
MAX_SHARD_BYTES), a byte-level BPE tokenizer trained here with the Qwen2-VL special tokens,
the Qwen2-VL chat template and the image processor config (and for Qwen3-VL its video
processor config). No network, no hub.

Sizes (engine/tiny_sizes.py): `tiny` and `tiny2` for tests, `small` (a ~0.5B decoder) for
CPU benchmarks, and `qwen2-vl-2b` / `qwen2-vl-7b`, the real Qwen2-VL shapes (parameter for
parameter) for GPU benchmarks. Qwen2.5-VL: `tiny-qwen2.5-vl` for tests (windows of 2 x 2
merged tokens, so small pictures span several, edge windows included), `small-qwen2.5-vl`
for CPU benchmarks and the real `qwen2.5-vl-3b` / `qwen2.5-vl-7b` shapes. Qwen3-VL:
`tiny-qwen3-vl` for tests (interleaved M-RoPE, deepstack, a learned position table smaller
and larger than test pictures; videos frame by frame after their times), `small-qwen3-vl`,
and the real `qwen3-vl-2b` / `qwen3-vl-4b`; the mixtures of experts `tiny-qwen3-moe` and
`tiny-qwen3-vl-moe`, and `qwen3-vl-moe-8l` (Qwen3-VL-30B-A3B's widths, 8 of its 48 layers). Text-only decoders: `tiny-qwen2` (Qwen2ForCausalLM), `tiny-llama`
(LlamaForCausalLM, with a BOS-adding tokenizer and llama3 rotary scaling) and `tiny-qwen3`
(Qwen3ForCausalLM: q/k head norms, a head dim that is not hidden / heads). Every size keeps
a small trained tokenizer; the big ones only pad the embedding / lm_head rows up to the
real vocabulary size.

The JSON files come from engine/tiny_configs.py, the weights from engine/tiny_weights.py.

Everything is a pure function of (size, seed, device): the same arguments give
byte-identical files. The CPU and CUDA generators draw different numbers from one seed; a
CUDA checkpoint is reproducible on the same GPU model and torch version. The tokenizer
depends on the size only, so checkpoints of one size share token ids.
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources
from pathlib import Path

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

from engine.device_config import usable_device
from engine.tiny_configs import (
    SPECIAL_TOKENS,
    generation_config,
    model_config_dict,
    preprocessor_config,
    tokenizer_config,
    video_preprocessor_config,
)
from engine.tiny_sizes import SIZES, TEXT_ONLY_ARCHITECTURES, TinyModelSpec
from engine.tiny_weights import (
    MAX_SHARD_BYTES,
    iter_random_weights,
    save_shards,
    shard_plan,
    weight_shapes,
)

# Qwen2's pre-tokenizer split; `transformers`' Qwen2Tokenizer rebuilds this exact pipeline,
# so writing it into tokenizer.json keeps both loaders token-for-token identical.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOCAB_ALIGNMENT = 64


def make_tiny_model(
    out_dir: str | Path, *, seed: int = 0, size: str = "tiny", device: str = "cpu"
) -> Path:
    """Write a complete random-weight checkpoint folder of a named size and return
    its path. `device` draws the weights there (e.g. "cuda": fast, other numbers than CPU)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return write_checkpoint(out_dir, SIZES[size], seed=seed, device=device)


def write_checkpoint(
    out_dir: str | Path,
    spec: TinyModelSpec,
    *,
    seed: int = 0,
    device: str = "cpu",
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """`make_tiny_model` for any spec, named or made up (tests build small odd ones)."""
    _check_spec(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(spec.bpe_vocab_size)
    if spec.architecture == "llama":  # Llama's tokenizers put a BOS before raw text
        bos = ("<|endoftext|>", tokenizer.token_to_id("<|endoftext|>"))
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos]),
        ])  # fmt: skip
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    token_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab_size = _vocab_size(spec, num_tokens)
    chat_template = read_chat_template()

    _write_json(out / "config.json", model_config_dict(spec, token_ids, vocab_size))
    _write_json(out / "generation_config.json", generation_config(token_ids))
    tokenizer_json = tokenizer_config(token_ids, chat_template)
    if spec.architecture == "llama":  # tokenizer.json as it is, its BOS included
        tokenizer_json.update(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|endoftext|>")
    _write_json(out / "tokenizer_config.json", tokenizer_json)
    if spec.has_vision:
        _write_json(out / "preprocessor_config.json", preprocessor_config(spec))
        _write_json(out / "chat_template.json", {"chat_template": chat_template})
    if spec.is_qwen3_vl:
        _write_json(out / "video_preprocessor_config.json", video_preprocessor_config(spec))
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    weights = iter_random_weights(spec, vocab_size, seed, num_real_tokens=num_tokens, device=device)
    plan = shard_plan(weight_shapes(spec, vocab_size), spec.dtype, max_shard_bytes)
    save_shards(out, weights, plan)
    return out


def _vocab_size(spec: TinyModelSpec, num_tokens: int) -> int:
    """Embedding rows: the spec's, or the tokenizer's size rounded up to the alignment."""
    if spec.vocab_size is None:
        return _round_up(num_tokens, VOCAB_ALIGNMENT)
    if spec.vocab_size < num_tokens:
        raise ValueError(f"vocab_size {spec.vocab_size} < the tokenizer's {num_tokens} tokens")
    return spec.vocab_size


def _check_spec(spec: TinyModelSpec) -> None:
    split = spec.explicit_head_dim or spec.hidden_size % spec.num_attention_heads == 0
    if not split or spec.head_dim % 2:
        raise ValueError("hidden_size must split into an even head_dim per attention head")
    if 2 * sum(spec.mrope_section) != spec.head_dim:
        raise ValueError("2 * sum(mrope_section) must equal head_dim")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if spec.vision_embed_dim % spec.vision_num_heads:
        raise ValueError("vision_embed_dim must be a multiple of vision_num_heads")
    known = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", *TEXT_ONLY_ARCHITECTURES)
    if spec.architecture not in known:
        raise ValueError(f"unknown architecture {spec.architecture!r}")
    if spec.is_qwen3_vl and (
        int(spec.num_position_embeddings**0.5) ** 2 != spec.num_position_embeddings
        or not spec.num_position_embeddings
        or any(not 0 <= i < spec.vision_depth for i in spec.deepstack_visual_indexes)
        or len(spec.deepstack_visual_indexes) > spec.num_hidden_layers
    ):
        raise ValueError("qwen3_vl needs a square num_position_embeddings and deepstack "
                         "indexes of vision blocks, no more than the decoder layers")  # fmt: skip
    merged_pixels = spec.patch_size * spec.spatial_merge_size
    if spec.is_qwen2_5_vl and (
        spec.vision_intermediate_size <= 0 or spec.window_size % merged_pixels
    ):
        raise ValueError("qwen2_5_vl needs vision_intermediate_size and a window_size that is "
                         "a multiple of patch_size x spatial_merge_size")  # fmt: skip


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


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


def _write_json(path: Path, data: dict) -> None:
    path.write_text(
        json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


# ---------------------------------------------------------------------------- cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera make-tiny-model",
        description="Write a random-weight Qwen2-VL, Qwen2.5-VL, Qwen2, Llama or Qwen3 checkpoint "
        "(weights, tokenizer, processor).",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the random values are drawn: cpu (default) or cuda, much faster for the "
        "qwen2-vl-* sizes; the two give different weights from one seed",
    )
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem is not None:
        parser.error(problem)
    path = make_tiny_model(args.out_dir, seed=args.seed, size=args.size, device=args.device)
    print(f"wrote {args.size} checkpoint (seed {args.seed}, {args.device}) to {path}")
    return 0


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, before anything is written (they raised with a
    traceback, some after an existing checkpoint's weights were gone)."""
    if not -(2**63) <= args.seed < 2**64:
        return f"--seed must be a 64-bit integer, got {args.seed}"
    try:
        usable_device(args.device)
    except ValueError as exc:
        return str(exc)
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        return f"OUT_DIR {args.out_dir} is a file, not a folder"
    try:  # before the tokenizer is trained: /dev/null/x was a traceback after it (fuzz62)
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create OUT_DIR {args.out_dir}: {exc.strerror}"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
