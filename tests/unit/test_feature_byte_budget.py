"""The bytes of feature downloads held at once (--feature-fetch-max-bytes-in-flight).

Each file had a cap, and nothing bounded them together: 64 connections per storage kind
could hold 64 x 256 MiB, twice over while each was checked (fuzz61)."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.local_inputs import features
from engine.byte_budget import ByteBudget
from engine.feature_jobs import FeatureJob
from tests.unit.test_feature_fetcher_http import SPEC, hold_budget, private_fetcher, serving
from tests.unit.test_feature_fetcher_pool import _fetch_all


def test_reservations_wait_their_turn_in_order():
    async def scenario():
        budget = ByteBudget(10)
        assert await budget.acquire(6) == 6
        big = asyncio.create_task(budget.acquire(8))
        small = asyncio.create_task(budget.acquire(1))  # fits now, but queues behind
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done() and budget.used == 6
        budget.release(6)
        assert await big == 8 and await small == 1 and budget.used == 9
        budget.release(9)
        assert await budget.acquire(100) == 10  # more than the capacity: all of it

    asyncio.run(scenario())


def test_a_reservation_cancelled_while_waiting_holds_nothing():
    async def scenario():
        budget = ByteBudget(10)
        await budget.acquire(10)
        first = asyncio.create_task(budget.acquire(5))
        second = asyncio.create_task(budget.acquire(5))
        await asyncio.sleep(0.01)
        first.cancel()
        budget.release(10)  # before the cancelled task has run its handler
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second == 5 and budget.used == 5

    asyncio.run(scenario())


def _peak_budget(client) -> list[int]:
    """Records the budget's use after every reservation, on the fetcher's loop."""
    peaks: list[int] = []
    budget, acquire = client._budget, client._budget.acquire

    async def recording(num_bytes: int) -> int:
        reserved = await acquire(num_bytes)
        peaks.append(budget.used)
        return reserved

    budget.acquire = recording
    return peaks


def test_downloads_hold_at_most_the_budget_together(origin):
    """Three concurrent downloads, room for one: each reads its body alone."""
    size = len(features(0))
    for name in "abc":
        origin.answers[f"/{name}"] = [(200, {}, features(ord(name)))]
        origin.delay_s[f"/{name}"] = 0.2
    with private_fetcher(max_bytes_in_flight=size) as client:
        peaks = _peak_budget(client)
        urls = {name: [f"{origin.base}/{name}"] for name in "abc"}
        results = _fetch_all(client, urls)
        assert all(result.error is None for result in results.values())
        assert peaks == [size] * 3
        assert client._budget.used == 0  # every download gave its bytes back


def test_a_failed_download_gives_its_bytes_back(origin):
    origin.answers["/cut"] = [(200, {}, b"\x00" * 64)]  # not a safetensors file
    origin.answers["/ok"] = [(200, {}, features(1))]
    with private_fetcher(max_bytes_in_flight=len(features(1))) as client:
        results = _fetch_all(client, {"cut": [f"{origin.base}/cut"]})
        assert results["cut"].error is not None and client._budget.used == 0
        assert _fetch_all(client, {"ok": [f"{origin.base}/ok"]})["ok"].error is None


def test_the_wait_for_room_pauses_the_download_deadline(origin):
    """The store answers in 0.5 s, and room comes free 0.7 s later: 1.2 s in all against a
    1 s deadline, of which the store took half. Others' bytes are not its slowness."""
    origin.answers["/f"] = [(200, {}, features(1))]
    origin.delay_s["/f"] = 0.5
    with private_fetcher(timeout_s=1.0, max_retries=0,
                         max_bytes_in_flight=len(features(1))) as client:  # fmt: skip
        hold_budget(client, len(features(1)), 1.2)
        started = time.monotonic()
        result = _fetch_all(client, {"r": [f"{origin.base}/f"]})["r"]
        assert result.error is None, result.error
        assert time.monotonic() - started > 1.1


def test_no_room_in_time_is_a_503_that_names_the_setting(origin):
    origin.answers["/f"] = [(200, {}, features(1))]
    with private_fetcher(timeout_s=0.3, max_bytes_in_flight=len(features(1))) as client:
        hold_budget(client, 1)
        error = _fetch_all(client, {"r": [f"{origin.base}/f"]})["r"].error
        assert error is not None and (error.status, error.reason) == (503, "saturated")
        assert "--feature-fetch-max-bytes-in-flight" in error.message
        assert client.pop_stats().failures == {"saturated": 1}


