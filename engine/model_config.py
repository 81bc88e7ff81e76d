"""What the engine needs to know about a checkpoint, parsed from its config.json.

Handles both the flat layout of hub Qwen2-VL checkpoints and the nested
`text_config` layout newer `transformers` versions write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("Qwen2VLForConditionalGeneration",)


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # = the decoder's hidden size (patch merger output)

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
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision: VisionConfig
    torch_dtype: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model folder {Path(model_dir).name!r}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"config.json is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else raw.get("model_type", "?")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        text = {**raw, **(raw.get("text_config") or {})}
        vision = raw.get("vision_config") or {}
        try:
            num_heads = text["num_attention_heads"]
            hidden = text["hidden_size"]
            rope_scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
            eos = text.get("eos_token_id", raw.get("eos_token_id"))
            eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
            return cls(
                architecture=architecture,
                vocab_size=text["vocab_size"],
                hidden_size=hidden,
                intermediate_size=text["intermediate_size"],
                num_hidden_layers=text["num_hidden_layers"],
                num_attention_heads=num_heads,
                num_key_value_heads=text.get("num_key_value_heads", num_heads),
                head_dim=text.get("head_dim") or hidden // num_heads,
                rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                rope_theta=text.get("rope_theta", rope_scaling.get("rope_theta", 1e6)),
                mrope_section=tuple(rope_scaling["mrope_section"]),
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
                vision=VisionConfig(
                    depth=vision["depth"],
                    embed_dim=vision["embed_dim"],
                    num_heads=vision["num_heads"],
                    mlp_ratio=vision.get("mlp_ratio", 4),
                    in_channels=vision.get("in_chans", vision.get("in_channels", 3)),
                    patch_size=vision.get("patch_size", 14),
                    temporal_patch_size=vision.get("temporal_patch_size", 2),
                    spatial_merge_size=vision.get("spatial_merge_size", 2),
                    out_hidden_size=vision.get("hidden_size", hidden),
                ),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                extra=raw,
            )
        except (KeyError, TypeError) as exc:
            raise ModelLoadError(f"config.json lacks or mis-types field {exc}") from exc
