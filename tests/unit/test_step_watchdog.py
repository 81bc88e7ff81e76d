"""The engine's StepWatchdog warns once of a pass that runs long, well before its timeout
ends the engine: a stopped tensor-parallel worker held every request for 30 s with
nothing in the log (fuzz47)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from engine.process import StepWatchdog


def test_a_long_pass_is_warned_of_once_before_the_timeout(caplog):
    loop = SimpleNamespace(last_pass=time.monotonic())
    with caplog.at_level(logging.WARNING, logger="engine.process"):
        StepWatchdog(loop, timeout_s=3600, warn_after_s=0.2).start()
        time.sleep(0.1)
        assert not caplog.records  # a pass that is not long yet
        time.sleep(0.8)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "engine step has run" in warnings[0]
        loop.last_pass = time.monotonic()  # the next pass: warned of in its turn
        time.sleep(0.8)
    assert len(caplog.records) == 2
