"""launch_step / finish_step: the engine does host work while a step is in flight.

On CPU a launched step has already run, but the bookkeeping is the same as on a GPU: what
arrives between launch and finish (new requests, aborts) must be handled exactly as if it
had arrived after the step. The engine process's loop is driven directly here, with real
ZMQ sockets, and the core is told it overlaps (as it does on CUDA).
"""

from __future__ import annotations

import os

import pytest
import zmq

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.process import EngineLoop
from engine.protocol import AbortRequests, EngineRequest, FinishReason, SamplingParams
from engine.serialization import encode_message
from engine.tiny_model import make_tiny_model


def request(request_id: str, first_token: int, max_tokens: int = 6) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=[first_token, 20, 30, 40, 50],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("overlap"))


def run_alone(model_dir, engine_request: EngineRequest) -> list[int]:
    core = EngineCore(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))
    core.add_request(engine_request)
    tokens = []
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens += output.new_token_ids
    return tokens


def test_abort_between_launch_and_finish_drops_the_step(model_dir):
    core = EngineCore(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))
    core.add_request(request("a", 11))
    core.add_request(request("b", 12))
    core.step()  # both prefilled
    in_flight = core.launch_step()
    core.abort_requests(["a"])
    outputs = core.finish_step(in_flight).outputs
    assert [o.request_id for o in outputs] == ["b"]  # a's token of this step is dropped
    outputs = core.step().outputs
    finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert finished == {"a": FinishReason.ABORT}
    while core.has_unfinished_requests():
        core.step()
    assert core.scheduler.kv.usage == 0


class OverlappingCore(EngineCore):
    """The real core, told that its steps overlap (as on CUDA), recording the loop's calls."""

    def __init__(self, config: EngineConfig, calls: list[str], on_launch=None) -> None:
        super().__init__(config)
        self.overlaps_steps = True
        self.calls = calls
        self.on_launch = on_launch

    def launch_step(self, previous=None):
        in_flight = super().launch_step(previous)
        self.calls.append("launch")
        if self.on_launch is not None:
            self.on_launch()
            self.on_launch = None
        return in_flight

    def finish_step(self, in_flight):
        self.calls.append("finish")
        return super().finish_step(in_flight)

    def add_request(self, engine_request, tensors=()):
        self.calls.append(f"add {engine_request.request_id}")
        super().add_request(engine_request, tensors)

    def abort_requests(self, request_ids):
        self.calls.append(f"abort {','.join(request_ids)}")
        super().abort_requests(request_ids)


def test_loop_admits_what_arrives_while_a_step_runs(model_dir):
    context = zmq.Context()
    address = f"inproc://overlap-{os.getpid()}"
    server_side, inbox = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    outbox, sink = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    inbox.bind(address + "-in")
    server_side.connect(address + "-in")
    sink.bind(address + "-out")
    outbox.connect(address + "-out")
    try:
        calls: list[str] = []

        def send(message) -> None:
            server_side.send_multipart(encode_message(message))

        def arrive_mid_step() -> None:
            send(request("late", 13))
            send(AbortRequests(["doomed"]))

        config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64)
        core = OverlappingCore(config, calls, on_launch=arrive_mid_step)
        core.add_request(request("early", 12))
        core.add_request(request("doomed", 14))
        loop = EngineLoop(core, [inbox], [outbox], os.getppid())
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, FinishReason] = {}
        for _ in range(40):
            if not core.has_unfinished_requests():
                break
            for output in loop._step().outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason is not None:
                    reasons[output.request_id] = output.finish_reason
        # The next step is launched before the first one's tokens are read.
        assert calls[2:7] == ["launch", "add late", "abort doomed", "launch", "finish"]
        assert reasons == {
            "early": FinishReason.LENGTH,
            "late": FinishReason.LENGTH,
            "doomed": FinishReason.ABORT,
        }
        assert tokens["early"] == run_alone(model_dir, request("early", 12))
        assert tokens["late"] == run_alone(model_dir, request("late", 13))
        assert core.scheduler.kv.usage == 0
    finally:
        for socket in (server_side, inbox, outbox, sink):
            socket.close(linger=0)
        context.term()
