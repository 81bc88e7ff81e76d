"""Sampling defaults from the model's generation_config.json (vLLM's `--generation-config`).

Model authors ship recommended sampling values with a checkpoint (Qwen2-VL-Instruct:
`top_k 1, top_p 0.001, temperature 0.01, repetition_penalty 1.05`; Qwen3: `temperature
0.6, top_p 0.95, top_k 20`). transformers' `generate()` uses them, and so does vLLM by
default: a request that leaves a field out gets the file's value instead of OpenAI's.
Tessera does the same, with vLLM's rules, so that clients see the same answers:

* the fields read are `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
  `max_new_tokens`; `do_sample` is ignored, as vLLM ignores it;
* a value equal to transformers' own default (`GenerationConfig()`: temperature 1.0,
  top_p 1.0, top_k 50, repetition_penalty 1.0) is not a recommendation and is dropped,
  as `GenerationConfig.to_diff_dict()` drops it for vLLM;
* `max_new_tokens` caps every request's `max_tokens` (vLLM: "a server-wide limit");
* `--override-generation-config '{"temperature": 0.5}'` is laid over the file's values;
* `--generation-config none` keeps OpenAI's defaults (temperature 1, no top-k/top-p/min-p,
  no repetition penalty); a folder path reads that folder's generation_config.json.

A request's own values always win. The offline `LLM` applies the same defaults when
`generate()` gets no sampling params (`LLM.default_sampling_params()`, vLLM's
`get_default_sampling_params`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

FILE_NAME = "generation_config.json"

# transformers' GenerationConfig() defaults of the fields read: an equal value is dropped.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


class GenerationConfigError(ValueError):
    """A generation config (file or override) that cannot serve as sampling defaults."""


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets (OpenAI's values by default)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # a cap on every request's max_tokens; None = the context

    @classmethod
    def load(
        cls, source: str, model_dir: str | Path, override: str | None = None
    ) -> SamplingDefaults:
        """`source`: "auto" (the model folder's file), "none" (OpenAI's defaults) or a
        folder holding a generation_config.json. `override`: a JSON object laid over it."""
        values: dict[str, Any] = {}
        if source.strip().lower() not in ("none", "null"):
            path = (Path(model_dir) if source == "auto" else Path(source)) / FILE_NAME
            values = _recommended(_read(path, missing_ok=source == "auto"))
            try:
                cls.from_values(values)
            except GenerationConfigError as exc:
                raise GenerationConfigError(
                    f"{path}: {exc} (--generation-config none leaves the file out)"
                ) from None
        if override:
            values.update(_parse_override(override))
        return cls.from_values(values)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> SamplingDefaults:
        """Checked defaults from generation-config keys (`max_new_tokens`, not max_tokens)."""
        unknown = set(values) - {*_CHECKS}
        if unknown:
            raise GenerationConfigError(
                f"unknown generation config fields {sorted(unknown)}; known: {sorted(_CHECKS)}"
            )
        for name, value in values.items():
            _CHECKS[name](name, value)
        kwargs = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in values.items()}
        if kwargs.get("top_k") == -1:  # vLLM's "off"
            kwargs["top_k"] = 0
        return cls(**kwargs)

    def changed(self) -> dict[str, Any]:
        """The fields that differ from OpenAI's defaults (for the start-up log)."""
        default = SamplingDefaults()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def max_tokens_for(self, requested: int | None, room: int) -> int:
        """A request's max_tokens: what it asked for (else the room left in the context),
        under the cap."""
        max_tokens = room if requested is None else requested
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)


def _read(path: Path, *, missing_ok: bool) -> dict[str, Any]:
    if not path.is_file():
        if missing_ok:
            return {}
        raise GenerationConfigError(f"no {FILE_NAME} at {path.parent}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path} is not a JSON object")
    return config


def _recommended(config: dict[str, Any]) -> dict[str, Any]:
    """The file's sampling fields, less those at transformers' defaults (and nulls)."""
    return {
        name: config[name]
        for name in _CHECKS
        if config.get(name) is not None and config[name] != _HF_DEFAULTS.get(name)
    }


def _parse_override(text: str) -> dict[str, Any]:
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise GenerationConfigError(f"override_generation_config is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise GenerationConfigError("override_generation_config must be a JSON object")
    return values


def overridden_fields(override: str | None) -> set[str]:
    """The fields an override sets, named as `SamplingDefaults.changed()` names them."""
    if not override:
        return set()
    names = _parse_override(override)
    return {"max_tokens" if name == "max_new_tokens" else name for name in names}


def _number(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = "(" if low_open else "["
        raise GenerationConfigError(
            f"{name} must be a number in {bound}{low}, {high}], got {value!r}"
        )


def _integer(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise GenerationConfigError(f"{name} must be an integer >= {low}, got {value!r}")


_CHECKS = {
    "temperature": lambda name, v: _number(name, v, 0.0, 2.0),
    "top_p": lambda name, v: _number(name, v, 0.0, 1.0, low_open=True),
    "top_k": lambda name, v: _integer(name, v, -1),
    "min_p": lambda name, v: _number(name, v, 0.0, 1.0),
    "repetition_penalty": lambda name, v: _number(name, v, 0.0, math.inf, low_open=True),
    "max_new_tokens": lambda name, v: _integer(name, v, 1),
}
