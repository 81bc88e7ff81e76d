"""`tessera bench serve`: load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E
latency, throughput and goodput.

    tessera bench serve --base-url http://127.0.0.1:8000 --model tiny \\
        --dataset image --num-requests 200 --concurrency 16 --out result.json

Requests arrive as a Poisson process at --request-rate (default: all at once), at most
--concurrency in flight. --client-processes N splits them over N client processes (every
N-th request, a share of the concurrency and of the rate each), for loads where one
Python process cannot read every stream in time: a client that falls behind adds its lag
to the TTFT and ITL it reports. Always bounded: --num-requests requests, and after --max-duration
seconds whatever is still outstanding is cancelled and counted failed. Only loopback
servers unless --allow-remote (a load generator pointed at someone else's server is an
attack). Before any load is sent the server is asked for its models (GET /v1/models, with
or without --model) and --out is checked to be writable. Exit status: 0 when at least one
request completed, 1 when none did, 2 for bad arguments (a bad --base-url port, an --out
that cannot be written) or an unreachable / refused server, each with a one-line error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import CHAT_PATH, chat_body, stream_chat
from bench.datasets import (
    DATASETS,
    BenchRequest,
    DatasetConfig,
    make_requests,
    parse_image_size,
)
from bench.report import client_cpu_report, format_report, result_json
from bench.safety import BenchConfigError, check_loopback
from bench.stats import RequestRecord, summarize

EXIT_OK, EXIT_ALL_FAILED, EXIT_USAGE = 0, 1, 2
MAX_REQUESTS = 1_000_000


@dataclass(frozen=True)
class BenchConfig:
    """One run's settings (CLI flags one-to-one); SLOs in seconds, None when not given."""

    base_url: str
    model: str | None
    dataset: DatasetConfig
    concurrency: int | None
    request_rate: float  # requests / s; inf sends everything at once
    max_duration_s: float
    max_tokens: int
    ignore_eos: bool
    temperature: float
    extra_body: dict[str, Any]  # merged into every request (--extra-body)
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    api_key: str | None
    allow_remote: bool
    show_progress: bool
    out: str | None
    client_processes: int = 1


