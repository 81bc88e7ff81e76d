"""The engine process: builds an EngineCore and runs the busy loop between ZMQ sockets.

    server PUSH ──inbox──▶ [PULL]  engine  [PUSH] ──outbox──▶ PULL server

The server binds both sockets (it creates the addresses: `ipc://` paths in a private 0700
temp dir, or `tcp://HOST:PORT`) and starts this process with multiprocessing "spawn";
`run_engine` connects, sends `Ready`, then loops:

    drain inbox (blocking poll only when idle) -> add / abort -> step() -> send outputs

With several API processes (`--api-server-count`, server/api_servers.py) each one binds an
inbox and an outbox of its own and the engine connects to all of them. A request's outputs
go back through the outbox of the API process whose inbox it came from. `Ready` and
`EngineFailed` go to every API process. API process 0 gets every message, and only it
exports the engine's stats on /metrics, so counters are counted once. The others get an
`EngineOutputs` only when it holds their outputs, besides every `Heartbeat` and the
`MediaUuid`s the other API processes sent.

On a GPU (`core.overlaps_steps`), steps overlap (`EngineCore.step_overlapped`): while a
launched step runs, the inbox is drained and the next step is launched; then the first
one's sampled tokens are read.

It ignores SIGINT and SIGTERM (the server stops it once it has drained). It exits 0 on
`Shutdown` or STOP_SIGNAL, exits by itself when its parent (the server) is gone, and on an
unrecoverable error sends `EngineFailed` and exits non-zero so the server fails too.
Undecodable inbox messages are logged and dropped; the engine lives on.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.errors import TesseraError
from engine.logging_utils import configure_logging, name_this_process
from engine.protocol import (
    AbortRequests,
    EngineFailed,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    ErrorInfo,
    FinishReason,
    Heartbeat,
    MediaUuid,
    RequestOutput,
    Shutdown,
)
from engine.serialization import MessageDecodeError, decode_engine_inbox, encode_message

logger = logging.getLogger("tessera.engine")

HEARTBEAT_S = 1.0  # how often the loop tells every API process it goes round (Heartbeat)
IDLE_POLL_MS = 500  # blocking poll when idle; also how often a lost parent is noticed
STALLED_POLL_MS = 2  # when requests exist but nothing was schedulable (e.g. fetching)
EXIT_FAILED = 1
EXIT_PARENT_GONE = 3
EXIT_HUNG = 4  # a step ran past engine_step_timeout_s (StepWatchdog)
ENGINE_PROCESS_NAME = "tessera-engine"  # in log lines and ps / top
STOP_SIGNAL = signal.SIGUSR1
# The API process that gets every EngineOutputs and exports the engine's stats.
STATS_API_SERVER = 0
# Timing fields change every step; a message is worth sending only if something else did.
_TIMING_FIELDS = ("step_seconds", "vision_encoder_seconds")


def run_engine(
    config: EngineConfig,
    inbox_addresses: Sequence[str],
    outbox_addresses: Sequence[str],
    parent_pid: int,
    *,
    log_level: str = "info",
    log_format: str = "text",
    core_factory: Callable[[EngineConfig], Any] | None = None,
    run_dir: str | None = None,
) -> None:
    """Entry point of the engine process (a multiprocessing "spawn" target). Address i
    of `inbox_addresses` and of `outbox_addresses` belong to API process i. `run_dir`: the
    server's private folder (its ipc sockets, its metrics files), which the engine removes
    when it finds the server gone: a server killed with SIGKILL could not (fuzz47).

    `core_factory` builds the core (default `engine.core.EngineCore`); it must be a
    module-level callable so that spawn can pass it. Never returns normally on failure:
    exits with EXIT_FAILED after sending `EngineFailed`.
    """
    name_this_process(ENGINE_PROCESS_NAME)
    configure_logging(log_level, log_format)
    # Ctrl-C in a terminal reaches the whole process group, and systemd signals every
    # process of the service: the server drains first, then shuts us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # How the launcher of several API processes stops us once they have drained: unwind,
    # so that `core.close()` stops tensor-parallel workers and fetchers.
    signal.signal(STOP_SIGNAL, _exit_on_stop_signal)
    set_intra_op_threads(config)
    if len(inbox_addresses) != len(outbox_addresses) or not inbox_addresses:
        raise ValueError("one inbox and one outbox address per API process")
    context = zmq.Context()
    inboxes = [_connected(context, zmq.PULL, address) for address in inbox_addresses]
    outboxes = [_connected(context, zmq.PUSH, address) for address in outbox_addresses]
    try:
        exit_code = _serve(config, inboxes, outboxes, parent_pid, core_factory)
    finally:
        for inbox in inboxes:
            inbox.close(linger=0)
        for outbox in outboxes:
            outbox.close(linger=2000)  # let a final EngineOutputs / EngineFailed go out
        context.term()
    if exit_code == EXIT_PARENT_GONE and run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    if exit_code:
        sys.exit(exit_code)


def set_intra_op_threads(config: EngineConfig) -> None:
    """The engine process's torch intra-op threads: `num_threads` where given, else one
    with a GPU, else torch's default. Here, not in the model runner, so that an in-process
    `LLM` leaves its caller's setting alone. torch is imported here: the API processes
    import this module and never need it.

    With a GPU the engine's host tensor work is bookkeeping over small tensors (ids to
    pin and copy, attention plans) that gains nothing from threads, and a parallel region
    waits for its slowest thread: while the API process, image decoding and clients keep
    the cores busy, one descheduled thread stalls the region, and with it the next step's
    launch. `bench/host_threads.py` on this project's 2-core machine, on host work of that
    size (the penalty's ids for 128 rows as the sampler built them before
    engine/held_tokens.py): 0.35 ms on 2 threads and 0.25 ms on 1 while quiet, 1.2 against
    0.25 ms beside one spinning process, 23 against 0.5 ms beside two. vLLM's GPU workers
    run with one thread for the same reason."""
    import torch

    from engine.device_config import resolve_device

    threads = config.num_threads
    if not threads and resolve_device(config.device).type == "cuda":
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def _exit_on_stop_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _connected(context: zmq.Context, kind: int, address: str) -> zmq.Socket:
    socket = context.socket(kind)
    socket.connect(address)
    return socket


def _serve(config, inboxes, outboxes, parent_pid, core_factory) -> int:
    try:
        if core_factory is None:
            from engine.core import EngineCore

            core_factory = EngineCore
        core = core_factory(config)
        ready = core.ready
    except Exception as exc:  # noqa: BLE001 - report why start-up failed, then exit
        if _is_expected(exc):  # a bad checkpoint or setting: the reason is enough
            logger.error("engine start-up failed: %s", _describe(exc))
        else:
            logger.exception("engine start-up failed")
        _send_to_all(outboxes, EngineFailed(f"engine start-up failed: {_describe(exc)}"))
        return EXIT_FAILED
    logger.info(
        "engine ready: model=%s device=%s dtype=%s kv_blocks=%d max_model_len=%d",
        ready.model_name,
        ready.device,
        ready.dtype,
        ready.num_kv_blocks,
        ready.max_model_len,
    )
    _send_to_all(outboxes, ready)
    loop = EngineLoop(core, inboxes, outboxes, parent_pid, config.api_server_stall_timeout_s)
    StepWatchdog(loop, config.engine_step_timeout_s).start()
    try:
        return loop.run()
    except Exception as exc:  # noqa: BLE001 - the server must learn why we died
        logger.exception("engine loop failed")
        _send_to_all(outboxes, EngineFailed(f"engine step failed: {_describe(exc)}"))
        return EXIT_FAILED
    finally:
        close = getattr(core, "close", None)  # test cores may have none
        if close is not None:
            close()


class StepWatchdog:
    """Ends the engine process when one pass of its loop runs past `timeout_s`: a device
    that hangs (a kernel, a collective), or a deadlock. Requests would otherwise wait
    forever while /health said ok. The exit makes the server fail their requests with a
    503 and exit non-zero, for its supervisor to restart (SGLang's watchdog does the same).
    The main thread's stack goes to the log first, to say where it hung.

    A pass still running after a tenth of the timeout is logged once, as a warning: a
    tensor-parallel worker stopped for 30 s held every request without a word in the log
    until it went on or the timeout came (fuzz47)."""

    def __init__(self, loop: EngineLoop, timeout_s: float, warn_after_s: float | None = None):
        self._loop = loop
        self._timeout_s = timeout_s
        self._warn_after_s = timeout_s / 10 if warn_after_s is None else warn_after_s
        self._warned_pass: float | None = None  # the pass already warned of

    def start(self) -> None:
        if self._timeout_s > 0:
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self._warn_after_s / 2))
            last_pass = self._loop.last_pass
            stalled = time.monotonic() - last_pass
            if stalled > self._warn_after_s and self._warned_pass != last_pass:
                self._warned_pass = last_pass
                logger.warning(
                    "engine step has run %.0f s (engine_step_timeout_s %g ends the engine): "
                    "waiting on the device, a tensor-parallel rank, or a deadlock",
                    stalled,
                    self._timeout_s,
                )
            if stalled > self._timeout_s:
                logger.error(
                    "engine step has run %.0f s, past engine_step_timeout_s (%g): exiting; "
                    "the stack it is stuck in follows",
                    stalled,
                    self._timeout_s,
                )
                faulthandler.dump_traceback(all_threads=True)
                from engine.shard_worker import kill_all_workers  # torch: engine side only

                kill_all_workers()  # no unwinding below, so no close() stops them
                os._exit(EXIT_HUNG)  # no unwinding: the main thread is stuck


class EngineLoop:
    """The busy loop around one core. `run()` returns the process exit code.

    `inboxes[i]` and `outboxes[i]` are API process i's (see the module docstring)."""

    def __init__(
        self,
        core: Any,
        inboxes: Sequence[zmq.Socket],
        outboxes: Sequence[zmq.Socket],
        parent_pid: int,
        stall_timeout_s: float = 30.0,
    ):
        self.core = core
        self.inboxes = list(inboxes)
        self.outboxes = list(outboxes)
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        for inbox in self.inboxes:
            self.poller.register(inbox, zmq.POLLIN)
        self.last_stats: EngineStats | None = None
        self.refused: list[RequestOutput] = []  # admission failures to report next send
        self.is_shutdown = False
        # request id -> the API process it came from; kept only with several of them
        self.api_server_of: dict[str, int] = {}
        self.is_dropping_stats = False
        self.last_pass = time.monotonic()  # when the loop last went round (StepWatchdog)
        # With several API processes, what each has not taken yet (its queue is full), and
        # since when: outputs wait here, never in a blocking send, so that a process that
        # stopped reading (stopped, wedged, dead) never stalls the others' requests.
        self.unsent: list[collections.deque[list]] = [collections.deque() for _ in outboxes]
        self.stalled_since: list[float | None] = [None] * len(self.outboxes)
        self.stall_timeout_s = stall_timeout_s
        self.last_heartbeat = 0.0

    def run(self) -> int:
        while True:
            self.last_pass = time.monotonic()
            self._drain_inbox(0 if self.core.has_unfinished_requests() else IDLE_POLL_MS)
            if self.is_shutdown:
                logger.info("engine shutting down")
                return 0
            if not self._parent_alive():
                logger.error("server process %d is gone; engine exiting", self.parent_pid)
                return EXIT_PARENT_GONE
            self._flush_unsent()
            self._heartbeat()
            self._check_alive()
            if self.core.has_unfinished_requests():
                result = self._step()
                self._publish(result)
                if not result.outputs and result.stats.num_scheduled_tokens == 0:
                    self._drain_inbox(STALLED_POLL_MS)  # waiting on fetches: do not spin hot
            else:  # idle: refusals, and figures that move without a step (if changed)
                self._publish(EngineOutputs([], self.core.idle_stats()))

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
        for api_server, inbox in enumerate(self.inboxes):
            while not self.is_shutdown:
                try:
                    frames = inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle([frame.buffer for frame in frames], api_server)

    def _handle(self, frames: list[memoryview], api_server: int = 0) -> None:
        try:
            message, tensors = decode_engine_inbox(frames)
        except MessageDecodeError as exc:
            logger.warning("dropped an undecodable inbox message: %s", exc.message)
            return
        if isinstance(message, EngineRequest):
            if len(self.outboxes) > 1:
                self.api_server_of[message.request_id] = api_server
            self._add_request(message, tensors)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, Shutdown):
            self.is_shutdown = True
        elif isinstance(message, MediaUuid):  # for the other API processes, not the engine
            for index, outbox in enumerate(self.outboxes):
                if index != api_server:
                    # Never wait on a process that stopped reading (draining, as for stats):
                    # it only misses the uuid, and answers a uuid-only part with a 400.
                    with contextlib.suppress(zmq.Again):
                        outbox.send_multipart(encode_message(message), flags=zmq.NOBLOCK)

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
        if len(self.outboxes) == 1:
            _send(self.outboxes[0], EngineOutputs(outputs, result.stats))
            return
        routed: list[list[RequestOutput]] = [[] for _ in self.outboxes]
        for output in outputs:
            if output.finish_reason is None:
                api_server = self.api_server_of.get(output.request_id, 0)
            else:
                api_server = self.api_server_of.pop(output.request_id, 0)
            routed[api_server].append(output)
        for api_server, (outbox, own) in enumerate(zip(self.outboxes, routed, strict=True)):
            if own:
                self.unsent[api_server].append(encode_message(EngineOutputs(own, result.stats)))
                self._flush(api_server)
            elif api_server == STATS_API_SERVER:
                self._send_stats_only(outbox, EngineOutputs([], result.stats))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat < HEARTBEAT_S:
            return
        self.last_heartbeat = now
        for outbox in self.outboxes:  # one that is not reading misses it: nothing waits on it
            with contextlib.suppress(zmq.Again):
                outbox.send_multipart(encode_message(Heartbeat()), flags=zmq.NOBLOCK)

    def _flush_unsent(self) -> None:
        for api_server, unsent in enumerate(self.unsent):
            if unsent:
                self._flush(api_server)

    def _flush(self, api_server: int) -> None:
        """Sends API process `api_server` what it has not taken, as far as its queue takes
        it. One that has taken nothing for `stall_timeout_s` has its requests aborted: the
        engine stops spending steps on answers nobody reads (what is owed stays queued
        for it, the aborts' last outputs included, in case it reads again)."""
        unsent = self.unsent[api_server]
        while unsent:
            try:
                self.outboxes[api_server].send_multipart(unsent[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            unsent.popleft()
            self.stalled_since[api_server] = None
        if not unsent:
            return
        now = time.monotonic()
        since = self.stalled_since[api_server]
        if since is None:
            self.stalled_since[api_server] = now
        elif now - since > self.stall_timeout_s:
            request_ids = [rid for rid, owner in self.api_server_of.items() if owner == api_server]
            if request_ids:
                logger.error(
                    "API process %d has read no outputs for %.0f s (api_server_stall_timeout_s):"
                    " aborting its %d requests",
                    api_server, now - since, len(request_ids),
                )  # fmt: skip
                self.core.abort_requests(request_ids)  # their last outputs queue for it
                self.stalled_since[api_server] = now

    def _send_stats_only(self, outbox: zmq.Socket, message: EngineOutputs) -> None:
        """Never wait to send API process 0 stats alone: in a drain it may have exited
        while others still stream, and a full queue of unread stats would block the
        engine. A full queue (SNDHWM messages behind) drops them: metrics lose a little;
        outputs are never dropped."""
        try:
            outbox.send_multipart(encode_message(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if not self.is_dropping_stats:
                logger.warning("API process 0 is not reading; dropping engine stats for now")
            self.is_dropping_stats = True
            return
        self.is_dropping_stats = False

    def _check_alive(self) -> None:
        """A tensor-parallel worker that died fails the engine now, idle or not (raises)."""
        check_alive = getattr(self.core, "check_alive", None)  # test cores may have none
        if check_alive is not None:
            check_alive()

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


def _send_to_all(outboxes: Sequence[zmq.Socket], message: Any) -> None:
    for outbox in outboxes:
        _send(outbox, message)


def _is_expected(exc: BaseException) -> bool:
    """A start-up failure that is no bug: a typed error, a KV cache too big for memory, or
    damaged safetensors (`tessera serve` checks for most of them before it starts us)."""
    from safetensors import SafetensorError

    from engine.kv_cache_sizing import MemoryBudgetError

    return isinstance(exc, (TesseraError, MemoryBudgetError, SafetensorError))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TesseraError):
        return exc.message
    if _is_expected(exc):  # the message says what is wrong; the type name adds nothing
        return str(exc)
    return type(exc).__name__ + (f": {exc}" if str(exc) else "")
