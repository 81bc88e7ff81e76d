"""What the engine needs to know about a checkpoint, parsed from its config.json.

Qwen2-VL and Qwen2.5-VL, their text decoder alone (Qwen2ForCausalLM: Qwen2 and Qwen2.5
language models, `vision` None), Llama (LlamaForCausalLM, the same decoder without
q/k/v biases, with Llama 3.1's rotary scaling when configured) and Qwen3 (Qwen3ForCausalLM:
no q/k/v biases, an RMSNorm over each query and key head before the rotary embedding, a
head dim of its own). The decoder is one
Qwen2 decoder with M-RoPE; a text-only model gets `mrope_section` (head_dim/2, 0, 0), all
frequencies on the first row, which is plain RoPE since text positions are equal in all
three rows. The vision towers differ (`VisionConfig.variant`), and so do the names in
`vision_config`: Qwen2-VL's `embed_dim` / `hidden_size` (tower width / merger output) are
Qwen2.5-VL's `hidden_size` / `out_hidden_size`.

Qwen3-VL (`qwen3_vl`) is Qwen3's decoder (q/k head norms, no biases) with interleaved
M-RoPE and deepstack, behind its own tower (`VisionConfig`). Qwen3-MoE and Qwen3-VL-MoE
put a mixture of experts in place of the MLP in their sparse layers (`MoEConfig`).

Handles both the flat layout of hub checkpoints and the nested `text_config` layout newer
`transformers` versions write (and Qwen3-VL's hub checkpoints use).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from engine.errors import ModelLoadError

VisionVariant = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# architecture -> the vision tower it carries (None: a text-only model)
SUPPORTED_ARCHITECTURES: dict[str, VisionVariant | None] = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen2ForCausalLM": None,
    "LlamaForCausalLM": None,
    "Qwen3ForCausalLM": None,
    "Qwen3MoeForCausalLM": None,
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
}
# config.json `model_type`s of Qwen3-VL checkpoints (the two "qwen3_vl" architectures above):
# what transformers' processors go by, and so the prompt's and the video sampler's test.
QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Decoders that normalise each query and key head (RMSNorm over head_dim) before the rotary
# embedding: Qwen3's `q_norm` / `k_norm`.
QK_NORM_ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "Qwen3MoeForCausalLM",
    "Qwen3VLMoeForConditionalGeneration",
)


def is_qwen3_vl(raw: dict) -> bool:
    """Whether a checkpoint's config.json is Qwen3-VL's (dense or MoE): its videos are
    sampled and sized as Qwen3-VL's processor does, and go frame by frame after their
    times in the prompt."""
    return raw.get("model_type") in QWEN3_VL_MODEL_TYPES


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rotary scaling (`rope_type: llama3`): low frequencies slowed by `factor`,
    high ones kept, those between interpolated (engine/models/layers.llama3_inv_freq)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Qwen3-MoE, Qwen3-VL-MoE) in the layers `sparse_layers`
    (the others keep the dense MLP): a router picks `top_k` of `num_experts` gated MLPs
    of width `intermediate_size` per token, weighted by their softmax probabilities
    (renormalised over the picked ones with `normalize`). `fused_checkpoint`: the
    checkpoint stores each layer's experts as two 3D tensors ([E, hidden, 2 I] and
    [E, I, hidden], Qwen3-VL-MoE's hub layout) rather than one tensor per expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool
    sparse_layers: tuple[int, ...]
    fused_checkpoint: bool = False


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape.

    `qwen2_vl`: LayerNorm blocks, a 2-layer MLP (`hidden_act`, quick_gelu), every block
    attends within whole frames. `qwen2_5_vl`: RMSNorm blocks, a gated MLP (silu) with
    biases, and window attention: blocks attend within windows of `window_size` pixels
    square except those in `fullatt_block_indexes`; video positions in M-RoPE are spaced
    by `tokens_per_second` x the seconds one temporal patch spans. `qwen3_vl`: LayerNorm
    blocks, a 2-layer MLP (gelu tanh) named `linear_fc1/2`, biased patch embedding, a learned
    `num_position_embeddings` (square) position table resampled to each grid, every block
    attends within whole frames, and "deepstack": the outputs of the blocks in
    `deepstack_visual_indexes` go through mergers of their own and are added to the
    decoder's hidden states at the media rows after its first layers.
    """

    depth: int
    embed_dim: int  # the tower's width
    num_heads: int
    intermediate_size: int  # the blocks' MLP width
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # = the decoder's hidden size (patch merger output)
    variant: VisionVariant = "qwen2_vl"
    hidden_act: str = "quick_gelu"
    window_size: int = 0  # pixels; 0 = no window attention
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float | None = None  # None = temporal positions step by 1
    rope_theta: float = 10000.0  # the blocks' 2D rotary
    num_position_embeddings: int = 0  # qwen3_vl: the learned position table's size
    deepstack_visual_indexes: tuple[int, ...] = ()  # qwen3_vl

    @property
    def patch_dim(self) -> int:
        """Values per patch row of the vision tower's input: C x T_patch x P x P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    image_token_id: int | None
    video_token_id: int | None
    vision_start_token_id: int | None
    vision: VisionConfig | None  # None: a text-only model
    torch_dtype: str | None = None
    attention_bias: bool = True  # q, k, v projections with biases (Qwen2: yes; Llama: no)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    # Qwen3-VL: M-RoPE frequencies go to t, h, w in turn (t h w t h w ...) rather than in
    # three consecutive sections.
    mrope_interleaved: bool = False
    moe: MoEConfig | None = None  # a mixture-of-experts decoder (Qwen3-MoE, Qwen3-VL-MoE)
    llama3_rope_scaling: Llama3RopeScaling | None = None
    # Some layers attend to only this many latest tokens (Qwen2 / Qwen3's
    # use_sliding_window). Tessera's attention sees the whole context, the same within the
    # window: the context length is capped to it (check_max_model_len).
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"the model folder {model_dir} does not exist")
        if not path.is_file():
            raise ModelLoadError(f"no config.json in the model folder {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"config.json is not valid JSON: {exc}") from exc
        try:
            config = cls.from_dict(raw)
        except ModelLoadError:
            raise
        except (TypeError, AttributeError, ValueError, ZeroDivisionError) as exc:
            # a list where an object goes, zero heads: not a config we can read
            raise ModelLoadError(f"config.json is invalid: {type(exc).__name__}: {exc}") from exc
        extra_eos = _generation_eos_ids(Path(model_dir) / "generation_config.json")
        eos = tuple(dict.fromkeys([*config.eos_token_ids, *extra_eos]))
        return dataclasses.replace(config, eos_token_ids=eos)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else raw.get("model_type", "?")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        variant = SUPPORTED_ARCHITECTURES[architecture]
        text = {**raw, **(raw.get("text_config") or {})}
        vision = raw.get("vision_config") or {}
        try:
            num_heads = text["num_attention_heads"]
            hidden = text["hidden_size"]
            head_dim = text.get("head_dim") or hidden // num_heads
            rope_scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            _check_decoder_activation(text)
            eos = text.get("eos_token_id", raw.get("eos_token_id"))
            eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
            config = cls(
                architecture=architecture,
                vocab_size=text["vocab_size"],
                hidden_size=hidden,
                intermediate_size=text["intermediate_size"],
                num_hidden_layers=text["num_hidden_layers"],
                num_attention_heads=num_heads,
                num_key_value_heads=text.get("num_key_value_heads", num_heads),
                head_dim=head_dim,
                rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                rope_theta=text.get("rope_theta", rope_scaling.get("rope_theta", 1e6)),
                mrope_section=_mrope_section(variant, rope_scaling, rope_type, head_dim),
                max_position_embeddings=text.get("max_position_embeddings", 32768),
                tie_word_embeddings=raw.get(
                    "tie_word_embeddings", text.get("tie_word_embeddings", False)
                ),
                eos_token_ids=eos_ids,
                image_token_id=raw.get("image_token_id", text.get("image_token_id")),
                video_token_id=raw.get("video_token_id", text.get("video_token_id")),
                vision_start_token_id=raw.get(
                    "vision_start_token_id", text.get("vision_start_token_id")
                ),
                vision=None if variant is None else _vision_config(variant, vision, hidden),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                attention_bias=_attention_bias(architecture, text),
                qk_norm=architecture in QK_NORM_ARCHITECTURES,
                mrope_interleaved=variant == "qwen3_vl",
                moe=_moe_config(architecture, text),
                llama3_rope_scaling=(
                    _llama3_rope_scaling(rope_scaling) if rope_type == "llama3" else None
                ),
                sliding_window=_sliding_window(text),
                extra=raw,
            )
        except (KeyError, TypeError) as exc:
            raise ModelLoadError(f"config.json lacks or mis-types field {exc}") from exc
        _check_decoder_shape(config, explicit_head_dim=bool(text.get("head_dim")))
        return config

    @property
    def encoder_width(self) -> int:
        """Values per encoder output row (what the encoder cache and pre-encoded features
        hold): the decoder's hidden size, times 1 + the deepstack levels of Qwen3-VL (the
        main rows, then each level's, side by side)."""
        levels = len(self.vision.deepstack_visual_indexes) if self.vision else 0
        return self.hidden_size * (1 + levels)

    def shard(self, size: int) -> ModelConfig:
        """What one of `size` tensor-parallel ranks holds of each decoder layer
        (engine/tensor_parallel.py): its share of the attention heads, the KV heads and
        the MLP width. Everything else (hidden size, vocabulary, vision tower) is whole."""
        if size == 1:
            return self
        if self.moe is not None:
            raise ModelLoadError(
                "tensor parallelism is not supported for mixture-of-experts models yet; use "
                "tensor_parallel_size 1"
            )
        if self.vision is not None and self.vision.deepstack_visual_indexes:
            raise ModelLoadError(
                "tensor parallelism is not supported for Qwen3-VL yet (its deepstack rows "
                "would have to reach every rank); use tensor_parallel_size 1"
            )
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) % size:
                raise ModelLoadError(
                    f"tensor_parallel_size {size} does not divide the model's {name} "
                    f"({getattr(self, name)}); use a size that divides it"
                )
        return dataclasses.replace(
            self,
            num_attention_heads=self.num_attention_heads // size,
            num_key_value_heads=self.num_key_value_heads // size,
            intermediate_size=self.intermediate_size // size,
        )


