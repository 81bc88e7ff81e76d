"""The scheduler's encoder-room deadlock breaker (engine/scheduler.py, `holding`): running
requests that hold uuid-only entries and wait for encoder room that only those entries
hold. It preempts one of them, and only when nothing else could free the room: no chunk
moved this step, none sits the step out for its token in flight, and nothing was
preempted already (mutation testing found each of these conditions untested)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.protocol import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler
from tests.unit.test_encoder_cache import (
    cached_only,
    image,
    make_request,
    make_scheduler,
    run_bounded,
    run_to_end_with,
)


def warm(scheduler: Scheduler, *entries: tuple[str, int]) -> None:
    """Puts `content_hash: num_tokens` entries in the encoder cache, as a request that sent
    their pixels earlier did: a uuid-only part may then name them."""
    for content_hash, num_tokens in entries:
        run_to_end_with(scheduler, make_request(f"warm-{content_hash}", num_tokens + 2,
                                                [image(0, num_tokens, content_hash)]))  # fmt: skip


def sample(scheduler: Scheduler, out) -> None:
    scheduler.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})


def test_one_of_three_requests_waiting_on_each_others_uuid_entries_is_preempted():
    """Each holds its uuid-only entry (6 rows) and needs 16 rows for its image, and the
    three entries leave 14 of 32: no chunk can move, and nothing frees room by itself
    (fuzz49). Only the most recently admitted is preempted, which is room enough for the
    first; the second waits while the first moves, and all three end. The room is the
    victim's own entry: no other could be evicted, so the engine ends the victim with
    `unknown_media_uuid` when it runs again (engine/media_encoding.py `no_encoding`)."""
    scheduler = make_scheduler(encoder_cache_tokens=32, max_num_batched_tokens=23,
                               split_media=False)  # fmt: skip
    warm(scheduler, ("uuid:u1", 6), ("uuid:u2", 6), ("uuid:u3", 6))
    requests = [
        make_request(name, 32, [cached_only(0, 6, f"uuid:u{index}"), image(8, 16, f"x{index}")])
        for index, name in enumerate(["a", "b", "c"], start=1)
    ]
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()  # each stops before its image: 8 + 8 + 7 tokens
    assert [(c.request.request_id, c.num_tokens) for c in first.chunks] == [
        ("a", 8), ("b", 8), ("c", 7)
    ]  # fmt: skip
    sample(scheduler, first)
    second = scheduler.schedule()  # c's last text token before its image
    assert [(c.request.request_id, c.num_tokens) for c in second.chunks] == [("c", 1)]
    assert second.preempted_request_ids == []
    sample(scheduler, second)
    stuck = scheduler.schedule()
    assert stuck.chunks == [] and stuck.preempted_request_ids == ["c"]
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    sample(scheduler, stuck)
    moves = scheduler.schedule()
    assert [c.request.request_id for c in moves.chunks] == ["a"]
    assert [m.content_hash for m in moves.media_to_encode] == ["x1"]
    assert moves.evicted_encoder_hashes == ["uuid:u3"]
    sample(scheduler, moves)
    run_bounded(scheduler, max_steps=40)
    assert all(r.is_finished and r.error is None for r in requests)
    assert [r.num_preemptions for r in requests] == [0, 0, 1]


def test_a_request_holding_no_uuid_entry_is_never_the_victim():
    """`a` and `b` hold uuid-only entries (10 rows each of 32) and each needs 16 rows; `c`,
    admitted last, sent its image's pixels and waits for room too. Preempting `c` would
    free nothing, and the step after would still have to preempt `b`: only a request
    holding an entry another needs the room of is a candidate."""
    scheduler = make_scheduler(encoder_cache_tokens=32, max_num_batched_tokens=23,
                               split_media=False)  # fmt: skip
    warm(scheduler, ("uuid:u1", 10), ("uuid:u2", 10))
    a = make_request("a", 32, [cached_only(0, 10, "uuid:u1"), image(12, 16, "x1")])
    b = make_request("b", 32, [cached_only(0, 10, "uuid:u2"), image(12, 16, "x2")])
    c = make_request("c", 32, [image(12, 16, "y")])
    for request in (a, b, c):
        scheduler.add_request(request)
    planned = []
    for _ in range(3):  # a, b and c each up to its image: 12 tokens
        out = scheduler.schedule()
        planned.append([(chunk.request.request_id, chunk.num_tokens) for chunk in out.chunks])
        sample(scheduler, out)
    assert planned == [[("a", 12), ("b", 11)], [("b", 1), ("c", 12)], []]
    assert out.preempted_request_ids == ["b"]
    assert scheduler.running == [a, c]
    run_bounded(scheduler, max_steps=60)
    assert a.is_finished and b.is_finished and c.is_finished
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 0)


def test_a_request_waiting_on_room_a_moving_chunk_frees_is_not_preempted():
    """`a` holds its uuid-only entry and waits for room that `p`'s image holds part-way;
    `p`'s chunk moves this step and releases the image when its span is done. Preempting
    `a` would only throw its progress away: it waits a step, and runs."""
    scheduler = make_scheduler(encoder_cache_tokens=20, max_num_batched_tokens=12,
                               split_media=False)  # fmt: skip
    warm(scheduler, ("uuid:u1", 6))
    a = make_request("a", 20, [cached_only(0, 6, "uuid:u1"), image(8, 8, "x")])
    p = make_request("p", 30, [image(0, 12, "z")])
    scheduler.add_request(a)
    scheduler.add_request(p)
    first = scheduler.schedule()  # a stops before x; p starts z (12 rows, 18 of 20 used)
    assert [(c.request.request_id, c.num_tokens) for c in first.chunks] == [("a", 8), ("p", 4)]
    sample(scheduler, first)
    waits = scheduler.schedule()  # x does not fit beside u1 and z: only p moves
    assert [c.request.request_id for c in waits.chunks] == ["p"]
    assert waits.preempted_request_ids == []
    sample(scheduler, waits)
    outs = run_bounded(scheduler, max_steps=40)
    assert "x" in [m.content_hash for out in outs for m in out.media_to_encode]
    assert a.is_finished and p.is_finished and a.num_preemptions == 0
    assert scheduler.counters.num_preemptions == 0


def test_a_step_that_preempted_for_kv_blocks_preempts_nobody_for_encoder_room():
    """`b` holds image z part-way, needs KV blocks there are none of, and preempts itself,
    which frees z. `a`, holding its uuid-only entry and waiting for that room, must not be
    preempted too in the same step although no chunk moved: its progress would be lost for
    room just freed (and two such requests took turns for ever, fuzz50). It runs next."""
    config = EngineConfig(model="unused", block_size=4, enable_prefix_caching=False,
                          encoder_cache_tokens=20, max_num_batched_tokens=10,
                          split_media=False)  # fmt: skip
    scheduler = Scheduler(config, num_kv_blocks=5, max_model_len=1000)
    warm(scheduler, ("uuid:u1", 6))
    a = make_request("a", 16, [cached_only(0, 6, "uuid:u1"), image(6, 8, "x")])
    b = make_request("b", 16, [image(0, 12, "z")])
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()  # a stops before x; b starts z (18 of 20 rows used)
    assert [(c.request.request_id, c.num_tokens) for c in first.chunks] == [("a", 6), ("b", 4)]
    sample(scheduler, first)
    kv_step = scheduler.schedule()  # a waits for room; b's next chunk finds no KV blocks
    assert kv_step.chunks == [] and kv_step.preempted_request_ids == ["b"]
    assert scheduler.running == [a]
    sample(scheduler, kv_step)
    moves = scheduler.schedule()  # z is free to evict now
    assert [c.request.request_id for c in moves.chunks] == ["a"]
    assert moves.evicted_encoder_hashes == ["z"]
    sample(scheduler, moves)
    run_bounded(scheduler, max_steps=40)
    assert a.is_finished and b.is_finished
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(max_tokens=1, temperature=0.0),
     SamplingParams(max_tokens=2, temperature=0.0, bad_words_token_ids=((7, 8),))],
    ids=["its-last-token-in-flight", "bad-words-need-the-token-on-the-host"],
)  # fmt: skip
def test_a_request_sitting_out_for_its_token_in_flight_is_not_a_deadlock(sampling):
    """Overlap scheduling plans a step before the last one's tokens are known. `r` holds
    the uuid-only entry `a` needs the room of, and sits this step out: its token in flight
    ends it, or picking its next one needs that token on the host. No chunk moves, yet `r`
    moves (or ends and frees its entry) once the token arrives: `a` is not preempted."""
    scheduler = make_scheduler(encoder_cache_tokens=20, max_num_batched_tokens=18,
                               split_media=False)  # fmt: skip
    warm(scheduler, ("uuid:u1", 6), ("uuid:u2", 8))
    r = Request("r", list(range(1, 11)), sampling, media=[cached_only(0, 8, "uuid:u2")])
    a = make_request("a", 20, [cached_only(0, 6, "uuid:u1"), image(8, 8, "x")])
    scheduler.add_request(r)
    scheduler.add_request(a)
    in_flight = scheduler.schedule()  # r's whole prompt (it samples), a up to x
    assert [(c.request.request_id, c.num_tokens, c.samples) for c in in_flight.chunks] == [
        ("r", 10, True), ("a", 8, False)
    ]  # fmt: skip
    ahead = scheduler.schedule()  # launched before r's token is known
    assert ahead.chunks == [] and ahead.preempted_request_ids == []
    assert scheduler.running == [r, a]
    sample(scheduler, in_flight)
    sample(scheduler, ahead)
    run_bounded(scheduler, max_steps=40)
    assert r.is_finished and a.is_finished and r.error is None and a.error is None
    assert scheduler.counters.num_preemptions == 0
