"""`mm_processor_kwargs`: the per-request media preprocessing options a chat or tokenize
request may carry (server/openai_models.py)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from server.chat_messages import StrictInt

# JSON numbers only: pydantic's lax types read `true` as 1 and "5_000" as 5000 (fuzz69),
# which transformers' processors refuse.
StrictNumber = Annotated[float, Strict()]


class MediaProcessingOptions(BaseModel):
    """`mm_processor_kwargs`: one request's preprocessing of its `image_url` and `video_url`
    parts, in the names of transformers' Qwen2-VL processors (what vLLM hands to them).
    A request may ask for fewer pixels or frames than the server's bounds, never more
    (checked against the model's and the server's settings in
    engine/multimodal/processing.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # = engine/multimodal/processing.py's SUPPORTED_KWARGS (not imported: that loads torch)
    SUPPORTED: ClassVar[tuple[str, ...]] = ("fps", "max_frames", "min_pixels", "max_pixels")

    fps: StrictNumber | None = Field(default=None, gt=0.0)  # video frames sampled per second
    max_frames: StrictInt | None = Field(default=None, ge=1)  # sampled frames per video
    min_pixels: StrictInt | None = Field(default=None, ge=1)  # resized image / frame area bounds
    max_pixels: StrictInt | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in cls.SUPPORTED)
            if unknown:
                raise ValueError(
                    f"unsupported key(s) {', '.join(unknown)[:200]}; supported: "
                    + ", ".join(cls.SUPPORTED)
                )
        return data

    @model_validator(mode="after")
    def _ordered_bounds(self) -> MediaProcessingOptions:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels})"
            )
        return self
