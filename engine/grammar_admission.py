"""The COMPILING state: requests wait here while their structured output's grammar compiles.

Compiling a grammar takes about 1 ms for a small JSON schema, 20-50 ms for a large one
and, for a hostile regex, as long as `--grammar-lexer-fuel` lets it; on the engine loop
that time would be added to every running request's next token. So `EngineCore` hands a
request whose grammar is not in the compiled-grammar cache to one worker thread
(llguidance releases the GIL while it compiles), and `admit_finished()`, called at the
top of every step, passes compiled requests on. A spec compiled before (the same schema
or tool set again) is copied on the loop in microseconds and never waits here.

    add_request ──(no grammar, or cached)──────────────▶ FETCHING or scheduler.waiting
         └──▶ COMPILING ──(compiled)──────────────────▶ FETCHING or scheduler.waiting
                 ├──(unusable grammar)──▶ finished with a 400 ErrorInfo
                 └──(abort)──▶ finished ABORT (the compile runs on and is cached)
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.errors import TesseraError
from engine.model_runner import error_info
from engine.protocol import FinishReason, MediaInput, RequestOutput
from engine.request import Request

if TYPE_CHECKING:
    from engine.structured_output import GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)


class GrammarAdmission:
    """Requests in COMPILING, keyed by request id; owns the (lazily started) worker."""

    def __init__(self, compiler: Callable[[], GrammarCompiler]) -> None:
        self._compiler = compiler  # made on first use: llguidance is imported lazily
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
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
        if self._executor is None:
            # One worker: compiles queue rather than take cores from the engine loop.
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "grammar-compile")
        future = self._executor.submit(compiler.matcher, spec)
        self._compiling[request.request_id] = (request, media, future)
        return True

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            entry = self._compiling.pop(request_id, None)
            if entry is not None:
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
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