def _mrope_section(
    variant: VisionVariant | None, rope_scaling: dict, rope_type: str, head_dim: int
) -> tuple[int, int, int]:
    """The vision-language models' own sections; for a text-only model all frequencies on
    the first row (plain RoPE). Rotary scalings Tessera does not implement are refused."""
    if variant is not None:
        if rope_type not in ("default", "mrope"):  # YaRN or linear would be ignored
            raise ModelLoadError(
                f"rope scaling {rope_type!r} is not supported for vision-language models; "
                "only their M-RoPE"
            )
        return tuple(rope_scaling["mrope_section"])
    if rope_type not in ("default", "llama3"):
        raise ModelLoadError(
            f"rope scaling {rope_type!r} is not supported; only the default rope and llama3"
        )
    return (head_dim // 2, 0, 0)


def _check_decoder_shape(config: ModelConfig, *, explicit_head_dim: bool) -> None:
    """Sizes the decoder cannot be built with, named here rather than by a ValueError deep
    in the model's constructor after the engine process has started."""
    heads, kv_heads, head_dim = (
        config.num_attention_heads, config.num_key_value_heads, config.head_dim
    )  # fmt: skip
    if config.max_position_embeddings <= 0:
        problem = f"max_position_embeddings {config.max_position_embeddings} is not positive"
    elif heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        problem = f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
    elif not explicit_head_dim and config.hidden_size % heads:
        problem = f"num_attention_heads {heads} does not divide hidden_size {config.hidden_size}"
    elif head_dim <= 0 or sum(config.mrope_section) != head_dim // 2:
        problem = (
            f"mrope_section {config.mrope_section} does not sum to head_dim // 2 ({head_dim // 2})"
        )
    else:
        return
    raise ModelLoadError(f"config.json is invalid: {problem}")


def _check_decoder_activation(text: dict) -> None:
    """Every supported decoder's MLP is SiLU-gated; another `hidden_act` would be ignored."""
    activation = text.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelLoadError(
            f"hidden_act {activation!r} is not supported for the decoder; only 'silu'"
        )


def _sliding_window(text: dict) -> int | None:
    """The window of the layers that slide, as transformers' Qwen2 / Qwen3 configs decide
    them (`use_sliding_window`, then `layer_types`, else the layers from
    `max_window_layers` on); None when every layer sees the whole context."""
    window = text.get("sliding_window")
    if not text.get("use_sliding_window") or window is None:
        return None
    layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:
        slides = text.get("max_window_layers", layers) < layers
    return int(window) if slides else None


def _vision_config(variant: VisionVariant, vision: dict, decoder_hidden: int) -> VisionConfig:
    """`vision_config` of a Qwen2-VL or Qwen2.5-VL config.json (transformers' defaults)."""
    common = {
        "depth": vision["depth"],
        "num_heads": vision["num_heads"],
        "in_channels": vision.get("in_chans", vision.get("in_channels", 3)),
        "patch_size": vision.get("patch_size", 14),
        "temporal_patch_size": vision.get("temporal_patch_size", 2),
        "spatial_merge_size": vision.get("spatial_merge_size", 2),
        "variant": variant,
    }
    if variant == "qwen3_vl":
        rope = vision.get("rope_parameters") or {}
        return VisionConfig(
            **{**common, "patch_size": vision.get("patch_size", 16)},
            embed_dim=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            out_hidden_size=vision.get("out_hidden_size", decoder_hidden),
            hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            num_position_embeddings=vision.get("num_position_embeddings", 2304),
            deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))),
        )
    if variant == "qwen2_vl":
        embed_dim = vision["embed_dim"]
        return VisionConfig(
            **common,
            embed_dim=embed_dim,
            intermediate_size=int(embed_dim * vision.get("mlp_ratio", 4)),
            out_hidden_size=vision.get("hidden_size", decoder_hidden),
            hidden_act=vision.get("hidden_act", "quick_gelu"),
        )
    return VisionConfig(
        **common,
        embed_dim=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        out_hidden_size=vision.get("out_hidden_size", decoder_hidden),
        hidden_act=vision.get("hidden_act", "silu"),
        window_size=vision.get("window_size", 112),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        tokens_per_second=float(vision.get("tokens_per_second", 4)),
    )


