"""The real engine process behind EngineClient: concurrency, abort, garbage on the socket,
engine death and step failure. (SIGKILLing the engine or the server under a real
`tessera serve`: test_faults.py.)"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

from bench.servers import free_port
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.process import EXIT_HUNG
from engine.protocol import EngineRequest, FinishReason, Ready, SamplingParams, Shutdown
from engine.tiny_model import make_tiny_model
from server.engine_client import EngineClient


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("engine-process") / "tiny", seed=3)
    return EngineConfig(
        model=str(model_dir), num_threads=1, num_kv_blocks=64, max_model_len=512, seed=0
    )


def _request(request_id: str, first_token: int, max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=[first_token, 20, 30, 40, 50],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _collect(client: EngineClient, request: EngineRequest) -> tuple[list[int], str]:
    token_ids, finish_reason = [], None
    async for output in client.generate(request):
        assert finish_reason is None, "output after the final one"
        token_ids += output.new_token_ids
        finish_reason = output.finish_reason
    return token_ids, finish_reason


async def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_concurrent_requests_abort_and_garbage(engine_config: EngineConfig, capfd) -> None:
    async def scenario() -> None:
        client = EngineClient(engine_config, startup_timeout=120)
        ready = await client.start()
        assert ready.num_kv_blocks == 64 and ready.max_model_len == 512
        assert client.is_alive
        try:
            # 4 concurrent requests + one consumer that walks away after 3 outputs.
            async def walk_away() -> int:
                seen = 0
                async for _ in client.generate(_request("walker", 7, max_tokens=500)):
                    seen += 1
                    if seen == 3:
                        break  # leaves the generator: the client aborts it in the engine
                return seen

            results = await asyncio.gather(
                *[_collect(client, _request(f"r{i}", 10 + i, max_tokens=12)) for i in range(4)],
                walk_away(),
            )
            for token_ids, finish_reason in results[:4]:
                assert len(token_ids) == 12 and finish_reason == FinishReason.LENGTH
            assert results[4] == 3
            # The walker's blocks are freed once the others are done: usage back to 0 long
            # before its 500 tokens could have been generated.
            await _wait_for(
                lambda: (
                    client.stats.latest.num_running == 0
                    and client.stats.latest.kv_cache_usage == 0.0
                ),
                timeout=1.0,
                what="kv usage back to 0",
            )
            assert client.stats.totals["prefix_cache_queries_total"] > 0

            # Explicit abort: the consumer sees finish_reason "abort".
            async def abort_soon() -> None:
                await asyncio.sleep(0.2)
                await client.abort(["explicit"])

            (token_ids, finish_reason), _ = await asyncio.gather(
                _collect(client, _request("explicit", 9, max_tokens=400)), abort_soon()
            )
            assert finish_reason == FinishReason.ABORT and len(token_ids) < 400

            # Garbage and a pickle straight into the engine's inbox: dropped, engine lives on.
            await client._inbox.send_multipart([b"\xc1\x00garbage"])
            await client._inbox.send_multipart([pickle.dumps(Shutdown())])
            await client._inbox.send_multipart([b"\x81\xa4type\xa8Shutdown", b"extra frame"])
            token_ids, finish_reason = await _collect(client, _request("after", 11, 5))
            assert len(token_ids) == 5 and finish_reason == FinishReason.LENGTH
            assert client.is_alive
        finally:
            await client.shutdown()
        assert client._process.exitcode == 0
        # The engine logged (to the inherited stderr) and dropped each bad message.
        assert capfd.readouterr().err.count("dropped an undecodable inbox message") == 3
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            await _collect(client, _request("late", 1, 2))

    asyncio.run(scenario())


def test_engine_death_fails_in_flight_requests(engine_config: EngineConfig) -> None:
    async def scenario() -> None:
        deaths: list[str] = []
        client = EngineClient(
            engine_config,
            startup_timeout=120,
            on_engine_death=deaths.append,
            # TCP instead of the private ipc:// sockets (e.g. an engine in another container).
            inbox_address=f"tcp://127.0.0.1:{free_port()}",
            outbox_address=f"tcp://127.0.0.1:{free_port()}",
        )
        await client.start()
        try:
            request = _request("doomed", 5, max_tokens=500)
            stream = client.generate(request)
            await stream.__anext__()  # the request is running in the engine
            os.kill(client.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert time.monotonic() - killed_at < 2.0
            assert deaths and not client.is_alive
            with pytest.raises(EngineDeadError):
                await _collect(client, _request("after-death", 5, 2))
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_start_fails_clearly_without_a_model(tmp_path: Path) -> None:
    async def scenario() -> None:
        client = EngineClient(EngineConfig(model=str(tmp_path / "nothing")), startup_timeout=60)
        with pytest.raises(EngineDeadError, match="start-up failed"):
            await client.start()
        assert not client.is_alive

    asyncio.run(scenario())


def test_a_process_that_cannot_start_is_a_start_up_failure(tmp_path: Path, monkeypatch) -> None:
    """Before, `start()` raised the OSError itself, and the server's shutdown() then
    joined a process that never started (an AssertionError)."""

    def no_memory(self) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(multiprocessing.get_context("spawn").Process, "start", no_memory)

    async def scenario() -> None:
        client = EngineClient(EngineConfig(model=str(tmp_path)), startup_timeout=60)
        with pytest.raises(EngineDeadError, match="could not start the engine process: .*memory"):
            await client.start()
        await client.shutdown()
        assert not client.is_alive

    asyncio.run(scenario())


class _CoreThatFailsInStep:
    """A stand-in EngineCore whose step() raises: the engine must report it and exit."""

    def __init__(self, config: EngineConfig) -> None:
        self.ready = Ready(
            model_name="broken", max_model_len=64, vocab_size=10, hidden_size=8, block_size=16,
            num_kv_blocks=4, eos_token_ids=[0], modalities=[], dtype="float32", device="cpu",
        )  # fmt: skip
        self.has_work = False

    def add_request(self, request: EngineRequest, tensors=()) -> None:
        self.has_work = True

    def abort_requests(self, request_ids) -> None:
        pass

    overlaps_steps = False

    def has_unfinished_requests(self) -> bool:
        return self.has_work

    def step(self):
        raise RuntimeError("boom in step")


def test_step_failure_sends_engine_failed_and_exits_nonzero(tmp_path: Path) -> None:
    async def scenario() -> None:
        deaths: list[str] = []
        client = EngineClient(
            EngineConfig(model=str(tmp_path)),
            on_engine_death=deaths.append,
            core_factory=_CoreThatFailsInStep,
        )
        await client.start()
        try:
            with pytest.raises(EngineDeadError):
                await _collect(client, _request("r", 1, 4))
            assert deaths and "boom in step" in deaths[0]
            await _wait_for(lambda: client._process.exitcode is not None, 5, "engine exit")
            assert client._process.exitcode == 1
        finally:
            await client.shutdown()

    asyncio.run(scenario())


class _CoreThatHangsInStep(_CoreThatFailsInStep):
    """A stand-in EngineCore whose step() never returns (a device or a lock that hangs)."""

    def step(self):
        time.sleep(600)


def test_a_step_that_hangs_ends_the_engine_and_its_requests(tmp_path: Path) -> None:
    """The request waited forever and /health said ok. Past engine_step_timeout_s the
    engine exits (EXIT_HUNG), its stack in the log, and its requests fail with a 503."""

    async def scenario() -> float:
        deaths: list[str] = []
        client = EngineClient(
            EngineConfig(model=str(tmp_path), engine_step_timeout_s=1.0),
            on_engine_death=deaths.append,
            core_factory=_CoreThatHangsInStep,
        )
        await client.start()
        started = time.monotonic()
        try:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(_collect(client, _request("r", 1, 4)), 30)
            assert deaths and f"exited with code {EXIT_HUNG}" in deaths[0], deaths
            return time.monotonic() - started
        finally:
            await client.shutdown()

    assert asyncio.run(scenario()) < 10


class _CoreThatLoadsForever:
    """A stand-in EngineCore whose start-up never ends (a model load that hangs)."""

    def __init__(self, config: EngineConfig) -> None:
        time.sleep(600)


def test_an_engine_past_its_start_up_deadline_is_unwound_not_killed(tmp_path: Path) -> None:
    """The engine ignores SIGTERM (a drain must outlive a process-group SIGTERM); the
    client's stop signal unwinds it, so what it started is stopped, before any SIGKILL."""

    async def scenario() -> int:
        client = EngineClient(
            EngineConfig(model=str(tmp_path)),
            startup_timeout=3.0,
            core_factory=_CoreThatLoadsForever,
        )
        with pytest.raises(EngineDeadError, match="not ready after"):
            await client.start()
        return client._process.exitcode

    assert asyncio.run(scenario()) == 0  # SystemExit from the stop signal; -9 if killed


