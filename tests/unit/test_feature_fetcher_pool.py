"""The fetcher's own limits on concurrent downloads (fuzz61 #4, #6): a wait for one of its
connections does not use up a URL's deadline nor counts as in flight; concurrent jobs of
one URL share one download; every failed job's error is read."""

from __future__ import annotations

import gc
import logging
import threading
import time

from bench.local_inputs import features
from engine.feature_fetcher import FeatureFetcher
from engine.feature_jobs import FeatureJob, FetchResult
from tests.unit.test_feature_fetcher_http import SPEC, fetch, private_fetcher


def _fetch_all(client: FeatureFetcher, requests: dict[str, list[str]], watch=None):
    """Submits every request at once; their results by request id. `watch()` is called
    while they run."""
    for request_id, urls in requests.items():
        client.submit(request_id, [FeatureJob(url, SPEC) for url in urls])
    results: dict[str, FetchResult] = {}
    deadline = time.monotonic() + 20
    while len(results) < len(requests) and time.monotonic() < deadline:
        results.update((result.request_id, result) for result in client.poll())
        if watch is not None:
            watch()
        time.sleep(0.005)
    assert len(results) == len(requests), "the fetches did not finish"
    return results


def test_waiting_for_a_connection_does_not_use_up_the_deadline(origin):
    """Every object takes 0.5 s against a 1.2 s deadline, with one connection: the third
    waited for it inside its deadline and timed out (504, reason timeout)."""
    for name in "abc":
        origin.answers[f"/{name}"] = [(200, {}, features(ord(name)))]
        origin.delay_s[f"/{name}"] = 0.5
    seen = []
    with private_fetcher(max_connections=1, timeout_s=1.2, max_retries=0) as client:
        urls = [f"{origin.base}/{name}" for name in "abc"]
        result = _fetch_all(
            client, {"r": urls}, watch=lambda: seen.append(client._stats.num_in_flight)
        )["r"]
        assert result.error is None, result.error
        assert max(seen) == 1  # jobs waiting for a connection are not in flight
        assert client.pop_stats().num_in_flight == 0


def test_concurrent_jobs_of_one_url_share_one_download(origin, fetcher):
    """Eight requests for one 100 MB object held eight copies of it (fuzz61 #4)."""
    origin.answers["/big"] = [(200, {"ETag": '"v1"'}, features(1))]
    origin.delay_s["/big"] = 0.3
    url = f"{origin.base}/big"
    results = _fetch_all(fetcher, {"a": [url, url], "b": [url], "c": [url]})
    hashes = {feature.content_hash for r in results.values() for feature in r.features}
    assert all(r.error is None for r in results.values()) and len(hashes) == 1
    assert [method for method, _, _ in origin.log] == ["GET"]
    assert fetcher.pop_stats().num_bytes == len(features(1))


def test_a_shared_download_outlives_the_request_that_started_it(origin, fetcher):
    origin.answers["/slow"] = [(200, {}, features(2))]
    origin.delay_s["/slow"] = 0.3
    url = f"{origin.base}/slow"
    fetcher.submit("first", [FeatureJob(url, SPEC)])
    fetcher.submit("second", [FeatureJob(url, SPEC)])
    time.sleep(0.1)
    fetcher.cancel("first")
    deadline = time.monotonic() + 10
    results = []
    while not results and time.monotonic() < deadline:
        results = fetcher.poll()
        time.sleep(0.005)
    assert [r.request_id for r in results] == ["second"] and results[0].error is None
    assert [method for method, _, _ in origin.log] == ["GET"]


