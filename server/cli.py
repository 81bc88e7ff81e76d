"""The `tessera` command line.

    tessera serve [--model DIR] [--config FILE.yaml] [--port N] ...   run the HTTP server
    tessera make-tiny-model OUT_DIR [--seed N] [--size tiny|...]      write a random checkpoint
    tessera encode-features ...                                       pre-encode media features
    tessera bench serve --base-url URL ...                            load-test a server

`serve` exits 0 after a clean shutdown (SIGTERM / SIGINT: stop accepting, drain in-flight
requests for up to `shutdown_timeout_s`, stop the engine), 1 when the port is taken (found
before the engine loads) or the engine fails to start or dies (so a supervisor restarts
the server), 2 on bad settings. With
`--api-server-count N` > 1 it is the launcher of server/api_servers.py, with the same
exit codes; each of its API processes runs `run_server` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from engine.errors import EngineDeadError, ModelLoadError
from engine.generation_defaults import GenerationConfigError
from engine.logging_utils import configure_logging
from engine.multimodal.chat_template import ChatTemplateError
from server.accept_errors import throttle_accept_errors
from server.admission import ServerDraining
from server.engine_client import EngineClient
from server.http_protocol import timed_h11_protocol
from server.metric_names import MULTIPROC_DIR_ENV
from server.preflight import check_model_folder

if TYPE_CHECKING:
    from server.api_servers import ApiServerSlot
from server.settings import (
    ServerSettings,
    SettingsError,
    load_settings,
    naming_sources,
    setting_sources,
    unknown_environment_variables,
)

logger = logging.getLogger("tessera.cli")

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1
EXIT_USAGE = 2
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
API_PROCESS_DRAIN_SIGNAL = signal.SIGUSR1  # one of several API processes drains on it
# How long a drain that ended its last requests (GracefulServer) waits for their handlers to
# write the error and finish before uvicorn stops.
STOPPED_REQUESTS_FLUSH_S = 2.0


def serve_main(argv: Sequence[str]) -> int:
    """`tessera serve`: load settings, start the engine, run uvicorn until stopped."""
    try:
        settings = load_settings(argv, os.environ)
    except SettingsError as exc:
        print(f"tessera serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(settings.log_level, settings.log_format)
    try:
        settings = _resolve_default_model(settings)
    except OSError as exc:  # server.default_model.DefaultModelError
        print(f"tessera serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:  # bad settings of the API layer fail before the engine loads (the app reads them again)
        settings.sampling_defaults()
        settings.chat_template_source()
    except (GenerationConfigError, ChatTemplateError) as exc:
        print(f"tessera serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_model_folder(settings)
    except SettingsError as exc:  # a device, backend or KV cache this machine cannot run
        message = naming_sources(str(exc), setting_sources(argv, os.environ), exc.settings)
        print(f"tessera serve: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except ModelLoadError as exc:
        print(f"tessera serve: error: {exc.message}", file=sys.stderr)
        return EXIT_ENGINE_FAILED
    for warning in [*open_doors(settings), *unknown_environment_variables(os.environ)]:
        logger.warning("%s", warning)
    if settings.api_server_count > 1:
        from server.api_servers import run_api_servers

        return run_api_servers(settings)
    _ignore_inherited_multiprocess_dir()
    return asyncio.run(run_server(settings))


def open_doors(settings: ServerSettings) -> list[str]:
    """What the settings leave open to every client, said once at start-up."""
    doors = []
    if settings.api_key is None and not _is_loopback(settings.host):
        doors.append(
            f"listening on {settings.host} without an API key: anyone who reaches port "
            f"{settings.port} can use the model (set --api-key or TESSERA_API_KEY)"
        )
    if (
        settings.enable_feature_inputs
        and settings.allowed_feature_buckets is None
        and settings.engine.allowed_feature_url_prefixes is None
    ):
        doors.append(
            "feature inputs may name any S3 bucket: a client can read every object the "
            "server's credentials can (its errors tell whether one exists, and its tensors' "
            "names and shapes); set --allowed-feature-buckets or "
            "--allowed-feature-url-prefixes"
        )
    return doors


def _ignore_inherited_multiprocess_dir() -> None:
    """One API process keeps its metrics in memory. prometheus_client would switch to its
    multiprocess files on an inherited PROMETHEUS_MULTIPROC_DIR (set for gunicorn, say):
    the process metrics gone, and an earlier run's files summed into the counters. Only
    the --api-server-count launcher sets it, for its own processes. prometheus_client
    reads it at import, which comes later (server/metrics.py)."""
    inherited = os.environ.pop(MULTIPROC_DIR_ENV, None)
    if inherited is not None:
        logger.warning("ignoring %s=%s: one API process keeps its metrics in memory",
                       MULTIPROC_DIR_ENV, inherited)  # fmt: skip


def _resolve_default_model(settings: ServerSettings) -> ServerSettings:
    from server.default_model import ensure_default_model, is_default_model

    if not is_default_model(settings.engine.model):
        return settings
    path = ensure_default_model(Path(settings.engine.model))
    logger.warning(
        "no --model given: serving the built-in tiny model from %s. Its weights are RANDOM "
        "and its output is gibberish; pass --model DIR to serve a real checkpoint.",
        path,
    )
    served_name = settings.engine.served_model_name or "tessera-tiny-random"
    return settings.replace(engine=settings.engine.replace(served_model_name=served_name))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not yet listening: a port in use is found before
    the engine loads (minutes on a GPU), and until uvicorn listens a client is refused
    rather than left waiting on a server that is not ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only then (with
    # proto 0, Nagle held every small response ~40 ms behind the delayed ACK)
    bound = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        bound.bind((host, port))
    except OSError:
        bound.close()
        raise
    bound.set_inheritable(True)
    return bound


async def run_server(settings: ServerSettings, slot: ApiServerSlot | None = None) -> int:
    """Engine first (wait for Ready), then the HTTP server; returns the exit code.

    With `slot` this is one of several API processes (server/api_servers.py): it attaches
    to the launcher's engine and serves on the launcher's listening socket."""
    throttle_accept_errors(asyncio.get_running_loop())  # server/accept_errors.py
    server: uvicorn.Server | None = None
    admissions: list = []  # the app's, once it is built
    death_reasons: list[str] = []
    if slot is not None:
        bound = slot.listener
    else:
        try:
            bound = bind_port(settings.host, settings.port)
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
            return EXIT_ENGINE_FAILED

    def on_engine_death(reason: str) -> None:
        death_reasons.append(reason)
        logger.error("the engine died (%s); stopping the server", reason)
        # Requests still fetching their media end now, with engine_dead: they waited for
        # their fetch's deadline (a URL that never answers: then a 400), and the exit with them.
        for admission in admissions:
            admission.stop_all(EngineDeadError("the engine is not running"))
        if server is not None:
            server.should_exit = True

    engine = EngineClient(
        settings.engine,
        startup_timeout=settings.engine_startup_timeout_s,
        inbox_address=slot.inbox_address if slot else settings.engine_inbox_address,
        outbox_address=slot.outbox_address if slot else settings.engine_outbox_address,
        on_engine_death=on_engine_death,
        log_level=settings.log_level,
        log_format=settings.log_format,
        engine_pid=slot.engine_pid if slot else None,
    )
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    # An API process of several stops on its launcher's signal alone (server/api_servers.py).
    stop_signal = API_PROCESS_DRAIN_SIGNAL if slot else signal.SIGTERM
    try:
        # Until uvicorn takes over the signals, SIGTERM aborts the (possibly long) start-up.
        loop.add_signal_handler(stop_signal, task.cancel)
        try:
            await engine.start()
        except EngineDeadError as exc:
            logger.error("the engine failed to start: %s", exc.message)
            return EXIT_ENGINE_FAILED
        except asyncio.CancelledError:
            logger.info("stopped during start-up")
            return EXIT_OK
        finally:
            loop.remove_signal_handler(stop_signal)
        from server.app import build_app

        app = build_app(
            settings,
            engine,
            api_server_index=slot.index if slot else 0,
            admission_counts=slot.admission_counts if slot else None,
        )
        admissions.append(app.state.admission)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            # h11, so that its header-size backstop below applies, with a deadline for each
            # header block (server/http_protocol.py)
            http=timed_h11_protocol(settings.request_read_timeout_s, settings.write_timeout_s),
            # server/request_limits.py enforces max_header_bytes exactly (431); h11's
            # limit bounds what is buffered until then (see that module's docstring).
            h11_max_incomplete_event_size=2 * settings.max_header_bytes,
            timeout_keep_alive=settings.timeout_keep_alive_s,
            timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
            log_config=None,  # keep configure_logging's handlers and format
            log_level=settings.log_level,
            server_header=False,
            lifespan="on",
        )

        def stop_all() -> int:
            app.state.admission.stop_all()  # those still preparing (fetching media, ...)
            return engine.stop_all(
                ServerDraining("the server shut down before this request finished")
            )

        # uvicorn says where it listens only when it binds the socket itself
        address = None if slot is not None and slot.index else listening_address(bound)
        server = GracefulServer(config, stop_all, announce=address)
        if slot is not None:
            server.handled_signals = (API_PROCESS_DRAIN_SIGNAL,)
        try:
            await server.serve(sockets=[bound])
        except SystemExit:  # uvicorn's exit 3: the app's start-up failed (logged above)
            logger.error("the API failed to start; see the error above")
            return EXIT_ENGINE_FAILED
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # Bound (not listening) since start-up, but another server listened first.
            logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
            lifespan = getattr(server, "lifespan", None)  # started: end it, as uvicorn does
            if lifespan is not None:
                await lifespan.shutdown()
            return EXIT_ENGINE_FAILED
        if death_reasons or not server.started:
            return EXIT_ENGINE_FAILED
        return EXIT_OK
    finally:
        await engine.shutdown(timeout=10.0)
        if slot is None:
            bound.close()


def listening_address(sock: socket.socket) -> str:
    """http://host:port of a bound socket (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose SIGINT/SIGTERM handling is a graceful shutdown, after which
    `serve()` returns (uvicorn would re-raise the signal, skipping the engine's shutdown).

    The first signal starts a DRAIN while still listening: `/health` and every new request
    answer 503 at once (the app's AdmissionController), in-flight requests run on for up to
    `timeout_graceful_shutdown` seconds. What is still running then, or at a second signal,
    is ended with a 503 `server_draining` error (a stream's last event), not a cut
    connection (`stop_all`: EngineClient.stop_all), and uvicorn stops. A third signal stops
    at once."""

    _loop: asyncio.AbstractEventLoop | None = None
    _is_draining = False
    _stop_now = False  # a second signal: end the drain now
    handled_signals: tuple[signal.Signals, ...] = HANDLED_SIGNALS

    def __init__(
        self,
        config: uvicorn.Config,
        stop_all: Callable[[], int] | None = None,
        announce: str | None = None,
    ):
        super().__init__(config)
        self._stop_all = stop_all
        self._announce = announce  # logged once listening: "serving on http://..."

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._announce:
            logger.info("serving on %s", self._announce)

    def handle_exit(self, sig: int, frame) -> None:
        admission = getattr(getattr(self.config.app, "state", None), "admission", None)
        if self._stop_now:
            logger.info("a third signal: stopping at once")
            self.should_exit = self.force_exit = True
            return
        if self._is_draining:
            self._stop_now = True
            logger.info("a second signal: ending the requests still in flight")
            return
        if admission is None or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._is_draining = True
        admission.start_draining()
        logger.info("draining: refusing new requests, waiting for in-flight ones")
        self._loop.call_soon_threadsafe(self._start_drain, admission)

    def _start_drain(self, admission) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(admission))  # keep a reference

    async def _drain(self, admission) -> None:
        deadline = time.monotonic() + self.config.timeout_graceful_shutdown
        while admission.num_in_flight > 0 and time.monotonic() < deadline:
            if self.should_exit or self._stop_now:
                break
            await asyncio.sleep(0.05)
        if admission.num_in_flight > 0 and self._stop_all is not None and not self.should_exit:
            ended = self._stop_all()
            logger.warning("the drain ended %d requests still generating, and %d preparing",
                           ended, admission.num_preparing)  # fmt: skip
            # Their handlers write the error (a body, a stream's last event) and finish.
            flushed = time.monotonic() + STOPPED_REQUESTS_FLUSH_S
            while admission.num_in_flight > 0 and time.monotonic() < flushed:
                await asyncio.sleep(0.05)
        self.config.timeout_graceful_shutdown = max(1, round(deadline - time.monotonic()))
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in self.handled_signals}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def make_tiny_model_main(argv: Sequence[str]) -> int:
    from engine.tiny_model import main

    return main(list(argv)) or 0


def encode_features_main(argv: Sequence[str]) -> int:
    from engine.encode_features import main

    return main(list(argv)) or 0


def bench_main(argv: Sequence[str]) -> int:
    """`tessera bench serve ...`: the load client (bench/serve.py)."""
    usage = "usage: tessera bench serve [--help]\n\n  serve  load-test an OpenAI-compatible server"
    if argv and argv[0] in ("-h", "--help"):  # as `tessera --help` tells (fuzz86: exit 2)
        print(usage)
        return EXIT_OK
    if not argv or argv[0] != "serve":
        print(usage, file=sys.stderr)
        return EXIT_USAGE
    from bench.serve import main

    return main(list(argv[1:]))


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "serve": (serve_main, "serve a model over an OpenAI-compatible HTTP API"),
    "make-tiny-model": (
        make_tiny_model_main,
        "write a small random-weight Qwen-VL, Qwen or Llama checkpoint",
    ),
    "encode-features": (
        encode_features_main,
        "encode images and videos with the model's vision tower into feature files",
    ),
    "bench": (bench_main, "bench serve: load-test an OpenAI-compatible server"),
}


def _usage() -> str:
    lines = ["usage: tessera COMMAND [ARGS]  (tessera COMMAND --help for its flags)", ""]
    lines += [f"  {name:<18}{summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script `tessera`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return EXIT_OK if argv else EXIT_USAGE
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"tessera: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_USAGE
    return command[0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
