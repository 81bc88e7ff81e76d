"""The offline `LLM`'s `SamplingParams` (`from engine import SamplingParams`): the engine's
(engine/protocol.py) and the fields around them that turn tokens into answers, which the
server reads from the OpenAI request and the engine never sees. vLLM's `SamplingParams`
holds them all, and so does this one:

* `n`: how many choices each prompt gets (`GenerationResult.outputs`), fanned out as the
  server does (engine/choices.py `fan_out`: choice `i` of a seeded request samples with
  `seed + i`);
* `stop`: strings that end a choice, cut from its text; `include_stop_str_in_output`
  keeps the one found; `skip_special_tokens`: special tokens' text is left out.

The engine's `SamplingParams` is still taken, as n 1 without stop strings. Light: neither
torch nor the model code is imported (engine/__init__.py).
"""

from __future__ import annotations

from engine import protocol
from engine.errors import InvalidRequest

ENGINE_FIELDS = protocol.SamplingParams.__struct_fields__


class SamplingParams(protocol.SamplingParams, frozen=True, kw_only=True, omit_defaults=True):
    """The engine's sampling fields (engine.protocol.SamplingParams) and vLLM's `n`,
    `stop`, `include_stop_str_in_output` and `skip_special_tokens`, as on the HTTP API."""

    max_tokens: int | None = 16  # None (vLLM's): as many as the context has room for
    n: int = 1
    stop: str | tuple[str, ...] = ()  # one string or several (a list is taken)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def engine_params(self) -> protocol.SamplingParams:
        """What the engine gets: its own fields alone."""
        return protocol.SamplingParams(**{name: getattr(self, name) for name in ENGINE_FIELDS})

    def check(self) -> SamplingParams:
        """Refuses what vLLM's SamplingParams refuses of the fields added here."""
        if self.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {self.n}", param="n")
        if any(stop == "" for stop in self.stop_strings):  # it would stop nothing
            raise InvalidRequest("stop cannot contain an empty string", param="stop")
        return self
