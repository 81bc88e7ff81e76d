"""Benchmark (not a test; needs a GPU): serving throughput and TTFT, Tessera against
transformers `generate()`, same checkpoint, same requests, same GPU, same run.

    PYTHONPATH=. python3 bench/gpu_serving.py --size qwen2-vl-2b --out serving-2b.json

The load (issue 8): --num-requests streaming chat requests, each one distinct
--image-size random image plus about --input-len words of text, --max-tokens output
tokens each (ignore_eos), at --concurrency requests in flight.

  tessera  `tessera serve` on 127.0.0.1 (FlashInfer, CUDA graphs), driven over HTTP by the
           `tessera bench serve` client after a short unmeasured warm-up
  hf       bench/hf_baseline.py: the same requests in static batches of --concurrency,
           left-padded, greedy, exactly --max-tokens new tokens each, one batch after the
           other from one clock start (a request of batch k waits for batches 0..k-1)

Both report through bench/report.py, so output tok/s and TTFT p50/p99 read side by side;
the ratios are Tessera / transformers. The checkpoint is written once under --model-root
(random weights of the real Qwen2-VL shape, drawn on the GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import (
    HOST,
    ServerSpec,
    cpu_seconds,
    free_port,
    repo_pythonpath,
    server_processes,
    started,
)

SERVED_MODEL_NAME = "bench"
COLUMNS = [  # (summary key, title)
    ("completed", "ok"),
    ("failed", "failed"),
    ("output_throughput", "out tok/s"),
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("mean_itl_ms", "ITL mean ms"),
    ("duration_s", "wall s"),
    ("api_cpu_s", "API CPU s"),  # tessera: user + system of its API process(es)
    # tessera: the mean TTFT the server measured (arrival to first token, from /metrics),
    # and the load client's CPU over the run (tessera bench serve's): a client that falls
    # behind reading 128 streams adds to the TTFT it reports, not to the server's.
    ("server_mean_ttft_ms", "server TTFT mean ms"),
    ("client_cpu_s", "client CPU s"),
]


def load_flags(args: argparse.Namespace) -> list[str]:
    """The dataset flags `tessera bench serve` and bench/hf_baseline.py share."""
    return [
        "--dataset", "image", "--image-repeat-ratio", "0.0", "--num-requests",
        str(args.num_requests), "--input-len", str(args.input_len), "--image-size",
        args.image_size, "--seed", str(args.seed),
    ]  # fmt: skip


def tessera_spec(args: argparse.Namespace, model_dir: Path, port: int) -> ServerSpec:
    command = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir),
        "--host", HOST, "--port", str(port), "--served-model-name", SERVED_MODEL_NAME,
        "--device", args.device, "--dtype", args.dtype,
        "--attention-backend", args.attention_backend,
        "--max-num-seqs", str(args.concurrency), "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-memory-gib", str(args.kv_cache_memory_gib),
        "--max-waiting-requests", str(args.num_requests), "--log-level", "warning",
        *args.tessera_arg,
    ]  # fmt: skip
    return ServerSpec("tessera", command, {"PYTHONPATH": repo_pythonpath()})


def run_tessera(args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    from bench.serve import main as bench_main

    port = free_port()
    spec = tessera_spec(args, model_dir, port)
    with started(spec, port, work, args.startup_timeout) as (base_url, process):
        common = ["--base-url", base_url, "--model", SERVED_MODEL_NAME, "--ignore-eos",
                  "--no-progress"]  # fmt: skip
        warm = ["--num-requests", str(args.warmup_requests), "--concurrency",
                str(args.warmup_requests), "--max-tokens", "8", "--dataset", "image",
                "--seed", str(args.seed + 1000), "--out", str(work / "warmup.json")]  # fmt: skip
        bench_main(common + warm)
        out = work / "tessera.json"
        _, api_pids = server_processes(process.pid)
        api_before = sum(cpu_seconds(pid) for pid in api_pids)
        ttft_before = ttft_totals(scrape(base_url))
        bench_main(common + load_flags(args) + ["--concurrency", str(args.concurrency),
                   "--max-tokens", str(args.max_tokens), "--client-processes",
                   str(args.client_processes), "--out", str(out)])  # fmt: skip
        api_cpu_s = sum(cpu_seconds(pid) for pid in api_pids) - api_before
        # Where the server's time went (encoder, steps, queues), for the run's notes.
        metrics = scrape(base_url)
        (work / "metrics.txt").write_text(metrics)
    ttft_sum, ttft_count = (a - b for a, b in zip(ttft_totals(metrics), ttft_before, strict=True))
    result = json.loads(out.read_text())
    result["summary"].update(
        api_cpu_s=api_cpu_s,
        server_mean_ttft_ms=1000 * ttft_sum / ttft_count if ttft_count else None,
    )
    return result


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=30.0, trust_env=False).text


def ttft_totals(metrics: str) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram, over its labels."""
    totals = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(metrics):
        if family.name == "tessera:time_to_first_token_seconds":
            for sample in family.samples:
                for key in totals:
                    if sample.name == f"{family.name}_{key}":
                        totals[key] += sample.value
    return totals["sum"], totals["count"]


