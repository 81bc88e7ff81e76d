"""All per-request state the engine keeps: tokens, media, positions, KV blocks, status.

A `Request` is created by `EngineCore.add_request` from an `EngineRequest`, owned by
the scheduler while it lives, and read by the model runner. Sequence index i of a
request is prompt token i for i < num_prompt_tokens, else output token
i - num_prompt_tokens. After preemption `num_computed_tokens` falls back to 0 and
the generated tokens are recomputed together with the prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.protocol import (
    ErrorInfo,
    FinishReason,
    PixelNormalization,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from engine.structured_output import GrammarMatcher


def cpu_seed(seed: int) -> int:
    """A seed (a request's, or the engine's --seed) for torch's CPU generator, which keeps
    only the low 32 bits (seeds 2**32 apart sampled alike, vLLM's too): the high half is
    mixed into the low one. A seed in [0, 2**32) is itself, as torch.manual_seed takes it."""
    bits = seed & (2**64 - 1)  # torch's reading of a negative seed
    return (bits ^ ((bits >> 32) * 0x9E3779B9)) & (2**32 - 1)


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `seed` (on CPU through `cpu_seed`)."""
    seed = cpu_seed(seed) if device.type == "cpu" else seed
    return torch.Generator(device=device).manual_seed(seed)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class MediaItem:
    """One media item of a request and the placeholder span [offset, offset + num_tokens)."""

    modality: str  # "image" | "video"
    content_hash: str
    offset: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    pixel_values: torch.Tensor | None = None  # [num_patches, C * T_patch * P * P], host
    normalization: PixelNormalization | None = None  # set iff pixel_values are uint8 levels
    # Fetched pre-encoded features: the request's own copy of its encoder rows, put back
    # into the encoder cache if they were evicted (e.g. while the request was preempted).
    embeds: torch.Tensor | None = None  # [num_tokens, hidden], host
    # Set where it moves the span's positions (a Qwen2.5-VL video): the same content at
    # another time spacing has other KV, so the prefix-cache key includes it.
    second_per_grid_t: float | None = None
    # Neither pixels nor features (a uuid-only part, or an item the server knows cached):
    # only its cached encoding can serve it, so its request holds that encoding from
    # admission to its finish, through waiting and preemption (Scheduler.add_request).
    cached_only: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def counted_output_tokens(reason: FinishReason | None, num_output_tokens: int) -> int | None:
    """A finishing output's `num_output_tokens`: None for a request that failed, which counts
    in no per-request metric (as one refused on arrival does; fuzz49)."""
    return None if reason is FinishReason.ERROR else num_output_tokens


class Request:
    """Mutable state of one sequence, from admission to its finish."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        media: list[MediaItem] | None = None,
        arrival_time: float = 0.0,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.media: list[MediaItem] = list(media or [])
        # Media spans lie inside the prompt and never change: past this index no chunk
        # touches media, which lets decode steps skip every per-item check.
        self.media_end = max((item.end for item in self.media), default=0)
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt  # seeds the first block's hash (engine/kv_cache_manager)
        self.queue_order = 0  # the scheduler's admission count: ties of priority, FCFS
        self.eos_token_ids = tuple(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is (or is being) written
        # Tokens being sampled by launched steps whose results are not applied yet: with
        # overlap scheduling the next step is scheduled (and may take one of them as its
        # input on the device) before they are known. At most one per step in flight.
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_ids: list[int] = []
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks so far
        self.positions: torch.Tensor | None = None  # [3, num_prompt_tokens] int64 M-RoPE
        self.rope_delta = 0
        self._generator: torch.Generator | None = None  # a seeded request's: generator_on()
        # Where the output stands in `sampling.structured_output`'s grammar (set at admission).
        self.grammar: GrammarMatcher | None = None
        # The grammar holds once the output has written `structured_output_after` (at once
        # without it); the tokens before, and those, are not the grammar's.
        self.grammar_active = not sampling.structured_output_after
        # sampling.allowed_token_ids as a bitmask over the logits (set by EngineCore).
        self.allowed_token_mask: torch.Tensor | None = None
        # sampling.prompt_logprobs: the scores of prompt tokens 1 .. len(...), as computed.
        self.prompt_logprobs: list[TokenLogprob] = []
        self.error: ErrorInfo | None = None
        self.num_preemptions = 0
        # time.monotonic() marks of the engine-side phases (for the latency histograms).
        self.queued_time: float | None = None  # entered the scheduler's waiting queue
        self.scheduled_time: float | None = None  # first scheduled (preemption keeps it)
        self.first_token_time: float | None = None

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """A seeded request's own random stream, on the device that samples it (made at the
        first sample; None without a seed). On that device, not the host: a host stream
        would cost a vocabulary of exponentials on the CPU and a copy per row and step
        (~2 ms a row for 152k tokens)."""
        if self.sampling.seed is None:
            return None
        if self._generator is None:
            self._generator = seeded_generator(self.sampling.seed, device)
        return self._generator

    def allowed_tokens(self) -> torch.Tensor | None:
        """The bitmask of the tokens its next pick may take (grammar and
        `allowed_token_ids` together), or None for any token."""
        fixed = self.allowed_token_mask
        if self.grammar is None or not self.grammar_active:
            return fixed
        mask = self.grammar.allowed_tokens()
        return mask if fixed is None else mask & fixed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """The sequence's length once its pending tokens arrive."""
        return self.num_tokens + self.num_pending_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Sequence indices [start, end) without building the whole list when possible."""
        num_prompt = self.num_prompt_tokens
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:  # decode: never copy the whole history
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def note_output_token(self) -> None:
        """After a token joins the output: the grammar starts to hold once the output ends
        with `structured_output_after`."""
        after = self.sampling.structured_output_after
        if not self.grammar_active and tuple(self.output_token_ids[-len(after) :]) == after:
            self.grammar_active = True

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def phase_seconds(self, now: float) -> dict[str, float]:
        """Queue, prefill and decode durations for the finishing output, in seconds.

        Each phase the request entered lasts until the next one began, or until `now`;
        a phase it never reached (aborted while queued) is left out.
        """
        marks = (self.queued_time, self.scheduled_time, self.first_token_time)
        names = ("queued_seconds", "prefill_seconds", "decode_seconds")
        phases = {}
        for i, (name, start) in enumerate(zip(names, marks, strict=True)):
            if start is not None:
                end = next((m for m in marks[i + 1 :] if m is not None), now)
                phases[name] = end - start
        return phases

    @property
    def urgency(self) -> tuple[int, int]:
        """Smaller runs first under the priority policy: its priority, then arrival."""
        return (self.priority, self.queue_order)

    def unscheduled_output(
        self, reason: FinishReason, error: ErrorInfo | None = None
    ) -> RequestOutput:
        """The last output of a request that ends before the scheduler has it: aborted or
        failed while its features were fetched or its grammar compiled."""
        return RequestOutput(
            request_id=self.request_id,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=counted_output_tokens(reason, 0),
        )

    def media_overlapping(self, start: int, end: int) -> list[MediaItem]:
        """Media items whose span intersects sequence indices [start, end)."""
        if start >= self.media_end:  # every decode step
            return []
        return [m for m in self.media if m.offset < end and m.end > start]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
