"""Typed errors raised at the edges of the engine and the server.

Every error a client can cause is an `InvalidRequest` (or a subclass). The server
maps them to OpenAI error bodies in one place (`server/errors.py`); the engine
turns one raised while handling a request into that request's `ErrorInfo`, and
goes on serving the others. Messages must name the problem and the parameter,
never internals (paths, addresses, stack traces).
"""

from __future__ import annotations

from engine.protocol import ErrorInfo


class TesseraError(Exception):
    """Base class. `status`, `type` and `code` map onto the OpenAI error body."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(TesseraError):
    """The client sent something we cannot serve (HTTP 400)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class MediaError(InvalidRequest):
    """A media item could not be fetched, decoded or matched to its placeholders."""

    code = "invalid_media"


def too_long_for_kv_cache(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    capacity: int,
    *,
    param: str = "max_tokens",
) -> ContextLengthExceeded | None:
    """The refusal of a request that could not run even alone, None if it can: its prompt
    and `max_tokens` (`param` names the field), at most the context, need more KV slots
    than the cache's `capacity`. The engine's check (Scheduler.add_request), and the
    server's before a stream opens (server/sampling_params.py)."""
    needed = min(num_prompt_tokens + max_tokens, max_model_len)
    if needed <= capacity:
        return None
    return ContextLengthExceeded(
        f"prompt ({num_prompt_tokens} tokens) + {param} ({max_tokens}) needs {needed} KV "
        f"slots but the KV cache holds {capacity}",
        param=param,
    )


def unknown_media_uuid(uuid: str, why: str, *, param: str | None = None) -> MediaError:
    """The error of a uuid-only part whose encoding the engine does not hold: the client's
    `uuid`, then `why`."""
    return MediaError(f"unknown media uuid {uuid!r}: {why}", param=param, code="unknown_media_uuid")


class ModelNotFound(TesseraError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ModelLoadError(TesseraError):
    """A checkpoint cannot be loaded: unsupported architecture, missing or mis-shaped tensor."""

    code = "model_load_error"


class EngineBroken(Exception):
    """The engine cannot run another step: a tensor-parallel rank died or its group failed.
    Not one step's failure: the engine loop stops on it, so the server fails and its
    supervisor restarts both, instead of failing every later request one at a time."""


class EngineDeadError(TesseraError):
    status = 503
    type = "server_error"
    code = "engine_dead"


class ServerOverloaded(TesseraError):
    status = 503
    type = "server_error"
    code = "server_overloaded"
    # The `reason` label of tessera:requests_rejected_total: which budget refused it.
    reason = "server_overloaded"


def error_from_info(info: ErrorInfo, param: str | None = None) -> TesseraError:
    """`error_info`'s inverse: the typed error an ErrorInfo describes, of its status and
    type (`param`: another name for the field, where the caller maps one)."""
    exc = TesseraError(info.message, param=param or info.param, code=info.code)
    exc.status, exc.type = info.status, info.type
    return exc


def error_info(exc: Exception) -> ErrorInfo:
    """The ErrorInfo an engine-side failure reaches its requests as: a typed error's own
    message, status and param; anything else a generic 500 that leaks no internals."""
    if isinstance(exc, TesseraError):
        return ErrorInfo(
            exc.message, type=exc.type, code=exc.code, param=exc.param, status=exc.status
        )
    return ErrorInfo("internal error while running the model", type="internal_error", status=500)
