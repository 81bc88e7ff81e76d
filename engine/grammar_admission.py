"""The COMPILING state: requests wait here while their structured output's grammar compiles.

Compiling a grammar takes about 1 ms for a small JSON schema, 20-50 ms for a large one,
over a second for thousands of properties and, for a hostile regex, as long as
`--grammar-lexer-fuel` lets it; on the engine loop that time would be added to every
running request's next token. So `EngineCore` hands a request whose grammar is not in the
compiled-grammar cache to one worker thread (llguidance releases the GIL while it
compiles), and `admit_finished()`, called at the top of every step, passes compiled
requests on. A spec compiled before (the same schema or tool set again) is copied on the
loop in microseconds and never waits here. The worker takes the smallest spec first: a
small schema waits for at most the compile under way, not for every large one queued
before it (four queued 5000-property schemas held a one-property one 8.8-12 s).

    add_request ──(no grammar, or cached)──────────────▶ FETCHING or scheduler.waiting
         └──▶ COMPILING ──(compiled)──────────────────▶ FETCHING or scheduler.waiting
                 ├──(unusable grammar)──▶ finished with a 400 ErrorInfo
                 └──(abort)──▶ finished ABORT (a compile under way runs on and is cached;
                                a queued one is dropped)
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import TesseraError, error_info
from engine.protocol import FinishReason, MediaInput, RequestOutput
from engine.request import Request

if TYPE_CHECKING:
    from engine.structured_output import GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)


class SmallestFirstWorker:
    """One thread that runs submitted calls smallest `size` first (ties: in order)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: list[tuple[int, int, concurrent.futures.Future, Callable, tuple]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, size: int, call: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            heapq.heappush(self._queue, (size, next(self._order), future, call, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._ready.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                _, _, future, call, args = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller reads it from the future
                future.set_exception(exc)

    def close(self) -> None:
        """Cancels what waits; a call under way runs to its end on the (daemon) thread."""
        with self._ready:
            self._closed = True
            for _, _, future, _, _ in self._queue:
                future.cancel()
            self._queue.clear()
            self._ready.notify()


class GrammarAdmission:
    """Requests in COMPILING, keyed by request id; owns the (lazily started) worker."""

    def __init__(self, compiler: Callable[[], GrammarCompiler]) -> None:
        self._compiler = compiler  # made on first use: llguidance is imported lazily
        # One worker: compiles queue rather than take cores from the engine loop.
        self._worker = SmallestFirstWorker("grammar-compile")
        self._compiling: dict[
            str, tuple[Request, Sequence[MediaInput], concurrent.futures.Future[GrammarMatcher]]
        ] = {}

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def has(self, request_id: str) -> bool:
        return request_id in self._compiling

    def submit(self, request: Request, media: Sequence[MediaInput]) -> bool:
        """Gives `request` its matcher now if its grammar is cached (or it has none) and
        returns False; else starts compiling it and returns True (it waits here)."""
        spec = request.sampling.structured_output
        if spec is None:
            return False
        compiler = self._compiler()
        matcher = compiler.cached(spec)
        if matcher is not None:
            request.grammar = matcher
            return False
        size = sum(len(text) for text in (spec.json, spec.regex, spec.grammar) if text is not None)
        size += sum(len(choice) for choice in spec.choice or ())
        future = self._worker.submit(size, compiler.matcher, spec)
        self._compiling[request.request_id] = (request, media, future)
        return True

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            entry = self._compiling.pop(request_id, None)
            if entry is not None:
                entry[2].cancel()  # a compile not yet started is not run
                outputs.append(entry[0].unscheduled_output(FinishReason.ABORT))
        return outputs

    def admit_finished(
        self, wait_s: float = 0.0
    ) -> tuple[list[tuple[Request, Sequence[MediaInput]]], list[RequestOutput]]:
        """Requests whose grammar compiled (matcher set), and the outputs of those whose
        grammar could not be. `wait_s`: how long to wait for a first compile to finish
        when none has (the caller has nothing else to do)."""
        if not self._compiling:
            return [], []
        if wait_s > 0:
            futures = [future for _, _, future in self._compiling.values()]
            concurrent.futures.wait(
                futures, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED
            )
        compiled, failed = [], []
        for request_id, (request, media, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                request.grammar = future.result()
            except Exception as exc:  # noqa: BLE001 - an unusable grammar fails its request
                if not isinstance(exc, TesseraError):
                    logger.error("could not compile the grammar of %s", request_id, exc_info=exc)
                failed.append(request.unscheduled_output(FinishReason.ERROR, error_info(exc)))
            else:
                compiled.append((request, media))
        return compiled, failed

    def close(self) -> None:
        self._worker.close()
