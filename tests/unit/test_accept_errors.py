"""server/accept_errors.py: accept failures are counted into one line per interval."""

from __future__ import annotations

import asyncio
import logging
import re

from server.accept_errors import ACCEPT_FAILURE, AcceptErrorThrottle


def accept_failure() -> dict:
    return {"message": ACCEPT_FAILURE, "exception": OSError(24, "Too many open files")}


def reports(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "server.accept_errors"]


def test_failures_after_a_report_are_reported_when_the_interval_ends(caplog):
    """A shortage that ends within the interval still gets its line: the failures after
    the first report were dropped when no later failure came to log them."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        throttle = AcceptErrorThrottle(interval_s=0.2)
        for _ in range(3):
            throttle(loop, accept_failure())
        assert len(reports(caplog)) == 1  # the first one at once, the next two wait
        await asyncio.sleep(0.4)

    with caplog.at_level(logging.WARNING, logger="server.accept_errors"):
        asyncio.run(main())
    lines = reports(caplog)
    assert len(lines) == 2
    assert "(1 time(s) since the last report)" in lines[0]
    assert "(2 time(s) since the last report)" in lines[1]
    assert "Too many open files" in lines[1]


def test_a_steady_shortage_logs_once_per_interval(caplog):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        throttle = AcceptErrorThrottle(interval_s=0.5)
        for _ in range(10):  # ~0.5 s of failures, one every 0.05 s
            throttle(loop, accept_failure())
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.7)

    with caplog.at_level(logging.WARNING, logger="server.accept_errors"):
        asyncio.run(main())
    lines = reports(caplog)
    counts = [int(re.search(r"\((\d+) time", line).group(1)) for line in lines]
    assert sum(counts) == 10  # every failure counted once, the last ones included
    assert len(lines) < 10  # ~2 (one at once, one at the interval's end), not one each


def test_other_loop_errors_go_to_the_default_handler(caplog):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        AcceptErrorThrottle()(loop, {"message": "something else broke"})

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert any("something else broke" in r.getMessage() for r in caplog.records)
    assert reports(caplog) == []
