"""What the scheduler hands the model runner each step (`SchedulerOutput` of
`ScheduledChunk`s), and the counters it keeps for the engine's stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import MediaItem, Request


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~1.5 us, this one ~0.3 us
class ScheduledChunk:
    """Sequence indices [start, start + num_tokens) of `request` are computed this step.
    Made once per running request per step; treat it as read-only."""

    request: Request
    start: int
    num_tokens: int
    samples: bool  # the chunk reaches the end of the sequence: its last row is sampled

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. `media_to_encode` has unique content hashes, in schedule order."""

    chunks: list[ScheduledChunk]
    media_to_encode: list[MediaItem] = field(default_factory=list)
    evicted_encoder_hashes: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Blocks this step enters into the prefix cache: its KV is written when the step runs.
    newly_cached_block_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerCounters:
    """Deltas since the last `Scheduler.pop_counters()`."""

    num_preemptions: int = 0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    prompt_tokens: int = 0  # of requests that sampled their first token
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    generation_tokens: int = 0
