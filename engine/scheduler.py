"""Continuous batching: which requests run this step, how many tokens each, what to encode.

Each step spends a token budget (`max_num_batched_tokens`):

    1. running requests with one token left (decodes), one token each;
    2. running requests mid-prefill, a chunk each from what is left;
    3. waiting requests, in queue order, while fewer than `max_num_seqs` run.

KV blocks are allocated per chunk. When the pool is full, the most recently
admitted running request not yet scheduled this step is preempted: its blocks are
freed, `num_computed_tokens` falls to 0 and it goes to the front of the waiting
queue; its generated tokens are recomputed with the prompt later. Never an error:
a request whose prompt + max_tokens cannot fit the pool alone is refused at
`add_request`.

`--scheduling-policy priority` (vLLM's): the waiting queue is ordered by each request's
`priority` (lower first), then arrival; the victim of a preemption is the least urgent
running request; and before a step is planned, a waiting request more urgent than a
running one takes its place when it could not start otherwise (every seat taken, or too
few free blocks for its first chunk).

A chunk may end inside a media span (`split_media=True`); the item is encoded by
the first chunk touching it and kept in the encoder cache for the next chunks.
With `split_media=False` a chunk stops before a span it would split, unless the
span starts the chunk (then it must still make progress).

Overlap scheduling (engine/core.py) schedules a step while the previous one is still
sampling: `request.num_pending_tokens` counts tokens in flight, a sampling chunk adds one
and `update` takes it back. A decode may then cover the sequence index of an in-flight
token (the model runner feeds it on the device); a request whose in-flight token reaches
max_tokens is not scheduled again, and one stopped by a token it did not know yet has
its extra row dropped in `update`.

Encoder references (engine/scheduler_media.py): a request holds one only while a span of
that item is part-way computed, or, from its first chunk until it ends, for an item only
the cache can serve (`MediaItem.cached_only`: a uuid-only part, which a preemption would
need again), so a request waiting for encoder room never holds room itself. An entry that
a waiting request needs as a cached-only item is evicted last; evicted all the same, that
request fails with `unknown_media_uuid`. A request whose cached-only items leave no room
for its largest other item is refused at `add_request`; when running requests wait on
encoder room that only their cached-only entries hold (no chunk moves), the most recently
admitted one is preempted. An item larger than `encoder_cache_tokens` or
`max_encoder_tokens_per_step` still runs: the budget grows to it at `add_request`, with a
warning.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection

from engine.config import EngineConfig
from engine.encoder_cache import EncoderCacheManager, uuid_of
from engine.errors import MediaError, too_long_for_kv_cache, unknown_media_uuid
from engine.kv_cache_manager import KVCacheManager
from engine.protocol import ErrorInfo, RequestOutput, TokenLogprob
from engine.request import MediaItem, Request, RequestStatus
from engine.request_outputs import grammar_failure, request_output, stop_status
from engine.scheduler_media import cached_only_hashes, chunk_end_for_media, release_media
from engine.scheduler_output import ScheduledChunk, SchedulerCounters, SchedulerOutput
from engine.waiting_queue import PriorityQueue, WaitingQueue

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides each step's batch; owns the KV and encoder cache accounting."""

    def __init__(self, config: EngineConfig, *, num_kv_blocks: int, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_tokens)
        # Grows (with a warning) to the largest media item seen, so no item is refused.
        self.max_encoder_tokens_per_step = config.max_encoder_tokens_per_step
        self.is_priority = config.scheduling_policy == "priority"
        self.waiting = PriorityQueue() if self.is_priority else WaitingQueue()
        self.running: list[Request] = []  # admission order
        self._queue_order = itertools.count()
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()

    # ---- admission / removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a validated request; raises if it can never be scheduled alone."""
        refusal = too_long_for_kv_cache(request.num_prompt_tokens, request.sampling.max_tokens,
                                        self.max_model_len, self.kv.num_blocks * self.kv.block_size)  # fmt: skip
        if refusal is not None:
            raise refusal
        for media in request.media:
            self._fit_encoder_budgets(media.num_tokens)
        cached_only = cached_only_hashes(request)
        for content_hash in cached_only:
            if not self.encoder_cache.has(content_hash):
                raise unknown_media_uuid(
                    uuid_of(content_hash) or content_hash,
                    "its cached encoding was evicted; send the media with its uuid again",
                )
        self._check_cached_only_room(request, cached_only)
        self.requests[request.request_id] = request
        request.queued_time = time.monotonic()
        request.queue_order = next(self._queue_order)
        self.waiting.push(request)

    def _check_cached_only_room(self, request: Request, cached_only: set[str]) -> None:
        """A running request holds its uuid-only items' entries, and each other item needs
        room beside them: more than the cache holds, and its chunk could never start
        (0 tokens each step, and first in the queue, every request behind it waited)."""
        if not cached_only:
            return
        sizes = {m.content_hash: m.num_tokens for m in request.media}
        held = sum(sizes[content_hash] for content_hash in cached_only)
        largest = max((n for h, n in sizes.items() if h not in cached_only), default=0)
        if held + largest > self.encoder_cache.budget_tokens:
            raise MediaError(
                f"the request's uuid-only media take {held} encoder cache tokens and its "
                f"largest other item {largest}, more than the encoder cache holds "
                f"({self.encoder_cache.budget_tokens}, --encoder-cache-tokens): send the "
                "media with their uuids again, or fewer of them in one request",
                param="messages",
            )

    def _fit_encoder_budgets(self, num_tokens: int) -> None:
        """An item larger than an encoder budget still runs: the budget grows to fit it."""
        if num_tokens > self.encoder_cache.budget_tokens:
            logger.warning(
                "a media item needs %d encoder tokens, more than encoder_cache_tokens=%d; "
                "growing the encoder cache budget to %d",
                num_tokens,
                self.encoder_cache.budget_tokens,
                num_tokens,
            )
            self.encoder_cache.budget_tokens = num_tokens
        if num_tokens > self.max_encoder_tokens_per_step:
            logger.warning(
                "a media item needs %d encoder tokens, more than max_encoder_tokens_per_step=%d; "
                "growing the per-step encoder budget to %d",
                num_tokens,
                self.max_encoder_tokens_per_step,
                num_tokens,
            )
            self.max_encoder_tokens_per_step = num_tokens

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(request_output(request, []))
        return outputs

    def fail(self, request_id: str, error: ErrorInfo) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.error = error
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return request_output(request, [])

    def forget_media(self, content_hashes: Collection[str]) -> None:
        """Entries whose rows the runner never stored (engine/core.py, after a step)."""
        self.encoder_cache.forget(content_hashes)

    def fail_step(self, scheduler_output: SchedulerOutput, error: ErrorInfo) -> list[RequestOutput]:
        """A step that failed: its requests fail, and the blocks it entered into the prefix
        cache leave it, also those of a request aborted while the step ran (freed with
        its entries kept), whose KV the step never wrote."""
        self.kv.uncache(scheduler_output.newly_cached_block_ids)
        outputs = []
        for chunk in scheduler_output.chunks:
            if (output := self.fail(chunk.request.request_id, error)) is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_counters(self) -> SchedulerCounters:
        counters, self.counters = self.counters, SchedulerCounters()
        return counters

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        encoder_budget = [self.max_encoder_tokens_per_step]
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        to_encode: dict[str, MediaItem] = {}
        preempted: list[str] = []

        def run(request: Request, start: int, num_tokens: int) -> None:
            nonlocal budget
            self._commit_media(request, start, start + num_tokens, to_encode, encoder_budget)
            request.num_computed_tokens = start + num_tokens
            samples = request.num_computed_tokens == request.num_scheduled_tokens
            if samples:
                request.num_pending_tokens += 1
            chunks.append(ScheduledChunk(request, start, num_tokens, samples))
            scheduled.add(request.request_id)
            budget -= num_tokens

        if self.is_priority:
            self._make_room_for_the_urgent(budget, preempted)
        decodes: list[Request] = []
        prefills: list[Request] = []
        sits_out = False
        for request in self.running:
            if request.num_pending_tokens and (
                request.sampling.needs_output_on_host or self._pending_token_ends(request)
            ):
                # Its next token needs the one in flight on the host (a grammar's mask, a
                # bad word's ban), or that token ends it: it sits this step out.
                sits_out = True
                continue
            num_left = request.num_scheduled_tokens - request.num_computed_tokens
            if num_left == 1:
                decodes.append(request)
            elif num_left > 1:
                prefills.append(request)
            if request.num_computed_tokens < request.media_end:
                # The spans the steps before compute: their entries are not needed now.
                # `update` releases them, but a step launched ahead is planned before it,
                # and a request waited for room its own last chunk held (fuzz50).
                release_media(self.encoder_cache, request, everything=False)
        waiting_for_media: list[Request] = []
        for request in decodes + prefills:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            start = request.num_computed_tokens
            num_tokens = self._plan_chunk(request, start, budget, to_encode, encoder_budget[0])
            if num_tokens == 0:  # its next item has no encoder room yet
                waiting_for_media.append(request)
                continue
            if self._allocate_or_preempt(request, num_tokens, scheduled, preempted):
                run(request, start, num_tokens)
        holding = [r for r in waiting_for_media if r.status == RequestStatus.RUNNING
                   and cached_only_hashes(r)]  # fmt: skip
        if holding and not chunks and not sits_out and not preempted:
            # No running request moves, and none will free encoder room: each holds entries
            # (uuid-only items) another needs the room of. Preempting one lets the others
            # go on (fuzz49). Its own uuid-only entries are evicted last, but they are the
            # only room that can come free here, so it most likely fails with
            # unknown_media_uuid when it runs again (fuzz71's test shows it). Only then: a
            # request waiting on a part-way span of another, which a KV preemption had
            # just freed, was preempted too, and the two took turns for ever (fuzz50).
            victim = self._victim(holding)
            self._preempt(victim)
            preempted.append(victim.request_id)

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.request_id in preempted or request.num_pending_tokens:
                break  # do not readmit what this step preempted, nor before its token is known
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_tokens = self._plan_chunk(request, num_cached, budget, to_encode, encoder_budget[0])
            if num_tokens == 0 or not self.kv.allocate_slots(request, num_tokens, computed_blocks):
                break
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.scheduled_time = request.scheduled_time or time.monotonic()
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                if self.kv.reads_cache_for(request):  # as vLLM: only lookups that happen
                    self.counters.prefix_cache_queries += request.num_prompt_tokens
                    self.counters.prefix_cache_hits += num_cached
            run(request, num_cached, num_tokens)

        return SchedulerOutput(
            chunks=chunks,
            media_to_encode=list(to_encode.values()),
            evicted_encoder_hashes=self.encoder_cache.pop_evicted(),
            preempted_request_ids=preempted,
            newly_cached_block_ids=self.kv.pop_newly_cached(),
        )

    def _plan_chunk(
        self,
        request: Request,
        start: int,
        budget: int,
        to_encode: dict[str, MediaItem],
        encoder_budget: int,
    ) -> int:
        """How many tokens from `start` fit the budgets and the media rules (may be 0)."""
        end = min(start + budget, request.num_scheduled_tokens)
        if start >= request.media_end:  # past every media span (every decode)
            return end - start
        end = chunk_end_for_media(request, start, end, self.encoder_cache, to_encode,
                                  encoder_budget, split_media=self.config.split_media)  # fmt: skip
        return end - start

    def _commit_media(
        self,
        request: Request,
        start: int,
        end: int,
        to_encode: dict[str, MediaItem],
        encoder_budget: list[int],
    ) -> None:
        """References (or accounts and queues for encoding) the media a chunk touches, and
        from its first chunk on the entries only the cache can serve it (uuid-only items,
        held while it runs: a first chunk's new items evicted the request's own uuid-only
        entry further on, and it failed as "evicted": fuzz49)."""
        overlapping = request.media_overlapping(start, end)
        held = [m.content_hash for m in overlapping] + sorted(cached_only_hashes(request))
        for content_hash in held:  # existing entries first, so allocation cannot evict them
            if self.encoder_cache.has(content_hash):
                if not self.encoder_cache.is_referenced_by(content_hash, request.request_id):
                    self.encoder_cache.acquire(content_hash, request.request_id)
                    self.counters.encoder_cache_queries += 1
                    self.counters.encoder_cache_hits += 1
        for media in overlapping:
            queued = to_encode.get(media.content_hash)
            if queued is not None and _has_input(media) and not _has_input(queued):
                # An earlier request's uuid-only item was queued for this entry (evicted
                # while it waited), and this one sent the pixels: encode these, or both
                # requests failed as "evicted" (fuzz50).
                to_encode[media.content_hash] = media
        spare: set[str] | None = None
        for media in overlapping:
            if not self.encoder_cache.has(media.content_hash):
                if spare is None:
                    spare = self._needed_cached_only()
                self.encoder_cache.allocate(
                    media.content_hash, media.num_tokens, request.request_id, spare=spare
                )
                to_encode[media.content_hash] = media
                encoder_budget[0] -= media.num_tokens
                self.counters.encoder_cache_queries += 1

    def _needed_cached_only(self) -> set[str]:
        """Entries that requests not running yet (or preempted) need as cached-only items:
        evicted last, as they cannot be encoded again. Never held for them, though: a
        waiting request holding room could stall the running one that needs it."""
        return {h for request in self.waiting for h in cached_only_hashes(request)}

    def _pending_token_ends(self, request: Request) -> bool:
        """Its in-flight tokens finish it by length (max_tokens, the context): nothing more
        to schedule."""
        if not request.num_pending_tokens:
            return False
        num_outputs = request.num_output_tokens + request.num_pending_tokens
        return (
            num_outputs >= request.sampling.max_tokens
            or request.num_scheduled_tokens >= self.max_model_len
        )

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, scheduled: set[str], preempted: list[str]
    ) -> bool:
        while not self.kv.allocate_slots(request, num_tokens):
            victim = self._victim([r for r in self.running if r.request_id not in scheduled])
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _make_room_for_the_urgent(self, budget: int, preempted: list[str]) -> None:
        """Preempts the least urgent running requests while the most urgent waiting one is
        more urgent (a strictly lower priority value) and could not start otherwise."""
        while self.waiting and self.running:
            head = self.waiting.peek()
            victim = max(self.running, key=lambda r: r.urgency)
            if victim.priority <= head.priority or head.num_pending_tokens:
                return
            first_chunk = min(head.num_scheduled_tokens, budget)
            seats_taken = len(self.running) >= self.config.max_num_seqs
            if not seats_taken and self.kv.num_free_blocks >= self.kv.num_blocks_for(first_chunk):
                return
            self._preempt(victim)
            preempted.append(victim.request_id)

    def _victim(self, candidates: list[Request]) -> Request:
        """Which of `candidates` (running, in admission order) to preempt: the least urgent
        under the priority policy, else the most recently admitted."""
        if self.is_priority:
            return max(candidates, key=lambda r: r.urgency)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        release_media(self.encoder_cache, request, everything=True)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.push_front(request)
        self.counters.num_preemptions += 1

    # ---- update --------------------------------------------------------------------------

    def update(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        logprobs: dict[str, TokenLogprob] | None = None,
        errors: dict[str, ErrorInfo] | None = None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] | None = None,
    ) -> list[RequestOutput]:
        """Appends sampled tokens, finishes requests that hit a stop condition."""
        outputs = []
        logprobs = logprobs or {}
        for request_id, (first_index, scores) in (prompt_logprobs or {}).items():
            request = self.requests.get(request_id)
            skip = len(request.prompt_logprobs) + 1 - first_index if request else -1
            if skip >= 0:  # tokens scored already (before a preemption) are skipped
                request.prompt_logprobs += scores[skip:]  # type: ignore[union-attr]
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if chunk.samples:
                request.num_pending_tokens -= 1  # arrived (or never will: errors, aborts)
            if request.is_finished:
                continue
            if errors and request.request_id in errors:
                request.error = errors[request.request_id]
                self._finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(request_output(request, []))
                continue
            if chunk.start < request.media_end:  # else an earlier update released them all
                release_media(self.encoder_cache, request, everything=False)
            if not chunk.samples:
                continue  # mid-prefill: no token this step
            token_id = sampled_token_ids[request.request_id]
            grammar = request.grammar if request.grammar_active else None
            if grammar is not None and (grammar.error is not None or not grammar.accept(token_id)):
                # The grammar ran out of its limits, or min_tokens / stop-token bans left
                # nothing it allows, or its mask found no way on (then it allows only EOS,
                # which it takes): the request fails, without the token.
                request.error = grammar_failure(request.grammar.error, request.sampling)
                self._finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(request_output(request, []))
                continue
            request.output_token_ids.append(token_id)
            request.note_output_token()
            self.counters.generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
                self.counters.prompt_tokens += request.num_prompt_tokens
                self.counters.cached_prompt_tokens += request.num_cached_tokens
            token_logprob = logprobs.get(request.request_id)
            status = stop_status(request, token_id, self.max_model_len)
            if status is not None:
                self._finish(request, status)
            step_logprobs = [token_logprob] if token_logprob is not None else None
            outputs.append(request_output(request, [token_id], step_logprobs))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request, keep_cached=status != RequestStatus.FINISHED_ERROR)
        release_media(self.encoder_cache, request, everything=True)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(request.request_id, None)


def _has_input(media: MediaItem) -> bool:
    """Pixels or fetched features the runner can encode the item from."""
    return media.pixel_values is not None or media.embeds is not None
