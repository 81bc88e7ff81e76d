"""Benchmark (not a test): one image's way from the API process into the engine, by part.

    PYTHONPATH=. python bench/image_path.py [--size 448] [--repeat 7] [--burst 128]

Times, on a random RGB image of --size x --size:

  process_image (fresh)   resize + patchify + content hash, in this fresh process
  process_image (warm)    the same after a large block has been freed, as in a running
                          server: glibc then serves the ~1 MB buffers from its heap
                          instead of a fresh, page-faulting mmap each time
  through ZMQ             encode_message + send over ipc + decode_engine_inbox of one
                          image request (what the API process and the engine pay)
  normalise (engine)      normalize_pixels on the host, one thread (on a GPU it runs on
                          the device)
  fetch over HTTP (CPU)   the API process's CPU per `image_url` GET of the image as PNG
                          (MediaFetcher, 8 at a time, from a kept-alive local server)

Each is the best of --repeat rounds; prints milliseconds per image and the bytes sent.

With --burst N, also: N distinct PNG data: URLs (smooth pictures with noise, so that they
compress as photos do) loaded through MediaFetcher all at once, as N image requests
arriving together, on --burst-threads decode threads each: the wall time per image and
the mean time a load took (its wait for a thread included, as the server's
tessera:media_preprocess_seconds counts it).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import zmq
from PIL import Image

from bench.local_inputs import ObjectServer, png_bytes
from engine.multimodal.image_processor import ImageProcessorConfig, normalize_pixels, process_image
from engine.protocol import EngineRequest, MediaInput, Modality, SamplingParams
from engine.serialization import decode_engine_inbox, encode_message, tensor_ref
from server.media_fetch import MediaFetchConfig, MediaFetcher


def best_ms(work: Callable[[], object], repeat: int, number: int = 20) -> float:
    return min(timeit.repeat(work, number=number, repeat=repeat)) / number * 1e3


def fetch_cpu_ms(image: Image.Image, repeat: int, number: int = 8) -> float:
    """CPU milliseconds of the fetching thread per GET, best of `repeat` rounds of
    `number` concurrent GETs (the object server runs in another thread)."""

    async def rounds(urls: list[str]) -> float:
        # Any --size: random pixels do not compress, so lift the byte cap.
        config = MediaFetchConfig(allow_private_urls=True, max_image_bytes=1 << 30)
        fetcher = MediaFetcher(config, ImageProcessorConfig())
        try:
            best = float("inf")
            for _ in range(repeat + 1):  # the first round opens the connections
                started = time.thread_time()
                await asyncio.gather(*(fetcher.fetch_url_bytes(u, param="p") for u in urls))
                best = min(best, time.thread_time() - started)
            return best / number * 1e3
        finally:
            await fetcher.aclose()

    with ObjectServer() as store:
        return asyncio.run(rounds([store.put(f"{i}.png", png_bytes(image)) for i in range(number)]))


def burst_ms(size: int, num_images: int, threads: int) -> tuple[float, float]:
    """(wall ms per image, mean ms per load) of `num_images` distinct data: URLs loaded at
    once on `threads` decode threads (no processed-image cache)."""
    rng = np.random.default_rng(1)
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    smooth = ramp[None, :, None] * 0.5 + ramp[:, None, None] * 0.3  # [size, size, 1]
    urls = []
    for _ in range(num_images):
        pixels = (smooth + rng.integers(0, 40, (size, size, 3))).astype(np.uint8)
        encoded = base64.b64encode(png_bytes(Image.fromarray(pixels))).decode()
        urls.append("data:image/png;base64," + encoded)

    async def burst() -> tuple[float, float]:
        config = MediaFetchConfig(num_image_decode_threads=threads, processed_image_cache_bytes=0)
        fetcher = MediaFetcher(config, ImageProcessorConfig())
        waits = []

        async def load(url: str) -> None:
            started = time.perf_counter()
            await fetcher.load_image(url, param="p")
            waits.append(time.perf_counter() - started)

        try:
            await asyncio.gather(*(load(url) for url in urls[:threads]))  # warm-up
            waits.clear()
            started = time.perf_counter()
            await asyncio.gather(*(load(url) for url in urls))
            wall = time.perf_counter() - started
        finally:
            await fetcher.aclose()
        return wall / num_images * 1e3, sum(waits) / len(waits) * 1e3

    return asyncio.run(burst())


def measure(size: int, repeat: int) -> dict[str, float]:
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    image, config = Image.fromarray(pixels), ImageProcessorConfig()
    results = {"process_image (fresh)": best_ms(lambda: process_image(image, config), repeat)}
    freed = np.ones(8 << 20, dtype=np.uint8)  # an 8 MB mmap, freed: glibc's threshold rises
    del freed
    results["process_image (warm)"] = best_ms(lambda: process_image(image, config), repeat)
    processed = process_image(image, config)
    media = MediaInput(
        modality=Modality.IMAGE, content_hash=processed.content_hash, offset=0,
        num_tokens=processed.num_tokens, grid_thw=processed.grid_thw,
        pixel_values=tensor_ref(0, processed.pixel_levels),
        normalization=processed.normalization,
    )  # fmt: skip
    request = EngineRequest(
        request_id="r", prompt_token_ids=list(range(300)), sampling=SamplingParams(),
        media=[media],
    )  # fmt: skip
    context = zmq.Context()
    with tempfile.TemporaryDirectory() as folder:
        address = f"ipc://{Path(folder) / 'inbox'}"
        sender, receiver = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        sender.bind(address)
        receiver.connect(address)

        def round_trip() -> None:
            sender.send_multipart(encode_message(request, [processed.pixel_levels]), copy=False)
            decode_engine_inbox(receiver.recv_multipart(copy=False))

        results["through ZMQ"] = best_ms(round_trip, repeat)
        sender.close(linger=0)
        receiver.close(linger=0)
    context.term()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        levels, normalization = processed.pixel_levels, processed.normalization
        results["normalise (engine)"] = best_ms(
            lambda: normalize_pixels(levels, normalization), repeat
        )
    finally:
        torch.set_num_threads(threads)
    results["fetch over HTTP (CPU)"] = fetch_cpu_ms(image, repeat)  # last: it frees big blocks
    results["bytes sent"] = float(processed.pixel_levels.nbytes)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--burst", type=int, default=0, help="images loaded at once; 0 = none")
    parser.add_argument("--burst-threads", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    results = measure(args.size, args.repeat)
    print(f"one {args.size}x{args.size} image:")
    num_bytes = int(results.pop("bytes sent"))
    for label, milliseconds in results.items():
        print(f"  {label:24s} {milliseconds:8.2f} ms")
    print(f"  {'bytes sent':24s} {num_bytes:8d}")
    if args.burst:
        print(f"a burst of {args.burst} distinct images, all at once:")
        for threads in args.burst_threads:
            per_image, mean_wait = burst_ms(args.size, args.burst, threads)
            print(f"  {threads} decode threads      {per_image:8.2f} ms an image, "
                  f"{mean_wait:.0f} ms a load")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