class Progress:
    """Progress on stderr: a `\\r` counter on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.is_tty = sys.stderr.isatty()
        self.num_done = self.num_failed = 0

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += not record.is_success
        if not self.enabled:
            return
        text = f"bench: {self.num_done}/{self.total} done, {self.num_failed} failed"
        if self.is_tty:
            sys.stderr.write("\r" + text)
        elif self.num_done * 10 // self.total != (self.num_done - 1) * 10 // self.total:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.is_tty and self.num_done:
            sys.stderr.write("\n")


async def run_requests(
    config: BenchConfig, model: str, requests: list[BenchRequest], progress: Progress
) -> tuple[list[RequestRecord], float]:
    """Send every request; returns one record per request (in order) and the wall time."""
    records: list[RequestRecord | None] = [None] * len(requests)
    limit = config.concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    arrivals = random.Random(config.dataset.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    url = config.base_url + CHAT_PATH
    tasks: list[asyncio.Task] = []

    async def one(index: int, session: aiohttp.ClientSession) -> None:
        body = chat_body(
            model,
            requests[index].content,
            max_tokens=config.max_tokens,
            ignore_eos=config.ignore_eos,
            temperature=config.temperature,
            extra=config.extra_body,
        )
        async with semaphore:
            record = await stream_chat(session, url, body, headers)
        records[index] = record
        progress.update(record)

    async def dispatch(session: aiohttp.ClientSession) -> None:
        for index in range(len(requests)):
            if index and math.isfinite(config.request_rate):
                await asyncio.sleep(arrivals.expovariate(config.request_rate))
            tasks.append(asyncio.create_task(one(index, session)))
        await asyncio.gather(*tasks)

    connector = aiohttp.TCPConnector(limit=limit)
    # No total: --max-duration cancels the run as a whole, and its records say so.
    limit_s = config.max_duration_s
    timeout = aiohttp.ClientTimeout(total=None, connect=min(30.0, limit_s), sock_read=limit_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        try:
            await asyncio.wait_for(dispatch(session), timeout=config.max_duration_s)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
    cancelled = RequestRecord(
        False, error=f"cancelled at --max-duration {config.max_duration_s:g} s"
    )
    return [record or cancelled for record in records], duration


def run_in_processes(
    config: BenchConfig, model: str, requests: list[BenchRequest]
) -> tuple[list[RequestRecord], float, float]:
    """`run_requests` split over `config.client_processes` spawned processes: process k
    sends requests k, k + N, ... with its share of the concurrency and of the rate. The
    clock starts once every process is ready, and stops when the last one has reported;
    the records come back in request order, with the CPU seconds the processes spent
    sending them (their start-up not included)."""
    num = config.client_processes
    context = multiprocessing.get_context("spawn")  # no forked event loop or sockets
    ready = context.Barrier(num + 1)
    results = context.Queue()
    processes = [
        context.Process(
            target=_client_process,
            args=(index, shard_config(config, index), model, requests[index::num], ready, results),
            daemon=True,
        )
        for index in range(num)
    ]
    for process in processes:
        process.start()
    records: list[RequestRecord | None] = [None] * len(requests)
    cpu_s = 0.0
    try:
        ready.wait(timeout=120)
        start = time.perf_counter()
        for _ in processes:
            index, shard, shard_cpu_s = results.get(timeout=config.max_duration_s + 60)
            records[index::num] = shard
            cpu_s += shard_cpu_s
        duration = time.perf_counter() - start
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    missing = RequestRecord(False, error="its client process did not report")
    return [record or missing for record in records], duration, cpu_s


def shard_config(config: BenchConfig, index: int) -> BenchConfig:
    """Client process `index`'s settings: its share of --concurrency (the shares add up to
    it) and of --request-rate, and its own arrival seed."""
    num = config.client_processes
    limit = config.concurrency or config.dataset.num_requests
    return dataclasses.replace(
        config,
        concurrency=limit // num + (index < limit % num),
        request_rate=config.request_rate / num,
        dataset=dataclasses.replace(config.dataset, seed=config.dataset.seed + index),
        client_processes=1,
        show_progress=False,
    )


def _client_process(index, config, model, requests, ready, results) -> None:
    """One client process: waits for the others, sends its requests, reports the records
    (or, if it failed, one failed record per request with the error) and its CPU."""
    ready.wait(timeout=120)
    cpu_before = time.process_time()
    try:
        progress = Progress(len(requests), enabled=False)
        records, _ = asyncio.run(run_requests(config, model, requests, progress))
    except Exception as exc:  # reported as failed requests, not as a hung parent
        records = [RequestRecord(False, error=f"client process failed: {exc!r}")] * len(requests)
    results.put((index, records, time.process_time() - cpu_before))


async def resolve_model(config: BenchConfig) -> str:
    """--model, or the first model the server lists. GET /v1/models is sent either way: an
    unreachable server is then a one-line error before the load (exit 2), not a run of
    failed requests. With --model any answer will do."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(config.base_url + "/v1/models", headers=headers) as response:
            if config.model:
                return config.model
            status = response.status
            listed = (await response.json()).get("data") if status == 200 else None
    if not listed:
        raise BenchConfigError(f"no --model given and GET /v1/models said {status}")
    return listed[0]["id"]


async def run(config: BenchConfig) -> int:
    try:
        model = await resolve_model(config)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchConfigError(f"cannot reach {config.base_url}: {type(exc).__name__}") from exc
    requests = make_requests(config.dataset)  # images are encoded here, before the clock
    progress = Progress(len(requests), config.show_progress)
    cpu_before, other_processes_cpu_s = time.process_time(), 0.0
    try:
        if config.client_processes > 1:
            records, duration, other_processes_cpu_s = await asyncio.to_thread(
                run_in_processes, config, model, requests
            )
        else:
            records, duration = await run_requests(config, model, requests, progress)
    finally:
        progress.close()
    client_cpu_s = time.process_time() - cpu_before + other_processes_cpu_s
    summary = summarize(records, duration, config.slo_ttft_s, config.slo_tpot_s)
    print(format_report(summary, records))
    print(client_cpu_report(client_cpu_s, duration, config.client_processes))
    if config.out:
        document = result_json(dataclasses.asdict(config) | {"model": model}, summary, records)
        document["summary"]["client_cpu_s"] = client_cpu_s
        Path(config.out).write_text(json.dumps(document, indent=2) + "\n")
    return EXIT_OK if summary.num_completed else EXIT_ALL_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """`tessera bench serve [flags]` (argv without the `bench serve` words)."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = config_from_args(args)
        check_loopback(config.base_url, allow_remote=config.allow_remote)
        if config.out:
            check_writable(Path(config.out))
        return asyncio.run(run(config))
    except BenchConfigError as exc:
        print(f"tessera bench serve: {exc}", file=sys.stderr)
        return EXIT_USAGE


def check_writable(path: Path) -> None:
    """Raise BenchConfigError unless `path` can be written: found before the run, not after
    it with the results lost. An existing file is left as it is (opened to append, nothing
    written); a file this check creates is removed again."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise BenchConfigError(f"cannot write --out {str(path)!r}: {exc.strerror or exc}") from exc
    if not existed:
        path.unlink(missing_ok=True)


