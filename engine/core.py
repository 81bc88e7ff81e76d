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

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.errors import (
    EngineBroken,
    InvalidRequest,
    TesseraError,
    error_info,
)
from engine.feature_admission import FeatureAdmission
from engine.grammar_admission import GrammarAdmission
from engine.model_runner import ModelRunner
from engine.protocol import (
    EngineOutputs,
    EngineRequest,
    EngineStats,
    ErrorInfo,
    FinishReason,
    MediaInput,
    Modality,
    Ready,
    RequestOutput,
)
from engine.request import Request
from engine.request_checks import SERVER_PRIORITY_SETTING, RequestBuilder
from engine.runner_output import PendingStep
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput

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

    def __init__(
        self, config: EngineConfig, *, priority_setting: str = SERVER_PRIORITY_SETTING
    ) -> None:
        """`priority_setting`: what a priority's refusal under another policy names."""
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
        self._builder = RequestBuilder(
            self.model_config,
            self.runner.max_model_len,
            config.scheduling_policy,
            self.runner.encoder_cache,
            max_logprobs=config.max_logprobs,
            priority_setting=priority_setting,
        )
        self.features = FeatureAdmission(self.config, self.runner, self.scheduler)
        self._compiler: GrammarCompiler | None = None  # made by _grammar_compiler()
        self.grammars = GrammarAdmission(self._grammar_compiler)
        self._warm_grammars()
        # True when `launch_step` returns before the device has finished (CUDA): the caller
        # can do host work (read its inbox, launch the next step) until `finish_step`.
        # Tests set it on CPU, where a launched step has already run, to drive the same code.
        self.overlaps_steps = self.runner.device.type == "cuda"

    def check_alive(self) -> None:
        """Raises EngineBroken once a tensor-parallel worker has exited (between steps,
        idle or not)."""
        if self.runner.shard_workers is not None:
            self.runner.shard_workers.check_alive()

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
            built = self._builder.build(request, tensors)
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

    def settle(self) -> None:
        """Finishes a step launched ahead, if any (its outputs dropped): for a caller that
        stopped reading mid-call and aborted what it waited for (`LLM.generate`)."""
        if self._in_flight is not None:
            self.step()

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
        self._forget_unstored_media(step.scheduler_output)
        stats = self._stats(
            num_scheduled_tokens=step.scheduler_output.num_scheduled_tokens,
            step_seconds=self._step_seconds(step),
            vision_encoder_seconds=encoder_seconds,
            vision_encoder_items_total=num_items,
            vision_encoder_batches_total=num_batches,
        )
        return EngineOutputs(outputs, stats)

    def idle_stats(self) -> EngineStats:
        """The stats now, with no step: what the engine process publishes while idle, since
        some figures move without one (a cancelled feature download ends after the abort
        that cancelled it, and the in-flight gauge with it)."""
        return self._stats()

    def _stats(self, **step_fields: Any) -> EngineStats:
        """Gauges as they are, counters since the last call, and the step's own fields."""
        counters = self.scheduler.pop_counters()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.grammars.num_compiling,
            num_fetching=self.features.num_fetching,
            kv_cache_usage=self.scheduler.kv.usage,
            encoder_cache_usage=self.scheduler.encoder_cache.usage,
            num_preemptions_total=counters.num_preemptions,
            encoder_cache_queries_total=counters.encoder_cache_queries,
            encoder_cache_hits_total=counters.encoder_cache_hits,
            prefix_cache_queries_total=counters.prefix_cache_queries,
            prefix_cache_hits_total=counters.prefix_cache_hits,
            prompt_tokens_total=counters.prompt_tokens,
            prompt_tokens_cached_total=counters.cached_prompt_tokens,
            generation_tokens_total=counters.generation_tokens,
            **self.features.stats_fields(),
            **step_fields,
        )

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

    def _forget_unstored_media(self, scheduler_output: SchedulerOutput) -> None:
        """The step's new encoder entries whose rows the runner does not hold (the encode
        failed, or the whole step did) are forgotten: a later request with the item
        encodes it again instead of finding an entry with nothing behind it."""
        store = self.runner.encoder_cache
        lost = [m.content_hash for m in scheduler_output.media_to_encode
                if m.content_hash not in store]  # fmt: skip
        if lost:
            self.scheduler.forget_media(lost)

    def _fail_step(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        return self.scheduler.fail_step(scheduler_output, error_info(RuntimeError()))

    def _refuse(self, request: EngineRequest, error: ErrorInfo) -> None:
        self._pending.append(
            RequestOutput(
                request_id=request.request_id,
                finish_reason=FinishReason.ERROR,
                error=error,
                num_prompt_tokens=len(request.prompt_token_ids),
            )
        )

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
