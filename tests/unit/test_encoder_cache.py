"""Encoder cache accounting: LRU among unreferenced entries, budget growth, and the
scheduler's reference rules for chunks that end inside media spans."""

import logging

import msgspec
import pytest

from engine.config import EngineConfig
from engine.encoder_cache import EncoderCache, EncoderCacheManager
from engine.errors import MediaError
from engine.protocol import SamplingParams
from engine.request import MediaItem, Request
from engine.scheduler import Scheduler


def make_scheduler(**options) -> Scheduler:
    config = EngineConfig(model="unused", block_size=4, enable_prefix_caching=False, **options)
    return Scheduler(config, num_kv_blocks=64, max_model_len=1000)


def image(offset: int, num_tokens: int, content_hash: str) -> MediaItem:
    return MediaItem("image", content_hash, offset, num_tokens, (1, 2, 2 * num_tokens))


def make_request(request_id: str, num_prompt: int, media, max_tokens: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id, list(range(1, num_prompt + 1)), params, media=media)


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    scheduler.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    return out


def run_to_end(scheduler: Scheduler) -> list:
    outs = []
    while scheduler.has_unfinished_requests():
        outs.append(step(scheduler))
        assert scheduler.encoder_cache.num_used_tokens <= scheduler.encoder_cache.budget_tokens
    return outs


def test_lru_evicts_only_unreferenced_entries_oldest_first():
    manager = EncoderCacheManager(10)
    manager.allocate("a", 4, "r1")
    manager.allocate("b", 4, "r2")
    manager.release("a", "r1")
    manager.release("b", "r2")
    manager.acquire("a", "r3")  # a is needed again: no longer evictable
    assert manager.can_allocate(6) and not manager.can_allocate(7)
    manager.allocate("c", 6, "r3")
    assert manager.pop_evicted() == ["b"]
    assert manager.has("a") and manager.has("c") and not manager.has("b")
    assert manager.num_used_tokens == 10
    manager.allocate("d", 4, "r4")  # nothing evictable: over budget rather than evict a or c
    assert manager.pop_evicted() == []


def test_usage_is_the_share_of_the_budget_entries_hold_until_evicted_or_forgotten():
    """tessera:encoder_cache_usage_perc: there was no way to see the cache fill."""
    manager = EncoderCacheManager(10)
    assert manager.usage == 0.0
    manager.allocate("a", 4, "r1")
    manager.release("a", "r1")
    assert manager.usage == 0.4  # unreferenced, still held for reuse
    manager.allocate("b", 8, "r2")  # evicts a
    assert manager.usage == 0.8
    manager.forget(["b"])
    assert manager.usage == 0.0 and EncoderCacheManager(0).usage == 0.0


def test_can_allocate_does_not_count_entries_the_chunk_keeps():
    manager = EncoderCacheManager(10)
    manager.allocate("x", 6, "r1")
    manager.release("x", "r1")
    assert manager.can_allocate(6)
    assert not manager.can_allocate(6, keep={"x"})


def test_tensor_store_drops_evicted_hashes():
    store = EncoderCache()
    store.put("a", 1)
    store.put("b", 2)
    store.drop(["a", "missing"])
    assert "a" not in store and store.get("b") == 2


def test_item_larger_than_every_budget_runs_and_budget_grows(caplog):
    scheduler = make_scheduler(encoder_cache_tokens=8, max_encoder_tokens_per_step=4)
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        scheduler.add_request(make_request("big", 40, [image(2, 30, "big")]))
    assert scheduler.encoder_cache.budget_tokens == 30
    assert scheduler.max_encoder_tokens_per_step == 30
    assert "encoder_cache_tokens=8" in caplog.text
    assert "max_encoder_tokens_per_step=4" in caplog.text
    outs = run_to_end(scheduler)
    assert [m.content_hash for out in outs for m in out.media_to_encode] == ["big"]


def test_chunk_hit_is_not_counted_as_room_for_a_new_item():
    # Regression: a cached entry the chunk reads was counted as evictable room, so a
    # second item was allocated alongside it and the budget overflowed.
    scheduler = make_scheduler(encoder_cache_tokens=10)
    scheduler.add_request(make_request("a", 10, [image(2, 6, "x")]))
    run_to_end(scheduler)
    scheduler.add_request(make_request("b", 20, [image(2, 6, "x"), image(8, 6, "y")]))
    first = step(scheduler)
    assert (first.chunks[0].start, first.chunks[0].num_tokens) == (0, 8)  # stops before y
    assert first.media_to_encode == []
    second = step(scheduler)
    assert [m.content_hash for m in second.media_to_encode] == ["y"]
    assert second.evicted_encoder_hashes == ["x"]
    run_to_end(scheduler)


