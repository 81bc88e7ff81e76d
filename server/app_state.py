"""What the API routes share, built once the engine is ready (server/app.py's lifespan):
the settings, the engine client, the prompt processor, the media fetcher, the metrics and
what the engine reported of the model."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelNotFound
from engine.generation_defaults import SamplingDefaults, overridden_fields
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.prompt import PromptProcessor
from engine.multimodal.video import VideoConfig
from server.media_fetch import MediaFetchConfig, MediaFetcher
from server.metrics import ServerMetrics
from server.sampling_params import OPENAI_DEFAULTS
from server.settings import ServerSettings

logger = logging.getLogger(__name__)


@dataclass
class AppState:
    """What the route handlers share; built in the app's lifespan once the engine is READY."""

    settings: ServerSettings
    engine: Any
    processor: PromptProcessor
    fetcher: MediaFetcher | None
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int | None = None  # the KV cache's slots: one request's bound too
    eos_token_ids: tuple[int, ...] = ()  # the engine's: the model's EOS and generation_config's
    sampling_defaults: SamplingDefaults = OPENAI_DEFAULTS  # --generation-config

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist", param="model")


def load_sampling_defaults(settings: ServerSettings, announce: bool = True) -> SamplingDefaults:
    """The sampling defaults `--generation-config` names (GenerationConfigError if bad);
    logs them when they are not OpenAI's and `announce` (one API process of several)."""
    defaults = settings.sampling_defaults()
    if (changed := defaults.changed()) and announce:
        # Each field under the source it came from: the file, or the override (fuzz88).
        overridden = overridden_fields(settings.override_generation_config)
        by_source: dict[str, list[str]] = {}
        for name, value in changed.items():
            by_override = name in overridden
            source = "--override-generation-config" if by_override else "the generation config"
            by_source.setdefault(source, []).append(f"{name}={value}")
        [(first, first_fields), *rest] = by_source.items()
        advice = ("" if settings.override_generation_config
                  else "; --generation-config none keeps OpenAI's")  # fmt: skip
        logger.warning(
            "sampling defaults from %s (for fields a request leaves out): %s%s%s",
            first,
            ", ".join(first_fields),
            "".join(f"; from {source}: {', '.join(items)}" for source, items in rest),
            advice,
        )
    return defaults


def make_fetcher(settings: ServerSettings, metrics: ServerMetrics) -> MediaFetcher | None:
    """The server's media fetcher, for a model with an image processor (None: text only)."""
    model_dir = Path(settings.engine.model)
    if not (model_dir / "preprocessor_config.json").is_file():
        return None
    config = MediaFetchConfig.of(settings)
    video_config = VideoConfig.from_model_dir(
        model_dir,
        fps=settings.video_fps,
        max_frames=settings.max_video_frames,
        max_tokens=settings.max_video_tokens,
    )
    return MediaFetcher(
        config,
        ImageProcessorConfig.from_model_dir(model_dir),
        video_config,
        on_processed=metrics.on_media_preprocessed,
        on_cache_lookup=metrics.on_image_cache_lookup,
        on_cache_resize=metrics.on_image_cache_resize,
    )