def test_an_inbox_with_no_engine_on_it_never_hangs_a_request_or_shutdown(tmp_path: Path) -> None:
    """A PUSH whose engine has gone waits until another connects. An engine that failed
    closes its inbox and lingers a moment: shutdown() sent it Shutdown and waited for ever
    (the server answered 503 and never exited, so no supervisor restarted it; fuzz38), and
    a request sent then waited past the death that failed the others."""

    def sleeper() -> multiprocessing.Process:  # an engine process that never reads
        process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
        process.start()
        return process

    async def scenario() -> None:
        import zmq
        import zmq.asyncio

        client = EngineClient(EngineConfig(model=str(tmp_path)))
        context = zmq.asyncio.Context()
        inbox = context.socket(zmq.PUSH)
        inbox.bind(f"ipc://{tmp_path}/inbox")  # nothing ever connects
        client._context, client._inbox, client._process = context, inbox, sleeper()
        client.ready = Ready(
            model_name="m", max_model_len=64, vocab_size=100, hidden_size=8, block_size=16,
            num_kv_blocks=4, eos_token_ids=[0], modalities=[], dtype="float32", device="cpu",
        )  # fmt: skip
        request = asyncio.create_task(_collect(client, _request("r", 1, 2)))
        await asyncio.sleep(0.3)
        client._process.kill()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(request, 10)
        client._process = sleeper()  # alive, its inbox closed
        await asyncio.wait_for(client.shutdown(timeout=1.0), 20)
        assert not client._process.is_alive()

    asyncio.run(scenario())
