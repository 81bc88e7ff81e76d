"""Logging set-up shared by the server and the engine process: plain text or JSON lines,
and the names processes go by in log lines and in `ps` / `top`."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import multiprocessing
import sys
import time

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


_PR_SET_NAME = 15  # prctl(2): the calling thread's name, /proc/PID/comm for the main thread


def name_this_process(name: str) -> None:
    """Name this process in log lines and, on Linux, for `ps -o comm` and `top`
    (`tessera-engine`, `tessera-api-0`, ... instead of `python3`; at most 15 bytes)."""
    multiprocessing.current_process().name = name
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)  # failure is harmless


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, process, message (+ exc_info)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": record.processName,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)  # logger.info(..., extra={"fields": {...}})
        if isinstance(fields, dict):
            entry.update({k: v for k, v in fields.items() if k not in entry})
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str = "info", log_format: str = "text") -> None:
    """Route every logger (uvicorn's included) to stderr in one format."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # server/request_log.py writes the one line per request; uvicorn's would be a second.
    logging.getLogger("uvicorn.access").disabled = True


def current_logging() -> tuple[str, str]:
    """(level, format) this process logs with, for a child process to log alike."""
    root = logging.getLogger()
    level = logging.getLevelName(root.level).lower()
    is_json = any(isinstance(handler.formatter, JsonFormatter) for handler in root.handlers)
    return (level if level in LOG_LEVELS else "info"), ("json" if is_json else "text")
