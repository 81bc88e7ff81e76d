"""The built-in default model: a tiny random-weight Qwen2-VL checkpoint, generated once.

`tessera serve` without `--model` serves it, so a first run needs no download. It lives in
`$TESSERA_CACHE_DIR/default-model-2` (default `~/.cache/tessera/default-model-2`). Generation
is atomic: written into a temp dir next to it, then renamed, so a crash or a concurrent
start never leaves a half-written folder behind. Its weights are random: the text it
produces is gibberish, by design.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "TESSERA_CACHE_DIR"
# Its number goes up whenever make_tiny_model's output changes, so an upgraded server
# generates the new one instead of serving a stale copy (2: the chat template renders tools).
DEFAULT_MODEL_FOLDER = "default-model-2"
DEFAULT_MODEL_SEED = 0
DEFAULT_MODEL_SIZE = "tiny"
STAGING_PREFIX = ".default-model-"
STALE_STAGING_S = 600.0  # generating takes seconds; a staging folder this old was abandoned

logger = logging.getLogger("tessera.default_model")


def default_model_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the default model lives (whether or not it exists yet)."""
    environ = os.environ if environ is None else environ
    cache_dir = environ.get(CACHE_ENV) or str(Path("~/.cache/tessera").expanduser())
    return Path(cache_dir) / DEFAULT_MODEL_FOLDER


def is_default_model(model: str, environ: Mapping[str, str] | None = None) -> bool:
    return Path(model).expanduser().absolute() == default_model_dir(environ).absolute()


class DefaultModelError(OSError):
    """The cache folder cannot hold the built-in model (not a folder, not writable)."""


def ensure_default_model(path: Path | None = None) -> Path:
    """Return the default model's folder, generating it first if it is not there. Raises
    DefaultModelError naming the cache folder when it cannot be written."""
    path = Path(path) if path is not None else default_model_dir()
    if (path / "config.json").is_file():
        return path
    try:
        return _generate(path)
    except OSError as exc:
        raise DefaultModelError(
            f"cannot write the built-in model into {path.parent} ({exc.strerror or exc}); "
            f"set {CACHE_ENV} to a writable folder, or pass --model DIR"
        ) from None


def _generate(path: Path) -> Path:
    from engine.tiny_model import make_tiny_model

    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(path.parent)
    logger.info("generating the built-in tiny model (random weights) in %s", path)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=path.parent))
    try:
        make_tiny_model(staging, seed=DEFAULT_MODEL_SEED, size=DEFAULT_MODEL_SIZE)
        staging.chmod(0o755)  # mkdtemp made it 0700; the model is not a secret
        if path.is_dir() and not (path / "config.json").is_file():
            # Not ours (we only ever rename a whole one in): a partial copy, say. Moved
            # aside first: a concurrent start may be doing the same, and its copy is equal.
            logger.warning("replacing the incomplete built-in model folder %s", path)
            aside = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=path.parent))
            with contextlib.suppress(OSError):
                os.rename(path, aside / "old")
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(staging, path)
        except OSError:
            if not (path / "config.json").is_file():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _remove_stale_staging(folder: Path) -> None:
    """Staging folders a killed generation left (older than any generation takes)."""
    cutoff = time.time() - STALE_STAGING_S
    for staging in folder.glob(STAGING_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if staging.is_dir() and staging.stat().st_mtime < cutoff:
                shutil.rmtree(staging, ignore_errors=True)