def _moe_config(architecture: str, text: dict) -> MoEConfig | None:
    """The experts of a Qwen3-MoE or Qwen3-VL-MoE decoder (transformers' defaults), or None."""
    if "Moe" not in architecture:
        return None
    num_experts = text.get("num_experts", text.get("num_local_experts", 0))
    step = text.get("decoder_sparse_step", 1) or 1
    dense = set(text.get("mlp_only_layers") or ())
    sparse = tuple(
        i for i in range(text["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
    )
    is_vl = architecture == "Qwen3VLMoeForConditionalGeneration"
    return MoEConfig(
        num_experts=num_experts,
        top_k=text["num_experts_per_tok"],
        intermediate_size=text["moe_intermediate_size"],
        normalize=True if is_vl else bool(text.get("norm_topk_prob", False)),
        sparse_layers=sparse if num_experts > 0 else (),
        fused_checkpoint=is_vl,
    )


def _llama3_rope_scaling(rope_scaling: dict) -> Llama3RopeScaling:
    return Llama3RopeScaling(
        factor=float(rope_scaling["factor"]),
        low_freq_factor=float(rope_scaling["low_freq_factor"]),
        high_freq_factor=float(rope_scaling["high_freq_factor"]),
        original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"]),
    )


def _attention_bias(architecture: str, text: dict) -> bool:
    """Qwen2's q, k, v projections carry biases; Llama's and Qwen3's none unless
    `attention_bias`, which also biases o_proj (not implemented, refused), as is
    `mlp_bias`."""
    if architecture not in ("LlamaForCausalLM", *QK_NORM_ARCHITECTURES):
        return True
    if text.get("attention_bias") or text.get("mlp_bias"):
        raise ModelLoadError(
            f"{architecture} checkpoints with attention_bias or mlp_bias are not supported"
        )
    return False


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id`s, which transformers' generate() stops on
    (Qwen2-VL-Instruct lists <|im_end|> and <|endoftext|>, where config.json names only the
    first); () without the file, or where it is unreadable (the sampling defaults' reader,
    engine/generation_defaults.py, says so)."""
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def check_max_model_len(max_model_len: int | None, model_config: ModelConfig) -> int:
    """The context length to serve: `max_model_len`, or the model's trained positions
    (`max_position_embeddings`), or its sliding window if shorter. A longer one is refused,
    as vLLM refuses it: positions past the trained ones give wrong answers, and so would
    attention past the window, since Tessera's layers all see the whole context."""
    trained = model_config.max_position_embeddings
    window = model_config.sliding_window
    if max_model_len is None:
        return trained if window is None else min(trained, window)
    if max_model_len > trained:
        raise ModelLoadError(
            f"max_model_len {max_model_len} is longer than the model's "
            f"max_position_embeddings ({trained}), the positions it was trained on"
        )
    if window is not None and max_model_len > window:
        raise ModelLoadError(
            f"max_model_len {max_model_len} is longer than the model's sliding window "
            f"({window} tokens, use_sliding_window); Tessera attends to the whole context, "
            "so it serves such a model up to its window"
        )
    return max_model_len