def test_every_failed_jobs_error_is_read(fetcher, caplog):
    """Jobs of one request that failed in the same loop turn: only the first error was
    read, and asyncio logged "Task exception was never retrieved" for the others."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    bad = [f"data:application/octet-stream;base64,{'!' * n}" for n in (1, 2, 3)]
    result = fetch(fetcher, bad)
    assert result.error is not None and result.error.reason == "bad_format"
    done = threading.Event()
    fetcher._loop.call_soon_threadsafe(lambda: (gc.collect(), done.set()))
    assert done.wait(5)
    time.sleep(0.1)
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_request_that_joins_a_download_its_last_waiter_just_left_still_gets_its_result(
    origin,
):
    """A client on a slow store left (its request cancelled, the shared download with it)
    and retried at once: the retry joined the cancelled download, whose cancellation then
    escaped its request's fetch, and the retry never got a result (fuzz66)."""
    origin.answers["/slow"] = [(200, {}, features(5))]
    origin.delay_s["/slow"] = 0.4
    with private_fetcher() as client:
        job = FeatureJob(f"{origin.base}/slow", SPEC)
        client.submit("first", [job])
        time.sleep(0.1)  # its download is in flight
        client.cancel("first")
        client.submit("retry", [job])
        results: list[FetchResult] = []
        deadline = time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            results = client.poll()
            time.sleep(0.01)
    assert [result.request_id for result in results] == ["retry"]
    assert results[0].error is None, results[0].error


def test_a_wait_for_a_connection_has_a_deadline_of_its_own(monkeypatch):
    """With every connection held by a hung store, the requests behind them waited for a
    free one with no deadline: the k-th failed after ceil(k / connections) timeouts, 120 s
    with the defaults, where the docs say --feature-fetch-timeout-s (fuzz66). They now
    give up waiting after one timeout, as the server's fault (503)."""
    import asyncio

    async def hung(self, job, force):
        await asyncio.sleep(3600)

    monkeypatch.setattr(FeatureFetcher, "_download_and_check", hung)
    with private_fetcher(max_connections=2, timeout_s=0.3, max_retries=0) as client:
        urls = {f"r{i}": [f"https://hung.example/{i}"] for i in range(6)}
        started = time.monotonic()
        results = _fetch_all(client, urls)
        elapsed = time.monotonic() - started
    # Four waited; two may win the slots freed at the very end of their wait, and time out.
    codes = [result.error.code for result in results.values()]
    assert codes.count("feature_saturated") >= 2, codes
    assert codes.count("feature_saturated") + codes.count("feature_timeout") == 6, codes
    assert {result.error.status for result in results.values()} == {503, 504}
    assert elapsed < 2 * 0.3 + 1.0  # two deadlines at most, with room for a loaded machine


def test_a_request_of_more_parts_than_connections_waits_for_its_own(origin):
    """Its later parts waited for connections its own earlier parts held, and that wait ran
    out: 503 feature_saturated on every try with nothing else running (fuzz68). A request
    now downloads at most as many parts at once as there are connections."""
    for i in range(6):
        origin.answers[f"/part{i}"] = [(200, {}, features(20 + i))]
        origin.delay_s[f"/part{i}"] = 0.4
    with private_fetcher(max_connections=2, parallel=8, timeout_s=0.7, max_retries=0) as client:
        urls = [f"{origin.base}/part{i}" for i in range(6)]
        result = _fetch_all(client, {"r": urls})["r"]
    assert result.error is None, result.error


def test_a_request_submitted_again_is_cancelled_by_its_id(origin):
    """The engine submits a request again (force) while its first fetch is still running:
    when the first ended, its clean-up forgot the second, and a cancel of the request then
    left the second downloading (fuzz68)."""
    origin.answers["/quick"] = [(200, {}, features(30))]
    origin.delay_s["/quick"] = 0.2
    origin.answers["/slow"] = [(200, {}, features(31))]
    origin.delay_s["/slow"] = 2.0
    with private_fetcher() as client:
        client.submit("r", [FeatureJob(f"{origin.base}/quick", SPEC)])
        client.submit("r", [FeatureJob(f"{origin.base}/slow", SPEC)], force=True)
        first: list[FetchResult] = []
        deadline = time.monotonic() + 5
        while not first and time.monotonic() < deadline:
            first = client.poll()
            time.sleep(0.01)
        assert [result.error for result in first] == [None]  # the first one, done
        client.cancel("r")
        time.sleep(2.5)  # past the second one's download
        assert client.poll() == []  # cancelled: no result
        assert client.pop_stats().failures.get("cancelled") == 1
