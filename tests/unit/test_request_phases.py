"""Engine-side request phases (queue, prefill, decode) ride on the finishing RequestOutput."""

import time

import msgspec

from engine.config import EngineConfig
from engine.protocol import SERVER_INBOX_DECODER, EngineOutputs, EngineStats, SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler

PHASES = ("queued_seconds", "prefill_seconds", "decode_seconds")


def make_scheduler(max_num_seqs=1) -> Scheduler:
    config = EngineConfig(
        model="unused", block_size=4, max_num_seqs=max_num_seqs, enable_prefix_caching=False
    )
    return Scheduler(config, num_kv_blocks=64, max_model_len=1000)


def make_request(request_id: str, max_tokens: int) -> Request:
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens))


def step(scheduler: Scheduler, pause_s: float = 0.0):
    out = scheduler.schedule()
    time.sleep(pause_s)
    return scheduler.update(out, {c.request.request_id: 7 for c in out.chunks if c.samples})


def test_phases_only_on_the_finishing_output_and_ordered():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first", max_tokens=3))
    scheduler.add_request(make_request("second", max_tokens=1))
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, pause_s=0.01)
    first = [o for o in outputs if o.request_id == "first"]
    assert all(getattr(o, name) is None for o in first[:-1] for name in PHASES)
    done = first[-1]
    # the prefill step slept 10 ms before its token; two decode steps of 10 ms follow
    assert done.queued_seconds < 0.01 <= done.prefill_seconds
    assert done.decode_seconds >= 0.02
    [second] = [o for o in outputs if o.request_id == "second"]
    assert second.queued_seconds >= 0.03  # waited for all three steps of "first"
    assert second.decode_seconds < 0.005  # one token: no decode phase to speak of


def test_phases_survive_the_wire_and_abort_while_queued_has_only_queue_time():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("running", max_tokens=5))
    scheduler.add_request(make_request("queued", max_tokens=5))
    step(scheduler)
    [aborted] = scheduler.abort(["queued"])
    assert aborted.queued_seconds is not None and aborted.queued_seconds >= 0
    assert aborted.prefill_seconds is None and aborted.decode_seconds is None
    message = EngineOutputs([aborted], EngineStats())
    decoded = SERVER_INBOX_DECODER.decode(msgspec.msgpack.encode(message))
    assert decoded.outputs[0].queued_seconds == aborted.queued_seconds


def test_the_finishing_output_counts_the_tokens_generated_unless_the_request_failed():
    """request_generation_tokens observes it: a request that failed counts in no
    per-request metric, whether refused on arrival or failed later (fuzz49)."""
    from engine.protocol import ErrorInfo

    scheduler = make_scheduler(max_num_seqs=3)
    for request_id in ("done", "aborted", "failed"):
        scheduler.add_request(make_request(request_id, max_tokens=3))
    step(scheduler)
    step(scheduler)
    [aborted] = scheduler.abort(["aborted"])
    failed = scheduler.fail("failed", ErrorInfo(message="boom"))
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler)
    assert (aborted.num_output_tokens, failed.num_output_tokens) == (2, None)
    assert outputs[-1].num_output_tokens == 3  # "done"