def run_bounded(scheduler: Scheduler, max_steps: int = 100) -> list:
    """run_to_end, failing rather than spinning when the requests stop making progress."""
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outs
        outs.append(step(scheduler))
        assert scheduler.encoder_cache.num_used_tokens <= scheduler.encoder_cache.budget_tokens
    raise AssertionError(f"still unfinished after {max_steps} steps: {scheduler.running}")


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "big-cached-before"])
def test_a_new_item_before_a_cached_one_that_cannot_stay_beside_it_still_runs(warm):
    """Every cached entry of the chunk was kept from its start: the small new item before
    the cached big one could not fit beside it, the chunk ended at the small item's start,
    0 tokens every step for ever; queued first, the request stalled every request behind
    it (fuzz46). Now the chunk ends before the cached item, which is encoded again later."""
    scheduler = make_scheduler(encoder_cache_tokens=20, max_num_batched_tokens=64)
    if warm:
        run_to_end_with(scheduler, make_request("warm", 24, [image(2, 18, "big")]))
        media = [image(2, 4, "small"), image(8, 18, "big")]
    else:
        media = [image(2, 18, "big"), image(22, 4, "small"), image(28, 18, "big")]
    scheduler.add_request(make_request("mixed", 60, media))
    scheduler.add_request(make_request("text", 8, []))  # queued behind it
    encoded = [m.content_hash for out in run_bounded(scheduler) for m in out.media_to_encode]
    assert encoded == (["small", "big"] if warm else ["big", "small", "big"])


def test_same_image_twice_stays_referenced_while_its_second_span_is_part_done():
    # Regression: finishing the first span released the hash while the second span of
    # the same image was still part-way, so another request could evict it.
    scheduler = make_scheduler(encoder_cache_tokens=12, max_num_batched_tokens=12)
    request = make_request("r", 30, [image(2, 6, "h"), image(10, 6, "h")])
    scheduler.add_request(request)
    first = step(scheduler)  # tokens 0..12: first span done, second span at 2 of 6
    assert [m.content_hash for m in first.media_to_encode] == ["h"]
    assert scheduler.encoder_cache.is_referenced_by("h", "r")
    step(scheduler)  # 12..24: second span done
    assert not scheduler.encoder_cache.is_referenced_by("h", "r")
    run_to_end(scheduler)


def test_counts_queries_and_hits_per_item_across_requests():
    scheduler = make_scheduler()
    for index, content_hash in enumerate(["p", "q", "p", "p", "q"]):
        scheduler.add_request(make_request(f"r{index}", 12, [image(2, 4, content_hash)]))
    out = scheduler.schedule()
    assert sorted(m.content_hash for m in out.media_to_encode) == ["p", "q"]
    counters = scheduler.pop_counters()
    assert (counters.encoder_cache_queries, counters.encoder_cache_hits) == (5, 3)


def cached_only(offset: int, num_tokens: int, content_hash: str) -> MediaItem:
    """A part with neither pixels nor features (a uuid-only part): only its cached
    encoding can serve it."""
    item = image(offset, num_tokens, content_hash)
    item.cached_only = True
    return item


def test_an_entry_a_waiting_uuid_only_request_needs_is_evicted_last():
    """A uuid-only part was checked on arrival, then evicted oldest first by a request
    scheduled before it, and the accepted request failed ('no pixels and no cached
    encoding'). Now another entry makes the room."""
    scheduler = make_scheduler(encoder_cache_tokens=12)
    run_to_end_with(scheduler, make_request("warm", 8, [image(2, 4, "uuid:u1")]))
    run_to_end_with(scheduler, make_request("newer", 8, [image(2, 4, "w")]))
    scheduler.add_request(make_request("other", 12, [image(2, 8, "v")]))  # needs 4 more
    scheduler.add_request(make_request("only", 8, [cached_only(2, 4, "uuid:u1")]))
    encoded = [m.content_hash for out in run_to_end(scheduler) for m in out.media_to_encode]
    assert encoded == ["v"] and scheduler.encoder_cache.has("uuid:u1")
    assert not scheduler.encoder_cache.has("w")


def test_a_running_request_keeps_its_cached_only_item_until_it_finishes():
    """A computed span released its reference: evicted while the request decoded, the
    item was gone when a preemption needed it again (the stream ended with an error)."""
    scheduler = make_scheduler(encoder_cache_tokens=12)
    run_to_end_with(scheduler, make_request("warm", 8, [image(2, 4, "uuid:u1")]))
    only = make_request("only", 8, [cached_only(2, 4, "uuid:u1")], max_tokens=20)
    scheduler.add_request(only)
    step(scheduler)  # its whole prompt, the span computed
    scheduler.add_request(make_request("other", 12, [image(2, 8, "v")]))
    encoded = [m.content_hash for m in step(scheduler).media_to_encode]  # beside its decode
    assert encoded == ["v"] and scheduler.encoder_cache.is_referenced_by("uuid:u1", "only")
    run_to_end(scheduler)
    assert not scheduler.encoder_cache.is_referenced_by("uuid:u1", "only")


