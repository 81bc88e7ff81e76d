"""Benchmark (not a test): what one very long prompt costs the other requests of a server.

    PYTHONPATH=. python bench/long_prompts.py --base-url http://127.0.0.1:8000 \\
        [--tokenize-words 2000000] [--completion-words 10000000]

Sends, one at a time, a /tokenize of --tokenize-words words ("a a a ...", one token a
word) and a /v1/completions whose prompt has --completion-words words (far past the
context: its answer is a 400), and half a second into each, GET /health. Prints each
request's status and time and how long /health took meanwhile: while a tokenizer held
the event loop (and the GIL), /health waited for it.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence

import httpx


def timed_post(base_url: str, route: str, body: dict, out: dict) -> None:
    started = time.monotonic()
    response = httpx.post(base_url + route, json=body, timeout=600)
    out["status"], out["seconds"] = response.status_code, time.monotonic() - started


def health_during(base_url: str, route: str, body: dict, delay: float) -> tuple[int, float, float]:
    """(status, seconds) of the request, and the seconds /health took `delay` into it."""
    out: dict = {}
    worker = threading.Thread(target=timed_post, args=(base_url, route, body, out))
    worker.start()
    time.sleep(delay)
    started = time.monotonic()
    httpx.get(base_url + "/health", timeout=600)
    health = time.monotonic() - started
    worker.join()
    return out["status"], out["seconds"], health


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", help="the served name (default: the server's one model)")
    parser.add_argument("--tokenize-words", type=int, default=2_000_000)
    parser.add_argument("--completion-words", type=int, default=10_000_000)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds before /health")
    args = parser.parse_args(argv)
    model = args.model or httpx.get(args.base_url + "/v1/models").json()["data"][0]["id"]
    loads = [
        (f"/tokenize, {args.tokenize_words:,} words", "/tokenize",
         {"prompt": "a " * args.tokenize_words}),
        (f"/v1/completions, {args.completion_words:,} words", "/v1/completions",
         {"model": model, "prompt": "a " * args.completion_words, "max_tokens": 2}),
    ]  # fmt: skip
    print("| request | status | request s | /health s meanwhile |")
    print("|---|---|---|---|")
    for name, route, body in loads:
        status, seconds, health = health_during(args.base_url, route, body, args.delay)
        print(f"| {name} | {status} | {seconds:.2f} | {health:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
