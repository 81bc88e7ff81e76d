"""Bounded load soak: many greedy chat requests (text, images, pre-encoded features) at high
concurrency against a loopback server, checked against a run at concurrency 1.

    python -m bench.load_soak --num-requests 500 --concurrency 64      # starts its own server
    python -m bench.load_soak --base-url http://127.0.0.1:8000 --server-pid 1234
    python -m bench.load_soak --server-flags "--api-server-count 2"    # another setup

Passes when every request gets exactly one complete 200 response equal to its concurrency-1
reference, no 5xx, KV usage returns to zero, and server RSS (server + engine child) after the
run is at most --max-rss-ratio times RSS after warm-up. Loopback only; bounded by
--num-requests and --max-duration. Exit status 0 on pass, 1 on fail, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.datasets import data_url
from bench.local_inputs import FEATURE_GRID, features, picture, png_bytes
from bench.safety import BenchConfigError, check_loopback
from bench.servers import TINY_MODEL_NAME, child_pids, tiny_server

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


@dataclass(frozen=True)
class SoakConfig:
    """What to send: request count, concurrency, generation length and the request mix."""

    num_requests: int = 500
    concurrency: int = 64
    max_tokens: int = 8
    num_distinct: int = 48  # distinct prompts; requests cycle through them
    prompt_words: int = 120  # text length; long prompts + a small KV pool force preemption
    feature_hidden: int = 128  # the model's hidden size (feature rows must match it)
    max_duration_s: float = 600.0
    max_rss_ratio: float = 1.2


@dataclass
class SoakReport:
    """Outcome of one soak run; `failures` lists human-readable problems (empty = pass)."""

    num_requests: int = 0
    completed: int = 0
    mismatched: int = 0
    num_5xx: int = 0
    num_errors: int = 0
    preemptions: float = 0.0
    kv_usage_end: float = -1.0
    rss_warm_kib: int = 0
    rss_end_kib: int = 0
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def make_bodies(config: SoakConfig) -> list[dict]:
    """The distinct request bodies: one third text-only, one third image, one third features."""
    bodies = []
    for index in range(config.num_distinct):
        words = [WORDS[(index * 7 + k * (index % 5 + 1)) % len(WORDS)] for k in range(200)]
        text = f"request {index}: " + " ".join(words[: config.prompt_words // (1 + index % 3)])
        parts: list[dict] = []
        if index % 3 == 1:
            url = data_url(png_bytes(picture(56 + 28 * (index % 2), 56, index)), "image/png")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif index % 3 == 2:
            url = data_url(features(index, hidden=config.feature_hidden))
            feature = {"url": url, "grid_thw": list(FEATURE_GRID)}
            parts.append({"type": "image_features", "image_features": feature})
        parts.append({"type": "text", "text": text})
        bodies.append({
            "model": TINY_MODEL_NAME,
            "messages": [{"role": "user", "content": parts}],
            "max_tokens": config.max_tokens,
            "temperature": 0,
        })  # fmt: skip
    return bodies


@dataclass(frozen=True)
class _Outcome:
    status: int
    content: str | None  # None unless exactly one complete choice came back
    detail: str


async def _send(client: httpx.AsyncClient, body: dict) -> _Outcome:
    try:
        response = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return _Outcome(0, None, f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return _Outcome(response.status_code, None, response.text[:300])
    choices = response.json().get("choices", [])
    if len(choices) != 1 or choices[0].get("finish_reason") not in ("stop", "length"):
        return _Outcome(200, None, f"incomplete response: {response.text[:300]}")
    return _Outcome(200, choices[0]["message"]["content"], "")


async def _run_all(
    base_url: str, bodies: Sequence[dict], concurrency: int, timeout_s: float
) -> list[_Outcome]:
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        async def one(body: dict) -> _Outcome:
            async with semaphore:
                return await _send(client, body)

        return await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), timeout_s)


def metric_value(base_url: str, name: str) -> float:
    """Sum of all samples of one Prometheus metric from the server's /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def process_tree_rss_kib(pid: int) -> int:
    """VmRSS (KiB) of `pid` plus all its descendants (the engine child), from /proc."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            pending += child_pids(current)
    return total


def _wait_kv_zero(base_url: str, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    usage = metric_value(base_url, "tessera:kv_cache_usage_perc")
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        usage = metric_value(base_url, "tessera:kv_cache_usage_perc")
    return usage


def run_soak(base_url: str, server_pid: int | None, config: SoakConfig) -> SoakReport:
    """Reference pass at concurrency 1 (doubles as warm-up), then the load; check everything."""
    check_loopback(base_url, allow_remote=False)
    bodies = make_bodies(config)
    report = SoakReport(num_requests=config.num_requests)
    reference = asyncio.run(_run_all(base_url, bodies, 1, config.max_duration_s))
    bad = [(i, o) for i, o in enumerate(reference) if o.content is None]
    if bad:
        report.failures.append(f"{len(bad)} reference requests failed, first: {bad[0]}")
        return report
    warm = [bodies[i % len(bodies)] for i in range(config.concurrency)]
    asyncio.run(_run_all(base_url, warm, config.concurrency, config.max_duration_s))
    _wait_kv_zero(base_url)
    if server_pid is not None:
        report.rss_warm_kib = process_tree_rss_kib(server_pid)
    preempted_before = metric_value(base_url, "tessera:num_preemptions_total")

    order = [i % len(bodies) for i in range(config.num_requests)]
    started = time.monotonic()
    outcomes = asyncio.run(
        _run_all(base_url, [bodies[i] for i in order], config.concurrency, config.max_duration_s)
    )
    report.wall_s = time.monotonic() - started
    for index, outcome in zip(order, outcomes, strict=True):
        if outcome.status >= 500:
            report.num_5xx += 1
        if outcome.content is None:
            report.num_errors += 1
            if report.num_errors <= 3:
                report.failures.append(f"request {index}: {outcome.status} {outcome.detail}")
        elif outcome.content != reference[index].content:
            report.mismatched += 1
            if report.mismatched <= 3:
                report.failures.append(
                    f"request {index}: {outcome.content!r} != {reference[index].content!r}"
                )
        else:
            report.completed += 1
    report.preemptions = metric_value(base_url, "tessera:num_preemptions_total") - preempted_before
    report.kv_usage_end = _wait_kv_zero(base_url)
    if report.num_5xx:
        report.failures.append(f"{report.num_5xx} responses were 5xx")
    if report.num_errors or report.mismatched:
        report.failures.append(f"{report.num_errors} failed, {report.mismatched} mismatched")
    if report.kv_usage_end != 0:
        report.failures.append(f"KV usage {report.kv_usage_end} at the end, not 0")
    if server_pid is not None:
        report.rss_end_kib = process_tree_rss_kib(server_pid)
        if report.rss_end_kib > config.max_rss_ratio * report.rss_warm_kib:
            report.failures.append(
                f"RSS grew {report.rss_warm_kib} -> {report.rss_end_kib} KiB "
                f"(> {config.max_rss_ratio}x)"
            )
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an already running loopback server")
    parser.add_argument("--server-pid", type=int, help="its pid, for RSS (with --base-url)")
    parser.add_argument("--model", help="checkpoint folder (default: a fresh tiny model)")
    parser.add_argument("--num-kv-blocks", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--num-requests", type=int, default=SoakConfig.num_requests)
    parser.add_argument("--concurrency", type=int, default=SoakConfig.concurrency)
    parser.add_argument("--max-tokens", type=int, default=SoakConfig.max_tokens)
    parser.add_argument("--num-distinct", type=int, default=SoakConfig.num_distinct)
    parser.add_argument("--max-duration", type=float, default=SoakConfig.max_duration_s)
    parser.add_argument("--server-flags", default="",
                        help='more `tessera serve` flags, e.g. "--api-server-count 2"')  # fmt: skip
    parser.add_argument("--out", help="write the report as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.num_requests, args.concurrency, args.max_tokens, args.num_distinct) < 1:
        print("error: counts must be >= 1", file=sys.stderr)
        return 2
    config = SoakConfig(
        num_requests=args.num_requests, concurrency=args.concurrency,
        max_tokens=args.max_tokens, num_distinct=args.num_distinct,
        max_duration_s=args.max_duration,
    )  # fmt: skip
    try:
        if args.base_url:
            report = run_soak(args.base_url, args.server_pid, config)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = Path(args.model) if args.model else _tiny_model(Path(tmp))
                extra = ("--num-kv-blocks", str(args.num_kv_blocks),
                         "--max-model-len", str(args.max_model_len))  # fmt: skip
                log = Path(tmp) / "server.log"
                flags = ("--enable-feature-inputs", *extra, *args.server_flags.split())
                with tiny_server(model_dir, log, *flags) as (url, process):
                    report = run_soak(url, process.pid, config)
    except BenchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {**asdict(report), "passed": report.passed}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0 if report.passed else 1


def _tiny_model(folder: Path) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(folder / "model")


if __name__ == "__main__":
    sys.exit(main())
