"""Scheduler: budgets, decode-first, chunking, preemption, abort, media-span rules."""

import pytest

from engine.config import EngineConfig
from engine.errors import ContextLengthExceeded
from engine.protocol import ErrorInfo, FinishReason, SamplingParams
from engine.request import MediaItem, Request, RequestStatus
from engine.scheduler import Scheduler


def make_scheduler(num_blocks=64, block_size=4, max_model_len=1000, **options) -> Scheduler:
    options.setdefault("enable_prefix_caching", False)
    config = EngineConfig(model="unused", block_size=block_size, **options)
    return Scheduler(config, num_kv_blocks=num_blocks, max_model_len=max_model_len)


def make_request(request_id, num_prompt, max_tokens=8, media=None, eos=()) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(
        request_id, list(range(1, num_prompt + 1)), params, media=media, eos_token_ids=eos
    )


def sample_all(scheduler, out, token=5):
    tokens = {c.request.request_id: token for c in out.chunks if c.samples}
    return scheduler.update(out, tokens)


def test_prefill_then_decode_and_finish_on_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", 10, max_tokens=3)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in out.chunks] == [
        ("a", 0, 10, True)
    ]
    assert sample_all(scheduler, out)[0].new_token_ids == [5]
    for expected_finish in (None, FinishReason.LENGTH):
        out = scheduler.schedule()
        assert [(c.start, c.num_tokens) for c in out.chunks] == [(request.num_tokens - 1, 1)]
        assert sample_all(scheduler, out)[0].finish_reason == expected_finish
    assert request.output_token_ids == [5, 5, 5]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == 64


def test_eos_and_stop_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 4, eos=(5,)))
    params = SamplingParams(max_tokens=8, stop_token_ids=(5,), ignore_eos=True)
    scheduler.add_request(Request("stop", [1, 2], params, eos_token_ids=(5,)))
    scheduler.add_request(make_request("ignored", 4, eos=(6,)))
    outputs = {o.request_id: o for o in sample_all(scheduler, scheduler.schedule())}
    assert outputs["eos"].finish_reason == FinishReason.STOP
    assert outputs["stop"].finish_reason == FinishReason.STOP
    assert outputs["ignored"].finish_reason is None


def test_decodes_first_and_chunked_prefill_within_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 6))
    out = scheduler.schedule()
    sample_all(scheduler, out)
    scheduler.add_request(make_request("b", 20))
    out = scheduler.schedule()
    # the decode of "a" comes first, then 7 tokens of "b"'s prefill
    assert [(c.request.request_id, c.num_tokens, c.samples) for c in out.chunks] == [
        ("a", 1, True),
        ("b", 7, False),
    ]
    outputs = sample_all(scheduler, out)
    assert [o.request_id for o in outputs] == ["a"]  # mid-prefill produces nothing
    out = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("a", 7, 1),
        ("b", 7, 7),
    ]
    assert out.num_scheduled_tokens <= 8


def test_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preempts_most_recent_and_recomputes_output():
    # 4 blocks of 4: "a" and "b" each need 2 blocks for their 8-token prompts.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    sample_all(scheduler, scheduler.schedule())
    # Both decode token 9 -> each needs a third block: "b" (admitted last) is preempted.
    out = scheduler.schedule()
    assert out.preempted_request_ids == ["b"]
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.output_token_ids == [5] and scheduler.waiting.peek() is b
    assert scheduler.pop_counters().num_preemptions == 1
    sample_all(scheduler, out)
    while a.status == RequestStatus.RUNNING:
        sample_all(scheduler, scheduler.schedule())
    # "a" finished; "b" recomputes prompt + its generated token as one chunk.
    out = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("b", 0, 9)]


def test_abort_frees_blocks():
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("a", 10)
    scheduler.add_request(request)
    scheduler.add_request(make_request("b", 3))
    scheduler.schedule()
    assert scheduler.kv.num_free_blocks < 8
    outputs = scheduler.abort(["a", "b", "missing"])
    assert [o.finish_reason for o in outputs] == [FinishReason.ABORT] * 2
    assert scheduler.kv.num_free_blocks == 8 and not scheduler.has_unfinished_requests()


def test_too_large_for_pool_is_refused():
    scheduler = make_scheduler(num_blocks=4)
    with pytest.raises(ContextLengthExceeded):
        scheduler.add_request(make_request("a", 10, max_tokens=10))


def image(offset, num_tokens, content_hash="img"):
    return MediaItem("image", content_hash, offset, num_tokens, (1, 2, 2 * num_tokens))


