"""Several API processes in front of one engine: `tessera serve --api-server-count N`.

One API process parses every request, decodes and preprocesses its images, detokenizes
and streams every token. On a GPU host that Python process, not the GPU, bounds time to
first token under load (docs/gpu.md: 27-35 ms of its CPU per image request, a whole core
busy). With N > 1, `tessera serve` is a launcher:

    launcher ─┬─ spawn ─▶ engine process: one inbox and one outbox socket per API process
              └─ spawn ─▶ API process i (i < N): EngineClient attached to the engine by
                          pid + uvicorn accepting on the launcher's listening socket

* The launcher binds the HTTP port once and hands the socket to every API process; the
  kernel gives each new connection to one of the processes accepting on it.
* Each API process binds its own inbox and outbox (ipc:// in the launcher's private 0700
  directory); the engine connects to all of them and answers each request through the
  outbox of the process it came from (engine/process.py).
* The API processes admit against one budget of `max_num_seqs`, `max_waiting_requests`
  and `max_waiting_tokens`: what each admitted sits in a shared array of the launcher's
  (server/admission.py). Each keeps its own processed-image cache.
* /metrics: prometheus_client's multiprocess mode, in a directory of the launcher's; any
  process answers with the sum (server/metrics.py). API process 0 exports the engine's
  stats.
* Stopping: SIGTERM or SIGINT to the launcher is passed on as SIGUSR1 to each API
  process, which drains like a single server (cli.GracefulServer); a second signal stops
  them sooner. API processes and the engine ignore SIGINT and SIGTERM themselves, so a
  terminal's Ctrl-C (the process group) or systemd (every process of the service) reach
  them once, through the launcher. When they have all exited the launcher stops the
  engine (its STOP_SIGNAL) and exits 0.
* Failure: when the engine or an API process exits unasked, the launcher stops the rest
  and exits 1, so a supervisor restarts the whole server. API processes notice a dead
  engine or launcher by pid (server/attached_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from engine.logging_utils import configure_logging, name_this_process
from engine.process import STOP_SIGNAL, run_engine
from engine.process_tree import kill_tree
from server.admission import shared_counts_array
from server.cli import API_PROCESS_DRAIN_SIGNAL, bind_port, run_server
from server.metric_names import MULTIPROC_DIR_ENV
from server.settings import ServerSettings

logger = logging.getLogger("tessera.api_servers")

EXIT_OK = 0
EXIT_FAILED = 1
WATCH_INTERVAL_S = 0.2
ENGINE_STOP_TIMEOUT_S = 10.0
# Past its drain (`shutdown_timeout_s`), how long an API process has to end its requests
# and exit, and after a third signal, before the launcher kills it: one that is stopped
# (SIGSTOP) or wedged would keep the launcher, and so the service, up for ever.
DRAIN_EXIT_GRACE_S = 10.0
STOP_NOW_GRACE_S = 2.0
# An API process asked to drain exits 0, or dies of the signal if it came before its
# handler was installed.
_ASKED_EXIT_CODES = (0, -API_PROCESS_DRAIN_SIGNAL)


def api_process_name(index: int) -> str:
    """What API process `index` is called in log lines and ps / top."""
    return f"tessera-api-{index}"


@dataclass(frozen=True)
class ApiServerSlot:
    """What API process `index` needs from the launcher (passed through spawn)."""

    index: int
    inbox_address: str
    outbox_address: str
    engine_pid: int
    listener: socket.socket
    # what each API process admitted, shared (server/admission.py)
    admission_counts: Any = None


def run_api_servers(settings: ServerSettings) -> int:
    """The launcher: start the engine and the API processes, watch them, stop them;
    returns the exit code (0 after a clean stop, 1 when a process failed)."""
    run_dir = tempfile.mkdtemp(prefix="tessera-")  # mode 0700: only us
    try:
        listener = bind_port(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        shutil.rmtree(run_dir, ignore_errors=True)
        return EXIT_FAILED
    metrics_dir = os.path.join(run_dir, "metrics")
    os.mkdir(metrics_dir)
    # Read by prometheus_client when each spawned API process imports it.
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir
    count = settings.api_server_count
    inboxes = [f"ipc://{run_dir}/inbox-{index}" for index in range(count)]
    outboxes = [f"ipc://{run_dir}/outbox-{index}" for index in range(count)]
    spawn = multiprocessing.get_context("spawn")
    engine = spawn.Process(
        target=run_engine,
        args=(settings.engine, inboxes, outboxes, os.getpid()),
        kwargs={"log_level": settings.log_level, "log_format": settings.log_format,
                "run_dir": run_dir},  # fmt: skip
        name="tessera-engine",
        daemon=True,
    )
    api_servers: list[multiprocessing.process.BaseProcess] = []
    admission_counts = shared_counts_array(spawn, count)
    launcher = _Launcher(settings.shutdown_timeout_s)
    try:
        with launcher.capturing_signals():
            engine.start()
            logger.info("engine process %d starting (model %s)", engine.pid, settings.engine.model)
            for index in range(count):
                slot = ApiServerSlot(index, inboxes[index], outboxes[index], engine.pid, listener,
                                     admission_counts)  # fmt: skip
                process = spawn.Process(
                    target=serve_api_process,
                    args=(settings, slot),
                    name=api_process_name(index),
                    daemon=True,
                )
                process.start()
                logger.info("API process %d (index %d) starting", process.pid, index)
                api_servers.append(process)
            listener.close()  # the API processes hold their own copies
            return launcher.watch(engine, api_servers)
    except OSError as exc:  # e.g. no memory to start a process
        logger.error("could not start a process: %s", exc)
        return EXIT_FAILED
    finally:
        listener.close()
        for process in api_servers:  # exited already, unless the launcher itself failed
            _stop(process, API_PROCESS_DRAIN_SIGNAL, settings.shutdown_timeout_s)
        _stop(engine, STOP_SIGNAL, ENGINE_STOP_TIMEOUT_S)
        shutil.rmtree(run_dir, ignore_errors=True)


class _Launcher:
    """Signals in, drain signals out, and the watch over the children."""

    def __init__(self, shutdown_timeout_s: float) -> None:
        self.shutdown_timeout_s = shutdown_timeout_s
        self.num_signals = 0  # SIGINT / SIGTERM received
        self.num_drains = 0  # drain signals sent to every API process
        self.failed = False
        self.kill_at: float | None = None  # when API processes still up get SIGKILL

    @contextlib.contextmanager
    def capturing_signals(self):
        def on_signal(signum: int, frame) -> None:
            self.num_signals += 1

        originals = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def watch(self, engine, api_servers) -> int:
        """Until every API process has exited; then the caller stops the engine."""
        remaining = list(api_servers)
        while remaining:
            sentinels = [process.sentinel for process in (engine, *remaining)]
            multiprocessing.connection.wait(sentinels, timeout=WATCH_INTERVAL_S)
            if self.num_signals > self.num_drains:  # a second one stops them sooner
                self._drain(remaining)
            for process in [p for p in remaining if not p.is_alive()]:
                remaining.remove(process)
                if not (self.num_drains and process.exitcode in _ASKED_EXIT_CODES):
                    self._fail(f"API process {process.pid} exited with code {process.exitcode}")
            if remaining and not engine.is_alive():
                self._fail(f"engine process {engine.pid} exited with code {engine.exitcode}")
            if self.failed and not self.num_drains:
                self._drain(remaining)  # a dead engine fails their requests at once
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                self._kill(remaining)
        return EXIT_FAILED if self.failed else EXIT_OK

    def _kill(self, processes) -> None:
        for process in processes:
            if process.is_alive():
                self._fail(f"API process {process.pid} did not exit after its drain; killed")
                process.kill()

    def _drain(self, processes) -> None:
        if not self.num_drains:
            logger.info("stopping: draining the API processes")
            self.kill_at = time.monotonic() + self.shutdown_timeout_s + DRAIN_EXIT_GRACE_S
        self.num_drains += 1
        if self.num_drains >= 3:  # each process stops at once: give them a moment
            self.kill_at = min(self.kill_at, time.monotonic() + STOP_NOW_GRACE_S)
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, API_PROCESS_DRAIN_SIGNAL)

    def _fail(self, reason: str) -> None:
        if not self.failed:
            logger.error("%s; stopping the server", reason)
        self.failed = True


def _stop(process: multiprocessing.process.BaseProcess, signum: int, timeout: float) -> None:
    """Send `signum` to `process` if it runs; after `timeout` s SIGKILL it with every
    process it started (the engine's tensor-parallel workers: fuzz47). Never started:
    nothing to do."""
    if process.pid is None:
        return
    if process.is_alive():
        os.kill(process.pid, signum)
        process.join(timeout)
    if process.is_alive():
        logger.warning("%s (%d) did not exit; killing it", process.name, process.pid)
        kill_tree(process.pid)
        process.join(2.0)


def serve_api_process(settings: ServerSettings, slot: ApiServerSlot) -> None:
    """Entry point of API process `slot.index` (a multiprocessing "spawn" target)."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the launcher passes them on, once
        signal.signal(sig, signal.SIG_IGN)
    name_this_process(api_process_name(slot.index))
    configure_logging(settings.log_level, settings.log_format)
    sys.exit(asyncio.run(run_server(settings, slot)))
