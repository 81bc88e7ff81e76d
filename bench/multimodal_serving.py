"""Benchmark (not a test): the encoder + prefix caches and chunked multimodal prefill,
through the real server on the `small` generated checkpoint.

    PYTHONPATH=. OMP_NUM_THREADS=2 python bench/multimodal_serving.py

1. Shared vs distinct images: --num-requests (32) chat requests, each a 448x448 image
   followed by its own question, all sent at once; once all 32 share one image, once
   all 32 have distinct images of the same size. Target: median TTFT ratio
   shared / distinct <= 0.5 (the shared image is encoded once and its KV blocks are
   reused by the prefix cache).
2. Decode interference: 16 streaming requests decode while --num-long long multimodal
   prompts (--long-images 448x448 images each) arrive. Inter-token gaps of the 16
   decoding requests while the long prompts are in flight, p99, with chunked prefill
   (--max-num-batched-tokens --chunk) vs chunking off (a budget above the longest
   prompt and --no-split-media). Target: chunked p99 <= 1/3 of unchunked.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.client import stream_times
from bench.datasets import data_url
from bench.local_inputs import picture, png_bytes
from bench.servers import TINY_SERVER_FLAGS, tiny_server
from engine.tiny_model import make_tiny_model


def image_part(salt: int, size: int = 448) -> dict:
    url = data_url(png_bytes(picture(size, size, salt)), "image/png")
    return {"type": "image_url", "image_url": {"url": url}}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def median_ttft(http: httpx.Client, contents: list[list[dict]]) -> float:
    with ThreadPoolExecutor(len(contents)) as pool:
        runs = list(pool.map(lambda content: stream_times(http, content, 1), contents))
    return statistics.median(times[1] - times[0] for times in runs)


def bench_ttft(model_dir: Path, work: Path, num_requests: int) -> tuple[float, float]:
    questions = [f"Question {i}: what do you see in the picture?" for i in range(num_requests)]
    with (
        tiny_server(model_dir, work / "ttft.log", *TINY_SERVER_FLAGS, engine_threads=1) as (url, _),
        httpx.Client(base_url=url, timeout=1800) as http,
    ):
        stream_times(http, [image_part(10_000), {"type": "text", "text": "warm-up"}], 1)
        shared = median_ttft(
            http, [[image_part(1), {"type": "text", "text": q}] for q in questions]
        )
        distinct = median_ttft(
            http,
            [[image_part(100 + i), {"type": "text", "text": q}] for i, q in enumerate(questions)],
        )
    return shared, distinct


def bench_itl(
    model_dir: Path, log: Path, flags: tuple[str, ...], num_long: int, num_images: int
) -> float:
    """p99 inter-token gap of 16 decoding requests while long multimodal prompts arrive."""
    decoder_text = [{"type": "text", "text": "tell me a long story"}]
    with (
        tiny_server(model_dir, log, *TINY_SERVER_FLAGS, *flags, engine_threads=1) as (url, _),
        httpx.Client(base_url=url, timeout=1800) as http,
    ):
        stream_times(http, decoder_text, 2)  # warm-up
        window: list[float] = []  # [start, end] of the long prefills
        started = threading.Event()

        def long_prompts() -> None:
            started.wait()
            window.append(time.perf_counter())
            for index in range(num_long):
                parts = [image_part(1000 + 10 * index + i) for i in range(num_images)]
                stream_times(http, [*parts, {"type": "text", "text": "Describe all."}], 1)
            window.append(time.perf_counter())

        def decoder(_: int) -> list[float]:
            return stream_times(http, decoder_text, 64)

        background = threading.Thread(target=long_prompts)
        background.start()
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(decoder, i) for i in range(16)]
            time.sleep(2.0)  # let the 16 finish their prefill and start decoding
            started.set()
            runs = [future.result() for future in futures]
        background.join()
    lo, hi = window
    gaps = [
        b - a
        for times in runs
        for a, b in zip(times[1:], times[2:], strict=False)
        if lo <= b and a <= hi
    ]
    if not gaps:
        raise RuntimeError("no decoding gap overlapped the long prefills; raise max_tokens")
    return percentile(gaps, 0.99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-long", type=int, default=2)
    parser.add_argument("--long-images", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-itl", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tessera-mm-bench-"))
    model_dir = make_tiny_model(work / "model", size=args.size)
    print(f"checkpoint: {args.size} at {model_dir}; logs in {work}", flush=True)
    if not args.skip_ttft:
        shared, distinct = bench_ttft(model_dir, work, args.num_requests)
        print(f"TTFT median, {args.num_requests} requests with a 448x448 image:")
        print(
            f"  shared image: {shared:.2f} s   distinct images: {distinct:.2f} s   "
            f"ratio {shared / distinct:.2f} (target <= 0.5)",
            flush=True,
        )
    if not args.skip_itl:
        chunked = bench_itl(
            model_dir,
            work / "itl_chunked.log",
            ("--max-num-batched-tokens", str(args.chunk)),
            args.num_long,
            args.long_images,
        )
        unchunked = bench_itl(
            model_dir,
            work / "itl_unchunked.log",
            ("--max-num-batched-tokens", "2048", "--no-split-media"),
            args.num_long,
            args.long_images,
        )
        print(
            f"p99 ITL of 16 decoders during {args.num_long} prompts of "
            f"{args.long_images} 448x448 images:"
        )
        print(
            f"  chunked ({args.chunk} tokens): {chunked * 1000:.0f} ms   "
            f"unchunked: {unchunked * 1000:.0f} ms   ratio {chunked / unchunked:.2f} "
            "(target <= 0.33)"
        )


if __name__ == "__main__":
    main()