def run_hf(args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    from bench.hf_baseline import main as hf_main

    out = work / "hf.json"
    hf_main([str(model_dir), *load_flags(args), "--batch-size", str(args.concurrency),
             "--max-new-tokens", str(args.max_tokens), "--device", args.device,
             "--dtype", args.dtype, "--out", str(out)])  # fmt: skip
    return json.loads(out.read_text())


def table(results: dict[str, dict]) -> str:
    lines = ["| run | " + " | ".join(title for _, title in COLUMNS) + " |"]
    lines.append("|" + "---|" * (len(COLUMNS) + 1))
    for name, result in results.items():
        summary = result["summary"]
        lines.append(f"| {name} | " + " | ".join(_cell(summary.get(k)) for k, _ in COLUMNS) + " |")
    if {"tessera", "hf"} <= set(results):
        ours, theirs = results["tessera"]["summary"], results["hf"]["summary"]
        cells = []
        for key, _ in COLUMNS:
            ok = isinstance(ours.get(key), float) and theirs.get(key)
            cells.append(_cell(ours[key] / theirs[key], 2) if ok else "")
        lines.append("| tessera / hf | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="qwen2-vl-2b")
    parser.add_argument("--model-root", default="/tmp/tessera-models")
    parser.add_argument("--runs", nargs="+", default=["tessera", "hf"], choices=["tessera", "hf"])
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=200, help="words of text (~tokens)")
    parser.add_argument("--image-size", default="448x448")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="load client processes (tessera bench serve --client-processes)",
    )
    parser.add_argument("--attention-backend", default="flashinfer")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=20.0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--tessera-arg", action="append", default=[],
                        help="extra `tessera serve` flag (repeat; --tessera-arg=--flag)")  # fmt: skip
    parser.add_argument("--log-dir", help="server log and per-run JSON (default: a temp dir)")
    parser.add_argument("--out", help="write both runs' results and the table here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from bench.gpu_decode import ensure_model

    model_dir = ensure_model(Path(args.model_root), args.size, args.device)
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="gpu_serving-"))
    work.mkdir(parents=True, exist_ok=True)
    runners = {"tessera": run_tessera, "hf": run_hf}
    results = {name: runners[name](args, model_dir, work) for name in args.runs}
    report = table(results)
    print(report)
    if args.out:
        summaries = {name: result["summary"] for name, result in results.items()}
        payload = {"config": vars(args), "summaries": summaries, "table": report}
        Path(args.out).write_text(json.dumps(payload, indent=2))
    failed = sum(result["summary"].get("failed", 0) for result in results.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
