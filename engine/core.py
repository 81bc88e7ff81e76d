"""EngineCore: the engine loop's body. add_request / abort_requests / step.

`step()` is schedule -> execute -> update, and returns one `EngineOutputs` with
everything the step produced, including requests refused at `add_request` (bad
input never raises here; it finishes that request with an `ErrorInfo`).
`step()` = `finish_step(launch_step())`: on a GPU the engine process does host work
between the two while the device runs. The server's engine process and the offline
`LLM` drive the same loop.

Overlap scheduling (`step_overlapped`, on a GPU): step N+1 is scheduled and launched
before step N's sampled tokens are read, so the host's work for N+1 (scheduling, inputs,
attention plan, graph launch) runs while the device computes N:

    host    launch N | launch N+1 | read N, update | launch N+2 | read N+1, update | ...
    device           |  N ...     |  N+1 ...                    |  N+2 ...

A decode row of N+1 whose token N is still sampling gets it on the device
(`InFlightTokens`). A request that N's token stops (EOS, a stop token) has computed one
token in N+1 that is dropped; length limits are known ahead and never cost one.
Penalties count the outputs so far on the device, N's token included while it is in
flight. A request that needs its output history on the host to sample (a structured
output's grammar, bad words of several tokens) sits out N+1 while its token from N is in
flight and takes every other step; a step where every sampling row is such a request is
not overlapped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.errors import (
    ContextLengthExceeded,
    EngineBroken,
    InvalidRequest,
    MediaError,
    TesseraError,
)
from engine.feature_admission import FeatureAdmission
from engine.grammar_admission import GrammarAdmission
from engine.model_runner import ModelRunner, PendingStep, error_info
from engine.models.mrope import mrope_positions
from engine.multimodal.image_processor import normalization_table
from engine.protocol import (
    EngineOutputs,
    EngineRequest,
    EngineStats,
    ErrorInfo,
    FinishReason,
    MediaInput,
    Modality,
    PixelNormalization,
    Ready,
    RequestOutput,
    SamplingParams,
)
from engine.request import MediaItem, Request
from engine.sampler import token_bitmask
from engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a grammar to compile (engine/process.py
# polls its inbox for as long after an empty step).
COMPILE_WAIT_S = 0.002


@dataclass(frozen=True)
class InFlightStep:
    """A launched step: what was scheduled, its queued device work, and the outputs
    (refusals, aborts, fetch failures) that go out with it."""

    started: float  # perf_counter at launch
    scheduler_output: SchedulerOutput
    pending: PendingStep | None  # None: nothing ran (empty step, or it failed at launch)
    outputs: list[RequestOutput]


class EngineCore:
    """One model, one scheduler, one loop. Not thread-safe: call from one thread."""

    def __init__(self, config: EngineConfig) -> None:
        self._in_flight: InFlightStep | None = None  # launched ahead by step_overlapped
        self._last_finished = 0.0  # perf_counter() when finish_step last returned
        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.config = config.replace(
            max_model_len=self.runner.max_model_len, num_kv_blocks=self.runner.num_kv_blocks
        )
        self.scheduler = Scheduler(
            self.config,
            num_kv_blocks=self.runner.num_kv_blocks,
            max_model_len=self.runner.max_model_len,
        )
        self._pending: list[RequestOutput] = []  # refusals and aborts for the next step
        self.features = FeatureAdmission(self.config, self.runner, self.scheduler)
        self._compiler: GrammarCompiler | None = None  # made by _grammar_compiler()
        self.grammars = GrammarAdmission(self._grammar_compiler)
        self._warm_grammars()
        # True when `launch_step` returns before the device has finished (CUDA): the caller
        # can do host work (read its inbox, launch the next step) until `finish_step`.
        # Tests set it on CPU, where a launched step has already run, to drive the same code.
        self.overlaps_steps = self.runner.device.type == "cuda"

    def close(self) -> None:
        """Stops what the core started: the feature fetcher's loop and any
        tensor-parallel workers. The core cannot step after this."""
        self.features.close()
        self.grammars.close()
        self.runner.close()

    @property
    def ready(self) -> Ready:
        mc = self.model_config
        return Ready(
            model_name=self.config.model_name,
            max_model_len=self.runner.max_model_len,
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            block_size=self.config.block_size,
            num_kv_blocks=self.runner.num_kv_blocks,
            eos_token_ids=list(mc.eos_token_ids),
            modalities=[] if mc.vision is None else [Modality.IMAGE, Modality.VIDEO],
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.runner.device),
        )

    def add_request(self, request: EngineRequest, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Queues a request; invalid input finishes it with an error in the next step."""
        try:
            request_id = request.request_id
            if (
                request_id in self.scheduler.requests
                or self.features.has(request_id)
                or self.grammars.has(request_id)
            ):
                raise InvalidRequest(f"duplicate request id {request.request_id!r}")
            built = self._build(request, tensors)
            if not self.grammars.submit(built, request.media):
                self._admit(built, request.media)
        except TesseraError as exc:
            self._refuse(request, error_info(exc))
        except Exception:  # noqa: BLE001 - never let one request take the engine down
            logger.exception("could not admit request %s", request.request_id)
            self._refuse(request, error_info(RuntimeError()))

    def _admit(self, request: Request, media: Sequence[MediaInput]) -> None:
        """A built request (its grammar compiled) goes on to FETCHING or the scheduler."""
        if not self.features.submit(request, media):
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        self._pending += self.grammars.abort(request_ids)
        self._pending += self.features.abort(request_ids)
        self._pending += self.scheduler.abort(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return (
            self._in_flight is not None
            or self.scheduler.has_unfinished_requests()
            or bool(self._pending)
            or self.features.num_fetching > 0
            or self.grammars.num_compiling > 0
        )

    @property
    def has_step_in_flight(self) -> bool:
        """A step launched ahead by `step_overlapped` is not finished yet."""
        return self._in_flight is not None

    def step(self) -> EngineOutputs:
        """One step, launched and finished (a step already launched ahead is finished)."""
        step, self._in_flight = self._in_flight, None
        return self.finish_step(step or self.launch_step())

    def step_overlapped(self, while_running: Callable[[], None] | None = None) -> EngineOutputs:
        """One step's outputs, with the next step launched before they are read where it
        can be (see the module docstring). `while_running` (e.g. reading the inbox) is
        called while the device runs, before the next step is scheduled."""
        step, self._in_flight = self._in_flight, None
        step = step or self.launch_step()
        if while_running is not None:
            while_running()
        if self._can_launch_ahead(step):
            self._in_flight = self.launch_step(previous=step)
        return self.finish_step(step)

    def _can_launch_ahead(self, step: InFlightStep) -> bool:
        if not (self.overlaps_steps and self.config.overlap_scheduling):
            return False
        if step.pending is None or step.pending.errors:
            return False  # nothing in flight, or requests that the finish will fail
        if not self.scheduler.has_unfinished_requests():
            return False
        # A request that needs its output on the host to sample (a grammar) sits out the
        # step launched ahead (Scheduler.schedule). If every row of this step does, that
        # step would only hold what is left: launch it once their tokens are known.
        sampled = [chunk.request for chunk in step.scheduler_output.chunks if chunk.samples]
        return not sampled or not all(r.sampling.needs_output_on_host for r in sampled)

    def launch_step(self, previous: InFlightStep | None = None) -> InFlightStep:
        """Schedules a step and queues its device work. Until `finish_step`, requests may
        be added and aborted (an aborted request's tokens from this step are dropped).
        `previous`: the step in flight, whose sampled tokens this one may take as inputs."""
        started = time.perf_counter()
        outputs = self._admit_compiled()
        outputs += self.features.admit_finished()  # never waits on the network
        outputs, self._pending = self._pending + outputs, []
        scheduler_output = self.scheduler.schedule()
        pending = None
        if not scheduler_output.is_empty:
            try:
                pending = self.runner.launch(
                    scheduler_output, previous.pending if previous else None
                )
            except EngineBroken:
                raise
            except Exception:  # noqa: BLE001 - fail this step's requests, keep serving
                logger.exception("model step failed")
                outputs += self._fail_step(scheduler_output)
        return InFlightStep(started, scheduler_output, pending, outputs)

    def finish_step(self, step: InFlightStep) -> EngineOutputs:
        """Waits for the step's sampled tokens and applies them."""
        outputs = step.outputs
        encoder_seconds, num_items, num_batches = 0.0, 0, 0
        if step.pending is not None:
            try:
                result = step.pending.result()
            except EngineBroken:
                raise
            except Exception:  # noqa: BLE001 - e.g. a device error surfacing at the sync
                logger.exception("model step failed")
                outputs += self._fail_step(step.scheduler_output)
            else:
                outputs += self.scheduler.update(
                    step.scheduler_output,
                    result.sampled_token_ids,
                    result.logprobs,
                    result.errors,
                    result.prompt_logprobs,
                )
                encoder_seconds = result.encoder_seconds
                num_items, num_batches = result.num_encoder_items, result.num_encoder_batches
        counters = self.scheduler.pop_counters()
        stats = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.grammars.num_compiling,
            num_fetching=self.features.num_fetching,
            kv_cache_usage=self.scheduler.kv.usage,
            num_preemptions_total=counters.num_preemptions,
            num_scheduled_tokens=step.scheduler_output.num_scheduled_tokens,
            step_seconds=self._step_seconds(step),
            vision_encoder_seconds=encoder_seconds,
            vision_encoder_items_total=num_items,
            vision_encoder_batches_total=num_batches,
            encoder_cache_queries_total=counters.encoder_cache_queries,
            encoder_cache_hits_total=counters.encoder_cache_hits,
            prefix_cache_queries_total=counters.prefix_cache_queries,
            prefix_cache_hits_total=counters.prefix_cache_hits,
            **self.features.stats_fields(),
        )
        return EngineOutputs(outputs, stats)

    def _step_seconds(self, step: InFlightStep) -> float:
        """The step's time, from its launch or, if it was launched ahead, from when the
        step before it finished: steps' times then add up to the engine's time, where a
        step launched ahead would count the rest of the one before it again."""
        now = time.perf_counter()
        seconds = now - max(step.started, self._last_finished)
        self._last_finished = now
        return seconds

    def _admit_compiled(self) -> list[RequestOutput]:
        """Passes on requests whose grammar has compiled; returns those that failed. With
        nothing else to run it waits a moment for a compile rather than spin."""
        idle = not self.scheduler.has_unfinished_requests() and self._in_flight is None
        compiled, outputs = self.grammars.admit_finished(COMPILE_WAIT_S if idle else 0.0)
        for request, media in compiled:
            try:
                self._admit(request, media)
            except Exception as exc:  # noqa: BLE001 - one request never stops the engine
                logger.exception("could not admit request %s", request.request_id)
                outputs.append(request.unscheduled_output(FinishReason.ERROR, error_info(exc)))
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        failure = error_info(RuntimeError())
        outputs = []
        for chunk in scheduler_output.chunks:
            output = self.scheduler.fail(chunk.request.request_id, failure)
            if output is not None:
                outputs.append(output)
        return outputs

    def _refuse(self, request: EngineRequest, error: ErrorInfo) -> None:
        self._pending.append(
            RequestOutput(
                request_id=request.request_id,
                finish_reason=FinishReason.ERROR,
                error=error,
                num_prompt_tokens=len(request.prompt_token_ids),
            )
        )

    # ---- validation ----------------------------------------------------------------------

    def _build(self, request: EngineRequest, tensors: Sequence[torch.Tensor]) -> Request:
        mc = self.model_config
        prompt = request.prompt_token_ids
        max_len = self.runner.max_model_len
        max_tokens = request.sampling.max_tokens
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if min(prompt) < 0 or max(prompt) >= mc.vocab_size:
            raise InvalidRequest(
                f"prompt token ids must be in [0, {mc.vocab_size})", param="prompt"
            )
        if not 0 <= request.sampling.min_tokens <= max_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens={max_tokens}], "
                f"got {request.sampling.min_tokens}",
                param="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            # A negative count would fail the sampler's or the scorer's topk for the batch.
            if (getattr(request.sampling, name) or 0) < 0:
                raise InvalidRequest(f"{name} must not be negative", param=name)

        def in_vocabulary(token_ids: Sequence[int]) -> bool:
            return all(0 <= token_id < mc.vocab_size for token_id in token_ids)

        for token_id, bias in request.sampling.logit_bias:
            # An id past the logits would fail the sampler's step for the whole batch.
            if not in_vocabulary((token_id,)) or not math.isfinite(bias):
                raise InvalidRequest(
                    f"logit_bias needs token ids in [0, {mc.vocab_size}) and finite biases",
                    param="logit_bias",
                )
        allowed = request.sampling.allowed_token_ids
        if allowed is not None and not (allowed and in_vocabulary(allowed)):
            raise InvalidRequest(
                f"allowed_token_ids needs at least one token id, each in [0, {mc.vocab_size})",
                param="allowed_token_ids",
            )
        for word in request.sampling.bad_words_token_ids:
            if not (word and in_vocabulary(word)):
                raise InvalidRequest(
                    f"bad words need at least one token, each id in [0, {mc.vocab_size})",
                    param="bad_words",
                )
        _check_some_token_is_allowed(request.sampling, mc.eos_token_ids)
        if request.priority and self.config.scheduling_policy != "priority":
            raise InvalidRequest(
                "priority needs the server's --scheduling-policy priority", param="priority"
            )
        if len(prompt) >= max_len:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens but the model's context length is {max_len}",
                param="messages",
            )
        if len(prompt) + max_tokens > max_len:
            raise ContextLengthExceeded(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context length of {max_len}",
                param="max_tokens",
            )
        if request.media and mc.vision is None:
            raise InvalidRequest("this model takes no images or videos", param="messages")
        if mc.vision is not None and mc.vision.variant == "qwen3_vl":
            if any(m.modality == Modality.VIDEO and m.grid_thw[0] != 1 for m in request.media):
                raise InvalidRequest(
                    "Qwen3-VL takes a video as one media item per temporal patch (grid_thw "
                    "t = 1), each after its time in the prompt; video features are not "
                    "supported for it",
                    param="messages",
                )
        # A uuid-only part may name media that an earlier part of this same request sends
        # (a conversation's history): that item's pixels serve both.
        sent = {_cache_key(m) for m in request.media if m.pixel_values is not None}
        media = [self._media_item(m, i, tensors, sent) for i, m in enumerate(request.media)]
        media = _share_pixels(media)
        self._check_placeholders(prompt, media)
        positions, rope_delta = mrope_positions(
            prompt,
            [(m.offset, m.num_tokens, m.grid_thw, m.modality) for m in media],
            spatial_merge_size=mc.vision.spatial_merge_size if mc.vision else 1,
            tokens_per_second=mc.vision.tokens_per_second if mc.vision else None,
            second_per_grid_ts=[m.second_per_grid_t for m in request.media],
        )
        result = Request(
            request.request_id,
            prompt,
            request.sampling,
            media=media,
            arrival_time=request.arrival_time or time.time(),
            eos_token_ids=mc.eos_token_ids,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        result.positions, result.rope_delta = positions, rope_delta  # [3, L]
        if allowed is not None:
            result.allowed_token_mask = token_bitmask(allowed, mc.vocab_size)
        return result

    def _warm_grammars(self) -> None:
        """Starts building llguidance's view of the tokenizer on a thread (see
        `GrammarCompiler.warm`)."""
        try:
            compiler = self._grammar_compiler()
        except ImportError:  # llguidance missing (the GPU machine's wheel bundle)
            return
        threading.Thread(target=compiler.warm, name="grammar-tokenizer", daemon=True).start()

    def _grammar_compiler(self) -> GrammarCompiler:
        # Imported here: without llguidance (the GPU machine's wheel bundle goes without
        # it, as without PyAV) everything but structured outputs works.
        from engine.structured_output import GrammarCompiler, parser_limits

        if self._compiler is None:
            mc = self.model_config
            tokenizer_json = str(Path(self.config.model) / "tokenizer.json")
            limits = parser_limits(self.config.grammar_lexer_fuel)
            self._compiler = GrammarCompiler(
                tokenizer_json, mc.vocab_size, mc.eos_token_ids, limits,
                cache_size=self.config.grammar_cache_size,
            )  # fmt: skip
        return self._compiler

    def _media_item(
        self,
        media: MediaInput,
        index: int,
        tensors: Sequence[torch.Tensor],
        sent: Collection[str] = (),
    ) -> MediaItem:
        """The engine's item of `media`, checked; `sent`: the cache keys whose pixels this
        request carries."""
        vision = self.model_config.vision
        param = f"media[{index}]"
        t, h, w = media.grid_thw
        merge = vision.spatial_merge_size
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise MediaError(f"grid_thw {tuple(media.grid_thw)} is invalid", param=param)
        if t * h * w // merge**2 != media.num_tokens:
            raise MediaError(
                f"{media.num_tokens} placeholders do not match grid_thw {tuple(media.grid_thw)}",
                param=param,
            )
        if not (math.isfinite(media.second_per_grid_t) and media.second_per_grid_t > 0):
            raise MediaError("second_per_grid_t must be positive", param=param)
        cache_key = _cache_key(media)
        pixel_values = None
        if media.pixel_values is not None:
            ref = media.pixel_values
            if not 0 <= ref.frame < len(tensors):
                raise MediaError("pixel values frame is missing", param=param)
            pixel_values = tensors[ref.frame]
            patch_dim = vision.patch_dim
            if tuple(pixel_values.shape) != (t * h * w, patch_dim):
                raise MediaError(
                    f"pixel values of shape {tuple(pixel_values.shape)} do not match grid_thw "
                    f"{tuple(media.grid_thw)} (expected {(t * h * w, patch_dim)})",
                    param=param,
                )
            _check_pixel_encoding(pixel_values, media.normalization, vision.in_channels, param)
        elif media.feature is not None:  # fetched before the request is scheduled
            _check_feature_rows(media, param)
        elif media.content_hash.startswith("uuid:"):
            if cache_key not in self.runner.encoder_cache and cache_key not in sent:
                raise MediaError(
                    f"unknown media uuid {media.content_hash.removeprefix('uuid:')!r}: send the "
                    "media with its uuid first (it may also have been evicted)",
                    param=param,
                    code="unknown_media_uuid",
                )
        elif cache_key not in self.runner.encoder_cache:
            raise MediaError("media item has no pixel values and is not cached", param=param)
        is_timed = vision.tokens_per_second is not None and media.modality is Modality.VIDEO
        return MediaItem(
            media.modality.value,
            cache_key,
            media.offset,
            media.num_tokens,
            tuple(media.grid_thw),
            pixel_values,
            media.normalization if pixel_values is not None else None,
            second_per_grid_t=media.second_per_grid_t if is_timed else None,
        )

    def _check_placeholders(self, prompt: list[int], media: list[MediaItem]) -> None:
        mc = self.model_config
        placeholder_ids = {"image": mc.image_token_id, "video": mc.video_token_id}
        cursor = 0
        for index, item in enumerate(media):
            if item.offset < cursor or item.end > len(prompt):
                raise MediaError(
                    f"{item.modality} span at {item.offset} overlaps another span "
                    "or leaves the prompt",
                    param=f"media[{index}]",
                )
            span = prompt[item.offset : item.end]
            if span.count(placeholder_ids[item.modality]) != len(span):  # C loops, not Python
                raise MediaError(
                    f"{item.modality} span at {item.offset} is not made of placeholder tokens",
                    param=f"media[{index}]",
                )
            cursor = item.end
        ids = {token_id for token_id in placeholder_ids.values() if token_id is not None}
        num_placeholders = sum(prompt.count(token_id) for token_id in ids)
        num_expected = sum(item.num_tokens for item in media)
        if num_placeholders != num_expected:
            raise MediaError(
                f"the prompt has {num_placeholders} media placeholder tokens but "
                f"the media items fill {num_expected}",
                param="messages",
            )


def _check_pixel_encoding(
    pixel_values: torch.Tensor,
    normalization: PixelNormalization | None,
    channels: int,
    param: str,
) -> None:
    """uint8 levels need a `normalization` for the model's channels that gives finite
    values; floating-point values are taken as already normalised."""
    if pixel_values.dtype == torch.uint8:
        if normalization is None:
            raise MediaError("uint8 pixel values need a normalization", param=param)
        if len(normalization.mean) != channels or len(normalization.std) != channels:
            raise MediaError(
                f"the normalization must have {channels} means and stds (one per channel)",
                param=param,
            )
        if not torch.isfinite(normalization_table(normalization)).all():
            raise MediaError("the normalization gives non-finite pixel values", param=param)
    elif not pixel_values.is_floating_point():
        raise MediaError(
            f"pixel values must be uint8 levels or floating point, not {pixel_values.dtype}",
            param=param,
        )
    elif normalization is not None:
        raise MediaError("a normalization applies to uint8 pixel values only", param=param)


def _check_feature_rows(media: MediaInput, param: str) -> None:
    """A part of a feature file (one temporal patch) is one patch's rows of a file of the
    same frame size."""
    source = media.feature
    if source is None or (source.rows is None and source.file_grid_thw is None):
        return
    t, h, w = media.grid_thw
    if source.rows is None or source.file_grid_thw is None:
        raise MediaError("a feature part needs both its rows and its file's grid", param=param)
    start, stop = source.rows
    file_t, file_h, file_w = source.file_grid_thw
    whole = media.num_tokens * file_t
    if (
        (t, file_h, file_w) != (1, h, w)
        or stop - start != media.num_tokens
        or not (0 <= start and stop <= whole and start % media.num_tokens == 0)
    ):
        raise MediaError(
            f"feature rows {source.rows} are not one temporal patch of a file of grid "
            f"{tuple(source.file_grid_thw)}",
            param=param,
        )


def _cache_key(media: MediaInput) -> str:
    """The encoder cache's key of a media item. A client may send one uuid with pictures of
    different sizes: rows cached for one grid must never be spliced into another's
    placeholders (the step would fail for every request in it), so a uuid names its rows
    per grid."""
    if media.content_hash.startswith("uuid:"):
        t, h, w = media.grid_thw
        return f"{media.content_hash}@{t}x{h}x{w}"
    return media.content_hash


def _share_pixels(media: list[MediaItem]) -> list[MediaItem]:
    """Items without pixels take those of an item of the same key that has them, so
    whichever the scheduler meets first can be encoded."""
    with_pixels = {item.content_hash: item for item in media if item.pixel_values is not None}
    return [
        dataclasses.replace(
            item, pixel_values=source.pixel_values, normalization=source.normalization
        )
        if item.pixel_values is None
        and item.embeds is None
        and (source := with_pixels.get(item.content_hash)) is not None
        else item
        for item in media
    ]


def _check_some_token_is_allowed(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> None:
    """Refuses `allowed_token_ids` that the request's own bans empty: bad words of one token
    at every step, or EOS and stop tokens before `min_tokens` (engine/model_runner.py's
    `_banned_token_ids`). With every logit -inf the sampler would pick id 0, a token the
    request did not allow."""
    allowed = sampling.allowed_token_ids
    if allowed is None:
        return
    left = set(allowed) - {word[0] for word in sampling.bad_words_token_ids if len(word) == 1}
    if not left:
        raise InvalidRequest("every token of allowed_token_ids is a bad word", param="bad_words")
    ends = set(sampling.stop_token_ids) | set(() if sampling.ignore_eos else eos_token_ids)
    if sampling.min_tokens > 0 and not left - ends:
        raise InvalidRequest(
            "allowed_token_ids leaves only tokens that end the answer (EOS, stop_token_ids), "
            f"which min_tokens ({sampling.min_tokens}) forbids until that many tokens",
            param="min_tokens",
        )
