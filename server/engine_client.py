"""The server's handle on the engine process: start it, talk to it, watch it, stop it.

    EngineClient ──PUSH (inbox)──▶ engine process ──PUSH (outbox)──▶ EngineClient
      generate()  one OutputCollector per request id  ◀── _output_loop routes RequestOutputs

Both sockets are bound here (ipc:// paths in a private 0700 temp dir by default). With
several API processes (server/api_servers.py) the launcher starts the engine and each API
process's client attaches to it (`engine_pid`): it binds its own sockets, never stops the
engine, and watches it by pid. One
background task reads the outbox, routes each `RequestOutput` to its request's collector
(server/output_collector.py: outputs the consumer has not taken yet are merged),
folds `EngineStats` into `stats`, and notices the engine's death within ~1 s: every
in-flight `generate()` then raises `EngineDeadError` and `on_engine_death` is called.
Aborts of abandoned requests are batched: one `AbortRequests` per event-loop tick, so a
crowd of clients hanging up at once costs the engine a few messages, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequest, TesseraError
from engine.process import STOP_SIGNAL, run_engine
from engine.process_tree import kill_tree
from engine.protocol import (
    AbortRequests,
    EngineFailed,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    MediaUuid,
    Ready,
    RequestOutput,
    Shutdown,
)
from engine.serialization import MessageDecodeError, decode_server_inbox, encode_message
from server.attached_engine import AttachedEngine
from server.output_collector import OutputCollector

logger = logging.getLogger("tessera.engine_client")

WATCH_INTERVAL_MS = 200  # how often the output loop checks that the engine is alive
# Past engine_step_timeout_s, how long the engine may stay silent with requests waiting
# before an API process kills it as hung (its own watchdog acts first where it can).
ENGINE_SILENCE_GRACE_S = 10.0
DEATH_CHECK_S = 0.5  # how often a send that waits checks that the engine still lives
SHUTDOWN_SEND_S = 1.0  # how long shutdown() waits to hand the engine its Shutdown


@dataclasses.dataclass
class EngineStatsAccumulator:
    """Engine stats for /metrics: `latest` holds the newest gauges, `totals` the running
    sum of every `*_total` counter (the engine sends deltas)."""

    latest: EngineStats = dataclasses.field(default_factory=EngineStats)
    totals: dict[str, float] = dataclasses.field(
        default_factory=lambda: {
            f: 0 for f in EngineStats.__struct_fields__ if f.endswith("_total")
        }
    )
    num_messages: int = 0

    def update(self, stats: EngineStats) -> None:
        self.latest = stats
        self.num_messages += 1
        for name in self.totals:
            self.totals[name] += getattr(stats, name)


class EngineClient:
    """Starts and watches the engine process; multiplexes requests over the ZMQ sockets
    (zmq.asyncio). Use from one event loop: `await start()`, `generate()`, `shutdown()`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout: float = 600.0,
        inbox_address: str | None = None,
        outbox_address: str | None = None,
        on_engine_death: Callable[[str], Any] | None = None,
        log_level: str = "info",
        log_format: str = "text",
        core_factory: Callable[[EngineConfig], Any] | None = None,
        engine_pid: int | None = None,
    ) -> None:
        """`engine_pid`: attach to that engine, started by our parent (the launcher of
        several API processes), instead of spawning one; the addresses must be given."""
        if engine_pid is not None and (inbox_address is None or outbox_address is None):
            raise ValueError("attaching to an engine needs its inbox and outbox addresses")
        self.config = config
        self._engine_pid = engine_pid
        self.startup_timeout = startup_timeout
        self.on_engine_death = on_engine_death
        self.stats = EngineStatsAccumulator()
        self.ready: Ready | None = None
        self.death_reason: str | None = None
        self._addresses = (inbox_address, outbox_address)
        self._engine_kwargs = {
            "log_level": log_level,
            "log_format": log_format,
            "core_factory": core_factory,
        }
        self._collectors: dict[str, OutputCollector] = {}
        self._stats_listeners: list[Callable[[EngineStats], Any]] = []
        self._finish_listeners: list[Callable[[RequestOutput], Any]] = []
        self._media_uuid_registry: Any = None  # set by share_media_uuids
        self._process: multiprocessing.process.BaseProcess | AttachedEngine | None = None
        self._context: zmq.asyncio.Context | None = None
        self._inbox: zmq.asyncio.Socket | None = None  # we PUSH requests into the engine's inbox
        self._outbox: zmq.asyncio.Socket | None = None  # we PULL the engine's outputs
        self._ipc_dir: str | None = None
        self._output_task: asyncio.Task | None = None
        self._abort_ids: list[str] = []  # abandoned requests, sent together next tick
        self._is_failed = False
        self._is_shutting_down = False
        self._last_heard = time.monotonic()  # the engine's last message (Heartbeat, ...)
        self._stopped: TesseraError | None = None  # what new requests get after stop_all

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Ready:
        """Spawn the engine and wait for its Ready. Raises EngineDeadError (with the
        engine's reason) if it fails, dies, or is not ready within `startup_timeout`."""
        if self._process is not None:
            raise RuntimeError("EngineClient.start() called twice")
        inbox_address, outbox_address = self._bind()
        if self._engine_pid is not None:
            self._process = AttachedEngine(self._engine_pid, launcher_pid=os.getppid())
            logger.info("waiting for engine process %d", self._engine_pid)
        else:
            self._spawn(inbox_address, outbox_address)
        try:
            self.ready = await self._wait_ready()
        except BaseException:
            await self._stop_process(timeout=2.0)
            self._close_sockets()
            raise
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-outputs")
        return self.ready

    def _spawn(self, inbox_address: str, outbox_address: str) -> None:
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(
            target=run_engine,
            args=(self.config, [inbox_address], [outbox_address], os.getpid()),
            kwargs={**self._engine_kwargs, "run_dir": self._ipc_dir},
            name="tessera-engine",
            daemon=True,  # never outlive the server, even if shutdown() is skipped
        )
        try:
            process.start()
        except OSError as exc:  # e.g. no memory to fork: a start-up failure like the others
            self._close_sockets()
            raise EngineDeadError(f"could not start the engine process: {exc}") from exc
        self._process = process  # only a started one: shutdown() joins it
        logger.info("engine process %d starting (model %s)", self._process.pid, self.config.model)

    def _bind(self) -> tuple[str, str]:
        inbox_address, outbox_address = self._addresses
        if inbox_address is None or outbox_address is None:
            self._ipc_dir = tempfile.mkdtemp(prefix="tessera-")  # mode 0700: only us
            inbox_address = inbox_address or f"ipc://{self._ipc_dir}/inbox"
            outbox_address = outbox_address or f"ipc://{self._ipc_dir}/outbox"
        self._context = zmq.asyncio.Context()
        self._inbox = self._context.socket(zmq.PUSH)
        self._outbox = self._context.socket(zmq.PULL)
        try:
            self._inbox.bind(inbox_address)
            self._outbox.bind(outbox_address)
        except zmq.ZMQError as exc:  # taken, or not an address: one line, not a traceback
            self._close_sockets()
            raise EngineDeadError(
                f"cannot bind the engine sockets {inbox_address} and {outbox_address}: {exc}"
            ) from None
        return inbox_address, outbox_address

    async def _wait_ready(self) -> Ready:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if await self._outbox.poll(WATCH_INTERVAL_MS):
                message = self._decode(await self._outbox.recv_multipart(copy=False))
                if isinstance(message, Ready):
                    logger.info("engine ready: %s", message)
                    return message
                if isinstance(message, EngineFailed):
                    raise EngineDeadError(message.message)
                continue
            if not self._process.is_alive():
                raise EngineDeadError(f"{self._exit_description()} during start-up")
        raise EngineDeadError(f"engine not ready after {self.startup_timeout:.0f} s")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, wait up to `timeout` s, then kill it (an attached
        engine is left to the launcher). Idempotent."""
        if self._is_shutting_down:
            return
        self._is_shutting_down = True
        if (
            isinstance(self._process, multiprocessing.process.BaseProcess)
            and self._process.is_alive()
            and self._inbox is not None
        ):
            # Not for ever: an engine that failed closes its inbox and lingers a moment on
            # its outbox, and a PUSH with no peer waits until one comes (never: the server
            # hung after answering 503, and no supervisor restarted it; fuzz38).
            with contextlib.suppress(zmq.ZMQError, TimeoutError):
                await asyncio.wait_for(
                    self._inbox.send_multipart(encode_message(Shutdown())), SHUTDOWN_SEND_S
                )
        await self._stop_process(timeout)
        if self._output_task is not None:
            self._output_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._output_task
        self._fail_all()
        self._close_sockets()

    async def _stop_process(self, timeout: float) -> None:
        process = self._process
        if not isinstance(process, multiprocessing.process.BaseProcess):
            return  # none, or attached: the launcher stops it
        deadline = time.monotonic() + timeout
        while process.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # It ignores SIGTERM (engine/process.py): STOP_SIGNAL unwinds it (stopping its
        # tensor-parallel workers), SIGKILL ends it with every process it started (a
        # worker that is stopped or wedged outlived it: fuzz47).
        for signum in (STOP_SIGNAL, signal.SIGKILL):
            if not process.is_alive():
                break
            name = signal.Signals(signum).name
            logger.warning("engine process %d did not exit; sending %s", process.pid, name)
            if signum == signal.SIGKILL:
                kill_tree(process.pid)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)
            await asyncio.to_thread(process.join, 2.0)
        process.join(0)

    def _close_sockets(self) -> None:
        for socket in (self._inbox, self._outbox):
            if socket is not None:
                socket.close(linger=0)
        if self._context is not None:
            self._context.term()
        self._inbox = self._outbox = self._context = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    @property
    def is_alive(self) -> bool:
        """The engine process runs, has not failed, and is not being shut down."""
        return (
            self.ready is not None
            and not self._is_failed
            and not self._is_shutting_down
            and self._process is not None
            and self._process.is_alive()
        )

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ---- requests --------------------------------------------------------------------------

    async def generate(
        self, request: EngineRequest, tensors: Sequence = (), *, tokens_per_wake: int | None = 1
    ) -> AsyncIterator[RequestOutput]:
        """Send `request` (tensor i of `tensors` = its TensorRef frame i) and yield each of
        its RequestOutputs until one has a finish_reason. Stopping early (client gone)
        aborts it in the engine; engine death raises EngineDeadError. Between the first
        output and the last, one is yielded once `tokens_per_wake` new tokens wait (None:
        never; server/output_collector.py)."""
        request_id = request.request_id
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        if self._stopped is not None:
            raise self._stopped
        if request_id in self._collectors:
            raise InvalidRequest(f"duplicate request id {request_id!r}", param="request_id")
        collector = OutputCollector(tokens_per_wake)
        self._collectors[request_id] = collector
        is_finished = False
        try:
            await self._send_while_alive(encode_message(request, tensors))
            while True:
                try:
                    item = await collector.get()
                except Exception:  # the engine died (not a cancellation: that aborts)
                    is_finished = True
                    raise
                is_finished = item.finish_reason is not None
                yield item
                if is_finished:
                    return
        finally:
            self._collectors.pop(request_id, None)
            if not is_finished:
                # No await here: this runs on GeneratorExit / CancelledError too.
                self._abort_soon(request_id)

    async def _send_while_alive(self, frames: list) -> None:
        """Sends to the engine's inbox, or raises EngineDeadError once the engine is gone:
        a PUSH whose peer has died waits until another connects, and the request waited
        with it, past the engine's death that failed every other request."""
        send = asyncio.ensure_future(self._inbox.send_multipart(frames, copy=False))
        try:
            while not (await asyncio.wait({send}, timeout=DEATH_CHECK_S))[0]:
                if not self.is_alive:
                    raise EngineDeadError(self.death_reason or "the engine is not running")
        finally:
            send.cancel()
        send.result()

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the engine; their generate() sees finish_reason "abort"."""
        if request_ids and self.is_alive:
            await self._inbox.send_multipart(encode_message(AbortRequests(list(request_ids))))

    def stop_all(self, failure: TesseraError) -> int:
        """Ends every request: those generating fail with `failure` (their clients get it,
        as a body or a stream's last event, rather than a cut connection) and are aborted
        in the engine; those still on their way to it fail with it in `generate()`. For a
        drain's deadline (server/cli.py). Returns how many were generating."""
        self._stopped = failure
        request_ids = list(self._collectors)
        for collector in self._collectors.values():
            collector.fail(failure)
        if request_ids:
            self._send_nowait(AbortRequests(request_ids))
        return len(request_ids)

    def add_stats_listener(self, callback: Callable[[EngineStats], Any]) -> None:
        """`callback(stats)` for every EngineStats the engine sends (exceptions are logged)."""
        self._stats_listeners.append(callback)

    def add_finish_listener(self, callback: Callable[[RequestOutput], Any]) -> None:
        """`callback(output)` for the last output of every request of this client's, also
        one no `generate()` waits for any more (a stop string ended it, its client left):
        it carries the engine-side phases (exceptions are logged)."""
        self._finish_listeners.append(callback)

    def share_media_uuids(self, registry: Any) -> None:
        """With several API processes: what `registry` (server/chat.py's UuidRegistry)
        learns of a client's media uuid goes to the others through the engine, and what
        they learn comes into it, so a uuid-only part works whichever process it reaches."""
        self._media_uuid_registry = registry
        registry.share_with(self._send_nowait)

    def _abort_soon(self, request_id: str) -> None:
        """Queue an abort; the first one in a tick schedules the flush of them all."""
        if not self._abort_ids:
            asyncio.get_running_loop().call_soon(self._flush_aborts)
        self._abort_ids.append(request_id)

    def _flush_aborts(self) -> None:
        request_ids, self._abort_ids = self._abort_ids, []
        self._send_nowait(AbortRequests(request_ids))

    def _send_nowait(self, message: Any) -> None:
        if not self.is_alive or self._inbox is None:
            return
        try:
            future = self._inbox.send_multipart(encode_message(message))
        except zmq.ZMQError:
            logger.warning("could not send %s to the engine", type(message).__name__)
            return
        future.add_done_callback(_consume_exception)

    # ---- the output loop --------------------------------------------------------------------

    async def _output_loop(self) -> None:
        self._last_heard = time.monotonic()  # Ready came just now (start-up may be long)
        try:
            while True:
                if await self._outbox.poll(WATCH_INTERVAL_MS):
                    self._last_heard = time.monotonic()
                    await self._route_queued()
                    continue
                if not self._process.is_alive():
                    self._on_death(self._exit_description())
                    return
                if self._is_silent_with_requests():
                    self._kill_hung_engine()
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken client is a dead engine
            logger.exception("engine output loop failed")
            self._on_death(f"engine output loop failed: {type(exc).__name__}")

    def _is_silent_with_requests(self) -> bool:
        """Requests wait on an engine that has sent nothing, not even its once-a-second
        Heartbeat, for longer than its own step watchdog allows a step: the engine is
        stopped (SIGSTOP) or stuck where its watchdog cannot act (a call holding the GIL).
        Its requests would wait for ever behind a /health of 200."""
        timeout = self.config.engine_step_timeout_s
        silent = time.monotonic() - self._last_heard
        return bool(timeout and self._collectors and silent > timeout + ENGINE_SILENCE_GRACE_S)

    def _kill_hung_engine(self) -> None:
        silent = time.monotonic() - self._last_heard
        reason = (f"the engine has sent nothing for {silent:.0f} s with requests waiting "
                  f"(past engine_step_timeout_s); killed as hung")  # fmt: skip
        logger.error("%s", reason)
        pid = self._process.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # stopped or not: its requests fail now
        self._on_death(reason)

    async def _route_queued(self) -> None:
        """Route every message already waiting. A NOBLOCK recv resolves at once, so this
        does not yield to the event loop: when the loop is busy (a burst of new requests)
        outputs and stats would otherwise fall behind by one message per loop iteration."""
        while True:
            try:
                frames = await self._outbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._route(frames)

    def _route(self, frames: list) -> None:
        message = self._decode(frames)
        if isinstance(message, EngineOutputs):
            for output in message.outputs:
                collector = self._collectors.get(output.request_id)
                if collector is not None:
                    collector.put(output)
                if output.finish_reason is not None:
                    for callback in self._finish_listeners:
                        try:
                            callback(output)
                        except Exception:  # noqa: BLE001 - metrics must not break serving
                            logger.exception("finish listener failed")
            self.stats.update(message.stats)
            for callback in self._stats_listeners:
                try:
                    callback(message.stats)
                except Exception:  # noqa: BLE001 - metrics must not break serving
                    logger.exception("stats listener failed")
        elif isinstance(message, EngineFailed):
            logger.error("engine failed: %s", message.message)
            self._on_death(message.message)
        elif isinstance(message, MediaUuid) and self._media_uuid_registry is not None:
            self._media_uuid_registry.learn(message)

    def _exit_description(self) -> str:
        if isinstance(self._process, AttachedEngine):
            return self._process.describe_exit()
        return f"engine process exited with code {self._process.exitcode}"

    def _decode(self, frames: list) -> Any:
        try:
            return decode_server_inbox([frame.buffer for frame in frames])
        except MessageDecodeError as exc:
            logger.error("dropped an undecodable engine message: %s", exc.message)
            return None

    def _on_death(self, reason: str) -> None:
        if self._is_failed or self._is_shutting_down:
            return
        self._is_failed = True
        self.death_reason = reason
        logger.error("engine died: %s", reason)
        self._fail_all()
        if self.on_engine_death is not None:
            try:
                self.on_engine_death(reason)
            except Exception:  # noqa: BLE001
                logger.exception("on_engine_death callback failed")

    def _fail_all(self) -> None:
        # The client sees a generic message; the reason (exit code, traceback) is logged.
        for collector in self._collectors.values():
            collector.fail(EngineDeadError("the engine is not running"))


def _consume_exception(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("send to engine failed: %s", future.exception())