def test_split_media_chunk_encodes_once():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    request = make_request("a", 16, media=[image(3, 8)])
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.chunks[0].num_tokens == 6  # ends inside the span [3, 11)
    assert [m.content_hash for m in out.media_to_encode] == ["img"]
    sample_all(scheduler, out)
    out = scheduler.schedule()
    assert out.chunks[0].num_tokens == 6 and out.media_to_encode == []


def test_no_split_media_stops_before_span_or_makes_progress():
    scheduler = make_scheduler(max_num_batched_tokens=6, split_media=False)
    request = make_request("a", 20, media=[image(3, 8)])
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.chunks[0].num_tokens == 3 and out.media_to_encode == []  # stops before span
    sample_all(scheduler, out)
    out = scheduler.schedule()
    # the span starts the chunk and exceeds the budget: progress anyway
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (3, 6)
    assert len(out.media_to_encode) == 1


def test_encoder_budget_per_step_defers_second_image():
    scheduler = make_scheduler(max_encoder_tokens_per_step=8)
    scheduler.add_request(make_request("a", 30, media=[image(2, 8, "x"), image(12, 8, "y")]))
    out = scheduler.schedule()
    assert out.chunks[0].num_tokens == 12  # stops before the second image
    assert [m.content_hash for m in out.media_to_encode] == ["x"]
    sample_all(scheduler, out)
    out = scheduler.schedule()
    assert [m.content_hash for m in out.media_to_encode] == ["y"]
    assert out.chunks[0].num_tokens == 18


def test_same_image_in_two_requests_encoded_once():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 12, media=[image(2, 4, "same")]))
    scheduler.add_request(make_request("b", 12, media=[image(2, 4, "same")]))
    out = scheduler.schedule()
    assert len(out.media_to_encode) == 1 and len(out.chunks) == 2
    counters = scheduler.pop_counters()
    assert (counters.encoder_cache_queries, counters.encoder_cache_hits) == (2, 1)


def test_prefix_cache_hit_skips_tokens():
    scheduler = make_scheduler(enable_prefix_caching=True)
    scheduler.add_request(make_request("a", 10, max_tokens=1))
    sample_all(scheduler, scheduler.schedule())
    second = make_request("b", 10, max_tokens=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (8, 2)
    scheduler.pop_counters()
    outputs = sample_all(scheduler, out)
    assert outputs[0].num_cached_tokens == 8
    # Counted with the prompt, at the first token (fuzz106: the server counted them at the
    # finish, so a scrape between the two read more prompt than was cached, then less).
    counters = scheduler.pop_counters()
    assert (counters.prompt_tokens, counters.cached_prompt_tokens) == (10, 8)


def test_scheduling_ahead_of_in_flight_tokens():
    """Overlap scheduling: the next step is scheduled before the previous one's tokens
    arrive. A decode takes the in-flight token as input; a request whose in-flight token
    is its last (max_tokens) is not scheduled again; a stop it reveals drops the row."""
    scheduler = make_scheduler()
    long = make_request("long", 6, max_tokens=5, eos=(9,))
    short = make_request("short", 4, max_tokens=2)
    scheduler.add_request(long)
    scheduler.add_request(short)
    first = scheduler.schedule()  # both prefills, each samples its first token
    assert (long.num_pending_tokens, short.num_pending_tokens) == (1, 1)
    second = scheduler.schedule()  # before `first` is read
    assert [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in second.chunks] == [
        ("long", 6, 1, True),  # sequence index 6 is the token `first` is sampling
        ("short", 4, 1, True),
    ]
    assert long.num_computed_tokens == 7 and long.num_tokens == 6
    assert sample_all(scheduler, first)[0].new_token_ids == [5]
    assert short.num_pending_tokens == 1 and scheduler._pending_token_ends(short)
    third = scheduler.schedule()  # `second` in flight: short's token there is its last
    assert [c.request.request_id for c in third.chunks] == ["long"]
    outputs = {o.request_id: o for o in sample_all(scheduler, second, token=9)}  # long's EOS
    assert outputs["long"].finish_reason == FinishReason.STOP
    assert outputs["short"].finish_reason == FinishReason.LENGTH
    assert sample_all(scheduler, third) == []  # the speculative row of a finished request
    assert long.output_token_ids == [5, 9]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == 64


def test_preempted_with_a_token_in_flight_waits_for_it():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first_in = make_request("first", 8, max_tokens=8)
    second_in = make_request("second", 8, max_tokens=8)
    scheduler.add_request(first_in)
    scheduler.add_request(second_in)
    prefill = scheduler.schedule()  # 2 blocks each: the pool is full
    ahead = scheduler.schedule()  # decodes of both: second is preempted for first's block
    assert [c.request.request_id for c in ahead.chunks] == ["first"]
    assert ahead.preempted_request_ids == ["second"]
    assert second_in.num_pending_tokens == 1  # its first token is still in flight
    assert scheduler.waiting.peek() is second_in
    sample_all(scheduler, prefill)  # the token arrives: kept, recomputed on readmission
    assert second_in.output_token_ids == [5] and second_in.num_pending_tokens == 0
    sample_all(scheduler, ahead)
    assert first_in.output_token_ids == [5, 5]


def prioritised(request_id, num_prompt, priority, max_tokens=8) -> Request:
    request = make_request(request_id, num_prompt, max_tokens=max_tokens)
    request.priority = priority
    return request


def test_priority_orders_the_waiting_queue_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for name, priority in (("late", 5), ("urgent", -1), ("normal", 0), ("normal2", 0)):
        scheduler.add_request(prioritised(name, 3, priority))
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.chunks] == ["urgent"]
    assert [r.request_id for r in scheduler.waiting] == ["normal", "normal2", "late"]
    fcfs = make_scheduler(max_num_seqs=1)  # the default: arrival order, priority unused
    for name, priority in (("late", 5), ("urgent", -1)):
        fcfs.add_request(prioritised(name, 3, priority))
    assert [c.request.request_id for c in fcfs.schedule().chunks] == ["late"]