def test_a_waiting_uuid_only_request_never_stalls_the_running_one():
    """Held from admission, the entry of a queued uuid-only request left no room for the
    running request's own image, which the queued one waited behind: neither moved. Now
    the running one takes the room; the queued one finds its encoding gone."""
    scheduler = make_scheduler(encoder_cache_tokens=8, max_num_seqs=1, max_num_batched_tokens=8)
    run_to_end_with(scheduler, make_request("warm", 8, [image(2, 8, "uuid:u1")]))
    running = make_request("running", 40, [image(30, 8, "v")])
    scheduler.add_request(running)
    step(scheduler)  # its text first: the image comes in a later chunk
    scheduler.add_request(make_request("only", 12, [cached_only(2, 8, "uuid:u1")]))
    for _ in range(50):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
    assert running.is_finished and not scheduler.has_unfinished_requests()


def test_uuid_only_items_that_leave_no_room_for_the_others_are_refused():
    """Held while the request runs, they left no room for its own image after them: the
    chunk could never start (0 tokens each step, and first in the queue, every request
    behind it waited)."""
    scheduler = make_scheduler(encoder_cache_tokens=20)
    run_to_end_with(scheduler, make_request("warm", 24, [image(2, 16, "uuid:u1")]))
    too_many = make_request("only", 40, [cached_only(2, 16, "uuid:u1"), image(20, 8, "v")])
    with pytest.raises(MediaError, match="--encoder-cache-tokens") as refused:
        scheduler.add_request(too_many)
    assert refused.value.status == 400 and not scheduler.has_unfinished_requests()
    fits = make_request("fits", 40, [cached_only(2, 16, "uuid:u1"), image(20, 4, "v")])
    scheduler.add_request(fits)
    assert [m.content_hash for out in run_bounded(scheduler) for m in out.media_to_encode] == ["v"]


def test_a_request_never_evicts_its_own_uuid_only_entry():
    """Its first chunk's new items took the room of its own uuid-only entry further on,
    and the request failed as "evicted" (fuzz49): the entry is held from its first chunk."""
    scheduler = make_scheduler(encoder_cache_tokens=20, max_num_batched_tokens=64)
    run_to_end_with(scheduler, make_request("warm", 12, [image(2, 8, "uuid:u1")]))
    media = [image(2, 8, "a"), image(12, 8, "b"), cached_only(22, 8, "uuid:u1")]
    scheduler.add_request(make_request("r", 40, media))
    outs = run_bounded(scheduler)
    assert all(not m.cached_only for out in outs for m in out.media_to_encode)
    assert "uuid:u1" not in [h for out in outs for h in out.evicted_encoder_hashes]


def test_running_requests_holding_uuid_only_entries_do_not_wait_on_each_other():
    """Each held its uuid-only entry and needed room the other's held: neither moved, for
    ever (fuzz49). One is preempted, the other goes on, then it runs again."""
    scheduler = make_scheduler(encoder_cache_tokens=20, max_num_batched_tokens=16,
                               split_media=False)  # fmt: skip
    run_to_end_with(scheduler, make_request("warm1", 8, [image(0, 6, "uuid:u1")]))
    run_to_end_with(scheduler, make_request("warm2", 8, [image(0, 6, "uuid:u2")]))
    first = make_request("a", 24, [cached_only(0, 6, "uuid:u1"), image(8, 10, "x")])
    second = make_request("b", 24, [cached_only(0, 6, "uuid:u2"), image(8, 10, "y")])
    scheduler.add_request(first)
    scheduler.add_request(second)
    run_bounded(scheduler, max_steps=30)
    assert first.error is None and second.error is None
    assert scheduler.counters.num_preemptions == 1


def test_a_cached_only_item_evicted_before_admission_is_refused():
    scheduler = make_scheduler(encoder_cache_tokens=10)
    with pytest.raises(MediaError) as refused:
        scheduler.add_request(make_request("only", 8, [cached_only(2, 4, "uuid:u1")]))
    assert refused.value.code == "unknown_media_uuid"
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("salt", [None, "tenant|a:1"])
def test_an_evicted_uuid_is_named_as_the_client_sent_it_under_a_salt_too(salt):
    """The salted key ("salt10:tenant|a:1|uuid:u@1@image:1x2x2") went into the message
    whole, and the model runner took it for no uuid at all (a generic "no pixels" error).
    A uuid holding "@" was cut at it."""
    from engine.encoder_cache import salted, uuid_of

    key = salted("uuid:u@1@image:1x2x2", salt)
    assert uuid_of(key) == "u@1" and uuid_of(salted("f00d", salt)) is None
    scheduler = make_scheduler(encoder_cache_tokens=10)
    with pytest.raises(MediaError) as refused:
        scheduler.add_request(make_request("only", 8, [cached_only(2, 4, key)]))
    assert refused.value.code == "unknown_media_uuid"
    assert refused.value.message.startswith("unknown media uuid 'u@1': ")