def test_the_bytes_held_are_a_gauge_until_the_file_is_checked(origin, monkeypatch):
    """tessera:feature_fetch_bytes_reserved: what an operator sizes the budget by."""
    import threading

    from engine import feature_fetcher

    checking, release = threading.Event(), threading.Event()
    validate = feature_fetcher.validate_features

    def slow_validate(data, spec):
        checking.set()
        release.wait(5)
        return validate(data, spec)

    monkeypatch.setattr(feature_fetcher, "validate_features", slow_validate)
    origin.answers["/f"] = [(200, {}, features(1))]
    with private_fetcher() as client:
        client.submit("r", [FeatureJob(f"{origin.base}/f", SPEC)])
        assert checking.wait(5)
        assert client.pop_stats().num_bytes_reserved == len(features(1))
        assert client.pop_stats().num_bytes_reserved == len(features(1))  # a gauge: kept
        release.set()
        deadline = time.monotonic() + 5
        while not client.poll() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.pop_stats().num_bytes_reserved == 0


def test_the_wait_for_room_pauses_the_deadline_of_a_body_still_arriving(origin):
    """aiohttp's own total timeout ran on while the download waited for room: a body
    arriving over 1.4 s, of which 0.8 s were a wait for room, failed at 1 s, though the
    store had taken 0.6 s of the 1 s deadline (fuzz73)."""
    body = features(1)
    origin.answers["/f"] = [(200, {"X-Test-Trickle": f"{len(body) // 7 + 1},0.2"}, body)]
    with private_fetcher(timeout_s=1.0, max_retries=0, max_bytes_in_flight=len(body)) as client:
        hold_budget(client, len(body), 0.8)
        result = _fetch_all(client, {"r": [f"{origin.base}/f"]})["r"]
        assert result.error is None, result.error


def test_a_retry_keeps_the_room_its_first_try_reserved(origin):
    """Each retry waited for room again: with others' downloads queued, one URL failed
    after several times its deadline (fuzz73)."""
    body = features(1)
    origin.answers["/f"] = [(200, {"X-Test-Cut": "100"}, body), (200, {}, body)]
    with private_fetcher(max_bytes_in_flight=len(body)) as client:
        peaks = _peak_budget(client)
        result = _fetch_all(client, {"r": [f"{origin.base}/f"]})["r"]
        assert result.error is None, result.error
        assert [method for method, _, _ in origin.log] == ["GET", "GET"]
        assert peaks == [len(body)]  # one reservation for both tries
        assert client._budget.used == 0


def test_a_body_is_asked_for_as_stored_so_its_length_is_what_it_reserves(origin):
    """aiohttp asked for gzip and unpacked it: a body reserved its compressed length (8
    downloads held 14.3 MB under an 800 KB budget; fuzz73). The fetcher asks for the
    body as stored, and a store that compresses anyway reserves the file cap."""
    import gzip

    body = features(1)
    origin.answers["/plain"] = [(200, {}, body)]
    origin.answers["/gz"] = [(200, {"Content-Encoding": "gzip"}, gzip.compress(body))]
    with private_fetcher(max_bytes=4 * len(body), max_bytes_in_flight=8 * len(body)) as client:
        peaks = _peak_budget(client)
        results = _fetch_all(client, {"plain": [f"{origin.base}/plain"]})
        results |= _fetch_all(client, {"gz": [f"{origin.base}/gz"]})
        assert all(result.error is None for result in results.values())
        assert peaks == [len(body), 4 * len(body)]
    with serving() as echo:
        seen = []
        echo.answers["/h"] = [(200, {}, body)]
        original = echo.httpd.RequestHandlerClass.do_GET

        def recording(handler):
            seen.append(handler.headers.get("Accept-Encoding"))
            original(handler)

        echo.httpd.RequestHandlerClass.do_GET = recording
        with private_fetcher() as client:
            assert _fetch_all(client, {"r": [f"{echo.base}/h"]})["r"].error is None
        assert seen == ["identity"]