def test_a_more_urgent_arrival_takes_the_seat_of_the_least_urgent():
    scheduler = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    background, batch = prioritised("background", 4, 10), prioritised("batch", 4, 5)
    scheduler.add_request(background)
    scheduler.add_request(batch)
    sample_all(scheduler, scheduler.schedule())
    scheduler.add_request(prioritised("equal", 4, 10))  # no more urgent than either: waits
    out = scheduler.schedule()
    assert out.preempted_request_ids == [] and len(out.chunks) == 2
    sample_all(scheduler, out)
    scheduler.add_request(prioritised("interactive", 4, 0))
    out = scheduler.schedule()
    assert out.preempted_request_ids == ["background"]
    assert {c.request.request_id for c in out.chunks} == {"batch", "interactive"}
    assert background.status == RequestStatus.WAITING and background.output_token_ids == [5, 5]
    # The preempted request keeps its place: before "equal", which came after it.
    assert [r.request_id for r in scheduler.waiting] == ["background", "equal"]


def test_a_more_urgent_arrival_takes_the_blocks_of_the_least_urgent():
    # 4 blocks of 4: "low" holds 3; "high" needs 2 for its prompt.
    scheduler = make_scheduler(num_blocks=4, scheduling_policy="priority")
    low = prioritised("low", 10, 3, max_tokens=4)
    scheduler.add_request(low)
    sample_all(scheduler, scheduler.schedule())
    scheduler.add_request(prioritised("high", 8, 1, max_tokens=4))
    out = scheduler.schedule()
    assert out.preempted_request_ids == ["low"]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("high", 0, 8)]


def test_preemption_for_blocks_picks_the_least_urgent_running_request():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64,
                               scheduling_policy="priority")  # fmt: skip
    a, b, c = prioritised("a", 8, 2), prioritised("b", 8, 7), prioritised("c", 4, 1)
    for request in (a, b, c):
        scheduler.add_request(request)
    sample_all(scheduler, scheduler.schedule())  # 2 + 2 + 1 blocks; 1 free
    # a and b need a third block, c a second: 3 more than the one free. "b" (least
    # urgent) goes first, though "c" came last (FCFS would preempt "c").
    out = scheduler.schedule()
    assert out.preempted_request_ids[0] == "b"
    assert "c" in {chunk.request.request_id for chunk in out.chunks}


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(scheduling_policy="lifo")


def test_a_failed_step_leaves_no_prefix_cache_entry_of_an_aborted_request():
    """Overlap scheduling reads aborts while a step runs: an aborted request's blocks went
    back with their prefix-cache entries, and when the step then failed, the KV it never
    wrote stayed cached for the next request of the same prompt."""
    scheduler = make_scheduler(enable_prefix_caching=True)
    first = make_request("first", 12)
    scheduler.add_request(first)
    out = scheduler.schedule()  # registers its 3 full blocks
    scheduler.abort(["first"])  # while the step runs
    assert scheduler.fail_step(out, ErrorInfo("step failed")) == []
    again = make_request("again", 12)
    scheduler.add_request(again)
    scheduler.schedule()
    assert again.num_cached_tokens == 0
