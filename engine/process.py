"""The engine process: builds an EngineCore and runs the busy loop between two ZMQ sockets.

    server PUSH ──inbox──▶ [PULL]  engine  [PUSH] ──outbox──▶ PULL server

The server binds both sockets (it creates the addresses: `ipc://` paths in a private 0700
temp dir, or `tcp://HOST:PORT`) and starts this process with multiprocessing "spawn";
`run_engine` connects, sends `Ready`, then loops:

    drain inbox (blocking poll only when idle) -> add / abort -> step() -> send outputs

On a GPU (`core.overlaps_steps`), steps overlap (`EngineCore.step_overlapped`): while a
launched step runs, the inbox is drained and the next step is launched; then the first
one's sampled tokens are read.

It exits 0 on `Shutdown`, exits by itself when its parent (the server) is gone, and on an
unrecoverable error sends `EngineFailed` and exits non-zero so the server fails too.
Undecodable inbox messages are logged and dropped; the engine lives on.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.errors import TesseraError
from engine.logging_utils import configure_logging
from engine.protocol import (
    AbortRequests,
    EngineFailed,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    ErrorInfo,
    FinishReason,
    RequestOutput,
    Shutdown,
)
from engine.serialization import MessageDecodeError, decode_engine_inbox, encode_message

logger = logging.getLogger("tessera.engine")

IDLE_POLL_MS = 500  # blocking poll when idle; also how often a lost parent is noticed
STALLED_POLL_MS = 2  # when requests exist but nothing was schedulable (e.g. fetching)
EXIT_FAILED = 1
EXIT_PARENT_GONE = 3
# Timing fields change every step; a message is worth sending only if something else did.
_TIMING_FIELDS = ("step_seconds", "vision_encoder_seconds")


def run_engine(
    config: EngineConfig,
    inbox_address: str,
    outbox_address: str,
    parent_pid: int,
    *,
    log_level: str = "info",
    log_format: str = "text",
    core_factory: Callable[[EngineConfig], Any] | None = None,
) -> None:
    """Entry point of the engine process (a multiprocessing "spawn" target).

    `core_factory` builds the core (default `engine.core.EngineCore`); it must be a
    module-level callable so that spawn can pass it. Never returns normally on failure:
    exits with EXIT_FAILED after sending `EngineFailed`.
    """
    configure_logging(log_level, log_format)
    # Ctrl-C in a terminal reaches the whole process group; the server shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    outbox = context.socket(zmq.PUSH)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)
    try:
        exit_code = _serve(config, inbox, outbox, parent_pid, core_factory)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=2000)  # let a final EngineOutputs / EngineFailed go out
        context.term()
    if exit_code:
        sys.exit(exit_code)


def _serve(config, inbox, outbox, parent_pid, core_factory) -> int:
    try:
        if core_factory is None:
            from engine.core import EngineCore

            core_factory = EngineCore
        core = core_factory(config)
        ready = core.ready
    except Exception as exc:  # noqa: BLE001 - report why start-up failed, then exit
        logger.exception("engine start-up failed")
        _send(outbox, EngineFailed(f"engine start-up failed: {_describe(exc)}"))
        return EXIT_FAILED
    logger.info(
        "engine ready: model=%s device=%s dtype=%s kv_blocks=%d max_model_len=%d",
        ready.model_name,
        ready.device,
        ready.dtype,
        ready.num_kv_blocks,
        ready.max_model_len,
    )
    _send(outbox, ready)
    loop = EngineLoop(core, inbox, outbox, parent_pid)
    try:
        return loop.run()
    except Exception as exc:  # noqa: BLE001 - the server must learn why we died
        logger.exception("engine loop failed")
        _send(outbox, EngineFailed(f"engine step failed: {_describe(exc)}"))
        return EXIT_FAILED
    finally:
        close = getattr(core, "close", None)  # test cores may have none
        if close is not None:
            close()


class EngineLoop:
    """The busy loop around one core. `run()` returns the process exit code."""

    def __init__(self, core: Any, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.last_stats: EngineStats | None = None
        self.refused: list[RequestOutput] = []  # admission failures to report next send
        self.is_shutdown = False

    def run(self) -> int:
        while True:
            self._drain_inbox(0 if self.core.has_unfinished_requests() else IDLE_POLL_MS)
            if self.is_shutdown:
                logger.info("engine shutting down")
                return 0
            if not self._parent_alive():
                logger.error("server process %d is gone; engine exiting", self.parent_pid)
                return EXIT_PARENT_GONE
            if self.core.has_unfinished_requests():
                result = self._step()
                self._publish(result)
                if not result.outputs and result.stats.num_scheduled_tokens == 0:
                    self._drain_inbox(STALLED_POLL_MS)  # waiting on fetches: do not spin hot
            elif self.refused:
                self._publish(EngineOutputs([], self.last_stats or EngineStats()))

    def _step(self) -> EngineOutputs:
        if not self.core.overlaps_steps:
            return self.core.step()
        # While the device runs the step: admit new requests and aborts (so building them
        # is off the step's critical path and they join the next step), then launch the
        # next step before this one's tokens are read.
        return self.core.step_overlapped(lambda: self._drain_inbox(0))

    def _drain_inbox(self, timeout_ms: int) -> None:
        """Handle every queued message; wait up to `timeout_ms` for the first one."""
        if timeout_ms and not self.poller.poll(timeout_ms):
            return
        while not self.is_shutdown:
            try:
                frames = self.inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle([frame.buffer for frame in frames])

    def _handle(self, frames: list[memoryview]) -> None:
        try:
            message, tensors = decode_engine_inbox(frames)
        except MessageDecodeError as exc:
            logger.warning("dropped an undecodable inbox message: %s", exc.message)
            return
        if isinstance(message, EngineRequest):
            self._add_request(message, tensors)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, Shutdown):
            self.is_shutdown = True

    def _add_request(self, request: EngineRequest, tensors: list) -> None:
        # EngineCore reports bad input itself; this guards the loop against anything else.
        try:
            self.core.add_request(request, tensors)
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the engine
            logger.exception("could not add request %s", request.request_id)
            if isinstance(exc, TesseraError):
                error = ErrorInfo(exc.message, type=exc.type, code=exc.code, status=exc.status)
            else:
                error = ErrorInfo("internal error", type="server_error", status=500)
            self.refused.append(
                RequestOutput(
                    request_id=request.request_id,
                    finish_reason=FinishReason.ERROR,
                    error=error,
                )
            )

    def _publish(self, result: EngineOutputs) -> None:
        outputs = self.refused + list(result.outputs)
        self.refused = []
        if not outputs and not _stats_changed(self.last_stats, result.stats):
            return
        self.last_stats = result.stats
        _send(self.outbox, EngineOutputs(outputs, result.stats))

    def _parent_alive(self) -> bool:
        # Re-parented (to init or a subreaper) means the server died, even by SIGKILL.
        return os.getppid() == self.parent_pid


def _stats_changed(previous: EngineStats | None, current: EngineStats) -> bool:
    if previous is None:
        return True
    for field in current.__struct_fields__:
        if field in _TIMING_FIELDS:
            continue
        value = getattr(current, field)
        if (field.endswith("_total") or isinstance(value, list | dict)) and value:
            return True  # counters and observations are deltas: they must reach the server
        if value != getattr(previous, field):
            return True
    return False


def _send(outbox: zmq.Socket, message: Any) -> None:
    outbox.send_multipart(encode_message(message), copy=False)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TesseraError):
        return exc.message
    return type(exc).__name__ + (f": {exc}" if str(exc) else "")