def _grid(text: str) -> tuple[int, int, int]:
    values = [int(v) for v in text.replace("x", ",").split(",")]
    if len(values) != 3:
        raise ValueError(text)
    return values[0], values[1], values[2]


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: first listed)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=DATASETS, default="text")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate, req/s")
    p.add_argument("--client-processes", type=int, default=1,
                   help="client processes the requests are split over")  # fmt: skip
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds; then cancel")
    p.add_argument("--input-len", type=int, default=128, help="random text words (~tokens)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=_json_object, default={},
                   help='JSON merged into every request, e.g. \'{"min_tokens": 8}\'')  # fmt: skip
    p.add_argument("--image-size", type=parse_image_size, default=(448, 448), help="WxH")
    p.add_argument("--image-repeat-ratio", type=float, default=0.0)
    p.add_argument("--feature-url", action="append", default=[], help="repeatable")
    p.add_argument("--feature-grid-thw", type=_grid, default=(1, 16, 16), help="T,H,W")
    p.add_argument("--slo-ttft", type=float, default=None, help="milliseconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="milliseconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback servers")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate the flags (BenchConfigError names the bad one) and freeze them."""
    checks = [
        (1 <= args.num_requests <= MAX_REQUESTS, f"--num-requests must be 1..{MAX_REQUESTS}"),
        (args.concurrency is None or args.concurrency >= 1, "--concurrency must be >= 1"),
        (args.request_rate > 0, "--request-rate must be > 0"),
        (0 < args.max_duration < math.inf, "--max-duration must be a positive number"),
        (args.input_len >= 1 and args.max_tokens >= 1, "--input-len/--max-tokens must be >= 1"),
        (min(args.image_size) >= 1 and max(args.image_size) <= 8192, "--image-size out of range"),
        (0.0 <= args.image_repeat_ratio <= 1.0, "--image-repeat-ratio must be in [0, 1]"),
        (min(args.feature_grid_thw) >= 1, "--feature-grid-thw must be positive"),
        (args.dataset != "features" or args.feature_url, "--dataset features needs --feature-url"),
        (
            1 <= args.client_processes <= min(args.num_requests, args.concurrency or math.inf, 64),
            "--client-processes must be 1..64 and at most --num-requests and --concurrency",
        ),
    ]
    for is_ok, message in checks:
        if not is_ok:
            raise BenchConfigError(message)
    dataset = DatasetConfig(
        dataset=args.dataset,
        num_requests=args.num_requests,
        input_len=args.input_len,
        image_size=args.image_size,
        image_repeat_ratio=args.image_repeat_ratio,
        feature_urls=tuple(args.feature_url),
        feature_grid_thw=args.feature_grid_thw,
        seed=args.seed,
    )
    return BenchConfig(
        base_url=args.base_url.rstrip("/").removesuffix("/v1"),  # accept OpenAI-style URLs
        model=args.model,
        dataset=dataset,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        max_duration_s=args.max_duration,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        slo_ttft_s=None if args.slo_ttft is None else args.slo_ttft / 1000,
        slo_tpot_s=None if args.slo_tpot is None else args.slo_tpot / 1000,
        api_key=args.api_key,
        allow_remote=args.allow_remote,
        show_progress=not args.no_progress,
        out=args.out,
        client_processes=args.client_processes,
    )


if __name__ == "__main__":
    sys.exit(main())
