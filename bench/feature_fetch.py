"""Benchmark (not a test): parallel feature fetching and its effect on decoding.

    PYTHONPATH=. python bench/feature_fetch.py

1. TTFT of one request with 8 feature objects, each served with 200 ms added latency,
   with --feature-fetch-parallel 8 vs 1 (target ratio <= 0.25).
2. Inter-token latency of 8 decoding requests while such fetches are in flight vs
   without them (target: within 10%), in alternating rounds (--rounds).
3. CPU time of the engine's fetcher thread per downloaded object (FeatureFetcher in this
   process, no added latency): the share of the busy loop's GIL and cores a download
   takes.
Uses the tiny built-in checkpoint and a local HTTP object server (bench/local_inputs.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.client import stream_times
from bench.local_inputs import FEATURE_GRID, TINY_HIDDEN, ObjectServer, feature_part, features
from bench.servers import TINY_SERVER_FLAGS, cpu_seconds, tiny_server
from engine.feature_fetcher import FeatureFetcher
from engine.feature_jobs import FeatureJob, FetchConfig
from engine.feature_validation import FeatureSpec
from engine.tiny_model import make_tiny_model

NUM_OBJECTS = 8
LATENCY_S = 0.2


def feature_request(store: ObjectServer, tag: str) -> list[dict]:
    parts = [
        feature_part(store.put(f"{tag}/{i}", features(i), delay=LATENCY_S))
        for i in range(NUM_OBJECTS)
    ]
    return [*parts, {"type": "text", "text": "hi"}]


def ttft(model_dir: Path, store: ObjectServer, parallel: int, log: Path) -> float:
    flags = (
        "--enable-feature-inputs",
        "--allow-private-feature-urls",  # the object server listens on 127.0.0.1
        "--feature-fetch-parallel",
        str(parallel),
    )
    with (
        tiny_server(model_dir, log, *TINY_SERVER_FLAGS, *flags, engine_threads=1) as (url, _),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        stream_times(http, feature_request(store, f"warm{parallel}"), 1)
        samples = []
        for rep in range(3):
            times = stream_times(http, feature_request(store, f"p{parallel}r{rep}"), 1)
            samples.append(times[1] - times[0])
        return statistics.median(samples)


def itl(model_dir: Path, store: ObjectServer, log: Path, rounds: int) -> tuple[float, float, int]:
    """(mean decode gap without fetches, with fetches in flight, fetch requests completed
    meanwhile), over `rounds` alternating quiet / busy rounds; a failed background fetch
    fails the benchmark."""
    text = [{"type": "text", "text": "tell me a long story"}]
    flags = (*TINY_SERVER_FLAGS, "--enable-feature-inputs", "--allow-private-feature-urls")
    with (
        tiny_server(model_dir, log, *flags, engine_threads=1) as (url, _),
        httpx.Client(base_url=url, timeout=120) as http,
    ):

        def decode_gaps() -> list[float]:
            with ThreadPoolExecutor(8) as pool:
                runs = list(pool.map(lambda _: stream_times(http, text, 96), range(8)))
            return [b - a for times in runs for a, b in zip(times[1:], times[2:], strict=False)]

        def fetch_loop(stop: threading.Event, completed: list[int]) -> None:
            while not stop.is_set():
                stream_times(http, feature_request(store, f"bg{len(completed)}"), 1)
                completed.append(1)

        decode_gaps()  # warm-up
        quiet: list[float] = []
        busy: list[float] = []
        completed: list[int] = []
        for _ in range(rounds):
            quiet += decode_gaps()
            stop = threading.Event()
            with ThreadPoolExecutor(1) as background:
                fetching = background.submit(fetch_loop, stop, completed)
                try:
                    busy += decode_gaps()
                finally:
                    stop.set()
                fetching.result()  # raises what failed in the background
        return statistics.mean(quiet), statistics.mean(busy), len(completed)


def fetcher_cpu_per_download(store: ObjectServer, num_requests: int = 50) -> float:
    """Seconds of the fetcher thread's CPU per downloaded object, objects fetched 8 at a
    time as one request's features are."""
    spec = FeatureSpec(TINY_HIDDEN, 4, FEATURE_GRID)
    urls = [store.put(f"cpu/{i}", features(i)) for i in range(NUM_OBJECTS)]
    fetcher = FeatureFetcher(FetchConfig(allow_private_urls=True))

    def fetch_all(request_id: str) -> None:
        fetcher.submit(request_id, [FeatureJob(url, spec) for url in urls], force=True)
        while not (results := fetcher.poll()):
            time.sleep(0.0005)
        if results[0].error is not None:
            raise results[0].error

    try:
        fetch_all("warm-up")
        started = cpu_seconds(os.getpid(), fetcher.native_thread_id)
        for i in range(num_requests):
            fetch_all(f"r{i}")
        spent = cpu_seconds(os.getpid(), fetcher.native_thread_id) - started
        return spent / (num_requests * NUM_OBJECTS)
    finally:
        fetcher.close()


def report(model_dir: Path, store: ObjectServer, work: Path, rounds: int) -> None:
    parallel = ttft(model_dir, store, 8, work / "p8.log")
    serial = ttft(model_dir, store, 1, work / "p1.log")
    print(f"TTFT, {NUM_OBJECTS} objects x {LATENCY_S * 1000:.0f} ms latency:")
    print(
        f"  parallel 8: {parallel * 1000:.0f} ms   parallel 1: {serial * 1000:.0f} ms   "
        f"ratio {parallel / serial:.2f} (target <= 0.25)"
    )
    quiet, busy, num_fetches = itl(model_dir, store, work / "itl.log", rounds)
    print(f"ITL of 8 decoding requests ({rounds} rounds each):")
    print(
        f"  without fetches: {quiet * 1000:.1f} ms   with fetches in flight: "
        f"{busy * 1000:.1f} ms   change {100 * (busy / quiet - 1):+.1f}% (target within 10%)"
    )
    print(f"  ({num_fetches} requests of {NUM_OBJECTS} fetched objects completed meanwhile)")
    cpu = fetcher_cpu_per_download(store)
    print(f"Fetcher thread CPU per downloaded object: {cpu * 1000:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="quiet/busy ITL rounds")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    model_dir = make_tiny_model(work / "model")
    with ObjectServer() as store:
        report(model_dir, store, work, args.rounds)


if __name__ == "__main__":
    main()
