"""The engine loop with several API processes: each request's outputs go back to the
process it came from, API process 0 gets every step's stats, and a request the core
refuses is answered to its sender (engine/process.py). Real ZMQ sockets, a scripted core."""

from __future__ import annotations

import os
import threading
import time

import zmq

from engine.errors import InvalidRequest
from engine.process import STATS_API_SERVER, EngineLoop
from engine.protocol import (
    EngineOutputs,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from engine.serialization import decode_server_inbox, encode_message


class ScriptedCore:
    """Each step gives every running request one token; a request finishes at its third."""

    overlaps_steps = False

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.num_steps = 0

    def add_request(self, request: EngineRequest, tensors=()) -> None:
        if request.request_id.startswith("bad"):
            raise InvalidRequest("refused", param="messages")
        self.tokens[request.request_id] = 0

    def abort_requests(self, request_ids) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.tokens)

    def step(self) -> EngineOutputs:
        self.num_steps += 1
        outputs = []
        for request_id in list(self.tokens):
            self.tokens[request_id] += 1
            done = self.tokens[request_id] == 3
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[self.tokens[request_id]],
                    finish_reason=FinishReason.LENGTH if done else None,
                )
            )
            if done:
                del self.tokens[request_id]
        return EngineOutputs(outputs, EngineStats(num_running=len(outputs), num_scheduled_tokens=1))


def _request(request_id: str) -> EngineRequest:
    return EngineRequest(
        request_id=request_id, prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=3)
    )


def _received(sink: zmq.Socket) -> list[EngineOutputs]:
    messages = []
    while sink.poll(50):
        frames = sink.recv_multipart(copy=False)
        messages.append(decode_server_inbox([frame.buffer for frame in frames]))
    return messages


def test_outputs_go_back_to_the_api_process_each_request_came_from():
    context = zmq.Context()
    base = f"inproc://routing-{os.getpid()}"
    senders, inboxes, outboxes, sinks = [], [], [], []
    for index in range(3):
        sender, inbox = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        outbox, sink = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        inbox.bind(f"{base}-in-{index}")
        sender.connect(f"{base}-in-{index}")
        sink.bind(f"{base}-out-{index}")
        outbox.connect(f"{base}-out-{index}")
        senders.append(sender)
        inboxes.append(inbox)
        outboxes.append(outbox)
        sinks.append(sink)
    try:
        core = ScriptedCore()
        loop = EngineLoop(core, inboxes, outboxes, os.getppid())
        senders[1].send_multipart(encode_message(_request("one-a")))
        senders[1].send_multipart(encode_message(_request("bad-one")))
        senders[2].send_multipart(encode_message(_request("two-a")))
        senders[0].send_multipart(encode_message(_request("zero-a")))
        loop._drain_inbox(1000)
        assert loop.api_server_of == {"one-a": 1, "two-a": 2, "zero-a": 0, "bad-one": 1}
        while core.has_unfinished_requests():
            loop._publish(loop._step())
        received = [_received(sink) for sink in sinks]
        owners = {"zero-a": 0, "one-a": 1, "bad-one": 1, "two-a": 2}
        for index, messages in enumerate(received):
            ids = {output.request_id for message in messages for output in message.outputs}
            assert ids == {r for r, owner in owners.items() if owner == index}
        # Process 0 heard of every step (it exports the stats); the others only of theirs.
        assert len(received[STATS_API_SERVER]) == core.num_steps == 3
        tokens_of_two = [o.new_token_ids for m in received[2] for o in m.outputs]
        assert tokens_of_two == [[1], [2], [3]]
        refused = [o for m in received[1] for o in m.outputs if o.request_id == "bad-one"]
        assert refused[0].finish_reason == FinishReason.ERROR
        assert loop.api_server_of == {}  # finished requests are forgotten
    finally:
        for socket in senders + inboxes + outboxes + sinks:
            socket.close(linger=0)
        context.term()


class Pairs:
    """`pair(kind_a, kind_b, address, hwm=None)`: a connected pair of sockets (b binds, a
    connects; `hwm` bounds both queues), all closed on exit."""

    def __enter__(self):
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        return self.pair

    def pair(self, kind_a, kind_b, address, hwm=None):
        a, b = self.context.socket(kind_a), self.context.socket(kind_b)
        if hwm is not None:
            a.setsockopt(zmq.SNDHWM, hwm)
            b.setsockopt(zmq.RCVHWM, hwm)
        b.bind(address)
        a.connect(address)
        self.sockets.extend((a, b))
        return a, b

    def __exit__(self, *exc) -> None:
        for socket in self.sockets:
            socket.close(linger=0)
        self.context.term()