@pytest.mark.parametrize("uuid", ["V1", "a/t0@b"])
def test_a_video_patchs_key_names_the_clients_uuid(uuid):
    """Each temporal patch's key had "/t0" inside the uuid: the error of an evicted one
    named "V1/t0" for the client's "V1" (fuzz46)."""
    from engine.encoder_cache import uuid_of
    from engine.protocol import MediaInput, Modality
    from engine.request_checks import _cache_key

    patch = MediaInput(modality=Modality.VIDEO, content_hash=f"uuid:{uuid}", offset=0,
                       num_tokens=4, grid_thw=(1, 4, 4), frame=3)  # fmt: skip
    other = msgspec.structs.replace(patch, frame=4)
    assert uuid_of(_cache_key(patch, None)) == uuid == uuid_of(_cache_key(patch, "s"))
    assert _cache_key(patch, None) != _cache_key(other, None)  # each patch its own rows


def test_an_entry_whose_rows_never_came_is_forgotten():
    """An item whose encode failed stayed accounted: a later request with its pixels was a
    'hit' with no rows, and failed."""
    manager = EncoderCacheManager(10)
    manager.allocate("x", 4, "r1")
    manager.forget(["x", "never-seen"])
    assert not manager.has("x") and manager.num_used_tokens == 0
    manager.release("x", "r1")  # the failed request's reference is gone with it
    manager.allocate("x", 4, "r2")
    assert manager.has("x") and manager.num_used_tokens == 4


def run_to_end_with(scheduler: Scheduler, request: Request) -> None:
    scheduler.add_request(request)
    run_to_end(scheduler)


def test_a_request_waiting_on_a_shared_part_way_image_is_not_preempted_with_its_holder():
    """b held x part-way and preempted itself for KV blocks, which freed x; the step had no
    chunk, so a, waiting for room, was preempted too, and the two took turns for ever
    (fuzz50). Only requests holding uuid-only entries are preempted for encoder room."""
    config = EngineConfig(model="unused", block_size=4, enable_prefix_caching=False,
                          encoder_cache_tokens=10, max_num_batched_tokens=16)  # fmt: skip
    scheduler = Scheduler(config, num_kv_blocks=5, max_model_len=1000)
    scheduler.add_request(make_request("a", 16, [image(0, 10, "x"), image(12, 3, "y")]))
    scheduler.add_request(make_request("b", 11, [image(0, 10, "x")]))
    run_bounded(scheduler, max_steps=30)


def test_a_step_launched_ahead_finds_the_room_of_spans_already_scheduled():
    """Overlap scheduling plans step N+1 before step N's results release its spans: the
    request waited for room its own last chunk held, and preempted itself every other step
    (fuzz50). The order here is EngineCore.step_overlapped's."""
    scheduler = make_scheduler(encoder_cache_tokens=14, max_num_batched_tokens=32)
    request = make_request("r", 20, [image(0, 6, "x"), image(7, 9, "y")])
    scheduler.add_request(request)
    in_flight = scheduler.schedule()
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        ahead = scheduler.schedule()  # launched before in_flight's tokens are known
        done = {c.request.request_id: 5 for c in in_flight.chunks if c.samples}
        scheduler.update(in_flight, done)
        assert not ahead.preempted_request_ids
        in_flight = ahead
    scheduler.update(in_flight, {c.request.request_id: 5 for c in in_flight.chunks if c.samples})
    assert request.is_finished and request.num_preemptions == 0


def test_pixels_sent_for_an_entry_a_uuid_only_item_queued_are_the_ones_encoded():
    """A uuid-only item whose entry was evicted while it waited was queued for encoding
    with no pixels, and a request in the same step that sent the uuid's pixels only
    referenced it: both failed as "evicted" (fuzz50)."""
    import torch

    scheduler = make_scheduler(encoder_cache_tokens=8, max_num_batched_tokens=16)
    run_to_end_with(scheduler, make_request("warm", 8, [image(2, 4, "uuid:u1")]))
    scheduler.add_request(make_request("big", 10, [image(0, 8, "v")]))  # evicts u1
    scheduler.add_request(make_request("only", 6, [cached_only(0, 4, "uuid:u1")]))
    step(scheduler)
    sent = image(2, 4, "uuid:u1")
    sent.pixel_values = torch.zeros(16, 12)
    scheduler.add_request(make_request("sent", 8, [sent]))
    for _ in range(20):
        out = scheduler.schedule()
        if out.media_to_encode:
            break
        scheduler.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    assert [m.pixel_values is sent.pixel_values for m in out.media_to_encode] == [True]
