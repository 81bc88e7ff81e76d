"""Tessera's engine. `from engine import LLM, SamplingParams` for offline generation
(`StructuredOutput` for constrained decoding).

Exports resolve lazily so that importing a light engine module (`engine.protocol`, the
wire contract; `engine.errors`; `engine.config`) loads neither torch nor the model code:
the API processes import those and never need either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM, GenerationResult
    from engine.llm_params import SamplingParams
    from engine.protocol import StructuredOutput

__all__ = ["LLM", "EngineConfig", "GenerationResult", "SamplingParams", "StructuredOutput"]

_EXPORTS = {
    "LLM": "engine.llm",
    "GenerationResult": "engine.llm",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.llm_params",  # the engine's, with n and stop strings
    "StructuredOutput": "engine.protocol",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