def test_api_process_zero_gone_never_stalls_the_others():
    """During a drain API process 0 may exit first; the stats-only messages it no longer
    reads must not fill its queue and block the engine while another process streams."""
    base = f"inproc://stats-gone-{os.getpid()}"
    with Pairs() as pair:
        _, inbox_zero = pair(zmq.PUSH, zmq.PULL, f"{base}-in-0")
        sender_one, inbox_one = pair(zmq.PUSH, zmq.PULL, f"{base}-in-1")
        outbox_zero, _ = pair(zmq.PUSH, zmq.PULL, f"{base}-out-0", hwm=2)  # never read
        outbox_one, sink_one = pair(zmq.PUSH, zmq.PULL, f"{base}-out-1")
        core = ScriptedCore()
        loop = EngineLoop(core, [inbox_zero, inbox_one], [outbox_zero, outbox_one], os.getppid())
        sender_one.send_multipart(encode_message(_request("one-a")))
        loop._drain_inbox(1000)
        core.tokens["one-a"] = -20  # a long request: 23 steps, each with new stats

        def run() -> None:
            while core.has_unfinished_requests():
                result = loop._step()
                stats = EngineStats(num_running=1, num_scheduled_tokens=core.num_steps)
                loop._publish(EngineOutputs(result.outputs, stats))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the engine blocked on API process 0's full queue"
        tokens = [o.new_token_ids[0] for m in _received(sink_one) for o in m.outputs]
        assert tokens == list(range(-19, 4))


class AbortingCore(ScriptedCore):
    """ScriptedCore whose aborts end their requests at the next step, as EngineCore's do."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []

    def abort_requests(self, request_ids) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.tokens[request_id] = 2  # its next step is its last


def test_an_api_process_that_stops_reading_never_stalls_the_others():
    """Outputs went out with a blocking send: an API process that stopped reading
    (SIGSTOP, wedged, dead) filled its queue and the engine stopped stepping for every
    process. Now its outputs wait for it, and its requests are aborted once it has read
    nothing for `stall_timeout_s`."""
    base = f"inproc://stalled-{os.getpid()}"
    with Pairs() as pair:
        sender_zero, inbox_zero = pair(zmq.PUSH, zmq.PULL, f"{base}-in-0")
        sender_one, inbox_one = pair(zmq.PUSH, zmq.PULL, f"{base}-in-1")
        outbox_zero, sink_zero = pair(zmq.PUSH, zmq.PULL, f"{base}-out-0")
        outbox_one, sink_one = pair(zmq.PUSH, zmq.PULL, f"{base}-out-1", hwm=2)  # stops reading
        core = AbortingCore()
        loop = EngineLoop(core, [inbox_zero, inbox_one], [outbox_zero, outbox_one],
                          os.getppid(), stall_timeout_s=0.3)  # fmt: skip
        sender_zero.send_multipart(encode_message(_request("zero")))
        sender_one.send_multipart(encode_message(_request("one")))
        loop._drain_inbox(1000)
        core.tokens["zero"] = -60  # 63 steps
        core.tokens["one"] = -1000  # would run 1003 steps

        def run() -> None:
            while core.has_unfinished_requests():
                loop._publish(loop._step())
                time.sleep(0.01)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "the engine blocked on API process 1's full queue"
        tokens = [o.new_token_ids[0] for m in _received(sink_zero) for o in m.outputs]
        assert tokens == list(range(-59, 4))  # every one of process 0's tokens
        assert core.aborted == ["one"] and loop.unsent[1]  # owed to process 1, kept
        received = []  # process 1 reads again: everything owed arrives, in order
        deadline = time.monotonic() + 10
        while (loop.unsent[1] or sink_one.poll(50)) and time.monotonic() < deadline:
            while sink_one.poll(0):
                received.append(decode_server_inbox(sink_one.recv_multipart()))
            loop._flush_unsent()
        tokens = [o.new_token_ids[0] for m in received for o in m.outputs]
        assert not loop.unsent[1] and tokens[-1] == 3  # the aborted request's last step
        assert tokens[:-1] == list(range(-999, -999 + len(tokens) - 1))
        assert received[-1].outputs[-1].finish_reason is not None
