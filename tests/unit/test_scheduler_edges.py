"""Scheduler rules no other test pinned (mutation testing): decode order after a stalled
prefill, no prefix-cache entry for a request that failed in `update`, prefix-cache counters
across a preemption, the context's last in-flight token, and uuid-only room."""

from __future__ import annotations

import pytest

from engine.errors import MediaError
from engine.protocol import ErrorInfo
from tests.unit.test_encoder_cache import cached_only, run_to_end_with
from tests.unit.test_encoder_cache import image as media_image
from tests.unit.test_encoder_cache import make_request as media_request
from tests.unit.test_encoder_cache import make_scheduler as media_scheduler
from tests.unit.test_scheduler import image, make_request, make_scheduler, sample_all


def test_a_decode_admitted_after_a_stalled_prefill_still_goes_first():
    # "a" (admitted first) stops before its image span (split_media=False), so "b" fits
    # beside it and starts decoding; next step "b"'s decode must come before "a"'s prefill
    # takes the whole budget (not decodes and prefills in admission order).
    scheduler = make_scheduler(max_num_batched_tokens=8, split_media=False)
    scheduler.add_request(make_request("a", 20, media=[image(4, 8)]))
    scheduler.add_request(make_request("b", 2))
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 4), ("b", 2)]
    sample_all(scheduler, out)
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks][0] == ("b", 1)


def test_a_request_that_fails_in_update_leaves_no_blocks_in_the_prefix_cache():
    # the runner reported an error for "a" (its KV this step is garbage): a later
    # request with the same prompt must not reuse a.'s blocks.
    scheduler = make_scheduler(enable_prefix_caching=True)
    scheduler.add_request(make_request("a", 12))
    out = scheduler.schedule()
    scheduler.update(out, {}, errors={"a": ErrorInfo("encoder failed")})
    again = make_request("b", 12)
    assert scheduler.kv.get_computed_blocks(again) == ([], 0)


def test_a_preempted_request_is_counted_once_in_the_prefix_cache_counters():
    # readmission after a preemption is no new lookup: the counters and the
    # request's cached-token count (usage.prompt_tokens_details) keep the first admission's.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    sample_all(scheduler, scheduler.schedule())
    cached_at_admission = b.num_cached_tokens  # 4: a's first block, registered that step
    out = scheduler.schedule()
    assert out.preempted_request_ids == ["b"]
    sample_all(scheduler, out)
    while b.num_preemptions == 1 and b.status.name != "RUNNING":
        sample_all(scheduler, scheduler.schedule())
        if not scheduler.has_unfinished_requests():
            break
    counters = scheduler.pop_counters()
    assert counters.prefix_cache_queries == 16  # 8 + 8, b's readmission not counted again
    assert b.status.name == "RUNNING" and b.num_preemptions == 1
    assert b.num_cached_tokens == cached_at_admission


def test_a_request_whose_in_flight_token_reaches_the_context_is_not_scheduled_again():
    # max_tokens past the context (the engine caps at max_model_len); with overlap
    # scheduling the step whose in-flight token is the context's last must not be followed
    # by another row (its position would be past max_model_len).
    scheduler = make_scheduler(max_model_len=12)
    request = make_request("a", 10, max_tokens=8)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in second.chunks] == [(10, 1)]
    third = scheduler.schedule()
    assert third.chunks == []
    sample_all(scheduler, first)
    outputs = sample_all(scheduler, second)
    assert outputs[0].finish_reason is not None


def test_uuid_only_media_one_token_over_the_encoder_cache_are_refused():
    # 16 held + 5 = 21 > 20 could never start: refused at add_request, not stalled
    scheduler = media_scheduler(encoder_cache_tokens=20)
    run_to_end_with(scheduler, media_request("warm", 24, [media_image(2, 16, "uuid:u1")]))
    with pytest.raises(MediaError, match="--encoder-cache-tokens"):
        scheduler.add_request(
            media_request("only", 40, [cached_only(2, 16, "uuid:u1"), media_image(20, 5, "v")])
        )
