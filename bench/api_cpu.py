"""Benchmark (not a test): the CPU the API process spends per request and per streamed token.

    PYTHONPATH=. python bench/api_cpu.py
    PYTHONPATH=. python bench/api_cpu.py --baseline-repo /tmp/old   # side by side
    PYTHONPATH=. python bench/api_cpu.py --variants "" "--api-server-count 2"   # two configs

Why: on a GPU the engine makes tokens faster than one Python process can stream them if
every token costs hundreds of microseconds there (issue 8's 2B serving run: the API
process used a whole core and capped throughput). The engine here runs the tiny generated
checkpoint, so it is cheap and the API process's own work shows.

For each server (with --baseline-repo: one started from that checkout, then this one),
it runs the loads below with `tessera bench serve` (each request streams --max-tokens
tokens, ignore_eos) and reads the user + system CPU time of the API process and of the
engine process from /proc before and after each load:

  text   --input-len random words
  image  the same plus one distinct --image-size PNG image per request (a data: URL:
         base64, PNG decode, resize, normalise, patchify, hash on the API process)
  image-same  one image shared by every request: after the first, the processed-image
         cache answers, so image minus image-same is what decoding and preprocessing
         cost (pass --max-tokens 1 to leave streaming out of the numbers)

With --variants, this checkout's server runs once per variant, each a string of extra
`tessera serve` flags ("" = none); with --api-server-count, API CPU is the sum over the
API processes.

It prints API CPU ms per request, API CPU us per output token, engine CPU, output
tokens/s and p50 TTFT, per load; with several servers, also each / the first. CPU time is less noisy than wall time on a shared
machine, but the client runs on the same cores: compare within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.servers import (
    REPO_ROOT,
    TINY_MODEL_NAME,
    cpu_seconds,
    server_processes,
    tiny_server,
)

LOADS = {
    "text": ["--dataset", "text"],
    "image": ["--dataset", "image"],
    "image-same": ["--dataset", "image", "--image-repeat-ratio", "1"],  # overrides common's 0
}
SERVER_FLAGS = ("--num-kv-blocks", "4096", "--max-model-len", "2048")


def run_load(base_url: str, flags: list[str], out: Path) -> dict:
    from bench.serve import main as bench_main

    with contextlib.redirect_stdout(sys.stderr):  # its report; the table goes to stdout
        code = bench_main(["--base-url", base_url, "--model", TINY_MODEL_NAME, "--out",
                           str(out), "--no-progress", *flags])  # fmt: skip
    if code != 0:
        raise RuntimeError(f"the load failed (exit {code}); see {out}")
    return json.loads(out.read_text())


def measure(
    name: str,
    repo: Path,
    model_dir: Path,
    args: argparse.Namespace,
    work: Path,
    extra_flags: Sequence[str] = (),
) -> dict:
    common = [
        "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
        "--max-tokens", str(args.max_tokens), "--ignore-eos", "--input-len",
        str(args.input_len), "--image-size", args.image_size, "--image-repeat-ratio", "0",
    ]  # fmt: skip
    results = {}
    # One engine thread: the engine's matmuls then leave the second core to the API
    # process and the client, as a GPU engine would.
    log = work / f"{name.replace(' ', '-')}.log"
    server = tiny_server(model_dir, log, *SERVER_FLAGS, *extra_flags, engine_threads=1, repo=repo)
    with server as (base_url, process):
        engine, api_pids = server_processes(process.pid)

        def api_cpu() -> float:
            return sum(cpu_seconds(pid) for pid in api_pids)

        warmup = [*common[:1], "8", *common[2:], "--dataset", "image", "--seed", "999"]
        run_load(base_url, warmup, log.with_name(f"{log.stem}-warmup.json"))
        for load in args.loads:
            api_before, engine_before = api_cpu(), cpu_seconds(engine)
            load_flags = [*common, *LOADS[load], "--seed", str(args.seed)]
            summary = run_load(base_url, load_flags, log.with_name(f"{log.stem}-{load}.json"))[
                "summary"
            ]
            api_s = api_cpu() - api_before
            engine_s = cpu_seconds(engine) - engine_before
            tokens = summary["total_output_tokens"]
            results[load] = {
                "completed": summary["completed"],
                "api_cpu_s": api_s,
                "api_ms_per_request": 1000 * api_s / summary["completed"],
                "api_us_per_token": 1e6 * api_s / tokens,
                "engine_cpu_s": engine_s,
                "output_throughput": summary["output_throughput"],
                "p50_ttft_ms": summary["p50_ttft_ms"],
            }
            print(f"[{name}] {load}: {json.dumps(results[load])}", file=sys.stderr)
    return results


def table(results: dict[str, dict[str, dict]], loads: Sequence[str]) -> str:
    names = list(results)
    lines = ["| load | server | API ms/request | API us/token | engine CPU s | out tok/s "
             "| p50 TTFT ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for load in loads:
        for name in names:
            row = results[name][load]
            lines.append(
                f"| {load} | {name} | {row['api_ms_per_request']:.1f} | "
                f"{row['api_us_per_token']:.0f} | {row['engine_cpu_s']:.1f} | "
                f"{row['output_throughput']:.0f} | {row['p50_ttft_ms']:.0f} |"
            )
        first = results[names[0]][load]
        for name in names[1:]:
            row = results[name][load]
            lines.append(
                f"| {load} | {name} / {names[0]} "
                f"| {row['api_ms_per_request'] / first['api_ms_per_request']:.2f} | | "
                f"| {row['output_throughput'] / first['output_throughput']:.2f} "
                f"| {row['p50_ttft_ms'] / first['p50_ttft_ms']:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-repo", type=Path, help="another checkout, measured first")
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=["text", "image"])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--image-size", default="448x448")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=[""],
                        help='this checkout\'s server once per variant: extra serve flags, "" = none')  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="tessera-api-cpu-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny")
        servers = [(_name(flags), REPO_ROOT, flags.split()) for flags in args.variants]
        if args.baseline_repo is not None:
            servers.insert(0, ("baseline", args.baseline_repo.resolve(), []))
        results = {}
        for name, repo, flags in servers:
            results[name] = measure(name, repo, model_dir, args, work, flags)
    print(table(results, args.loads))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def _name(flags: str) -> str:
    return f"this {flags}".strip()


if __name__ == "__main__":
    sys.exit(main())
